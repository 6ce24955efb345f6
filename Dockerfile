# The Rebalancer backend (no torch: the training hook runs in the training job's image).
# The cluster extra (Redis client) lets several replicas share jobs (docs/scale-out.md).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
# The wire format both sides import (standard library only), the backend, and the hook
# package the wheel also holds (not imported by the server: it needs no torch).
COPY rebalancer_wire ./rebalancer_wire
COPY backend ./backend
COPY trainer_hook ./trainer_hook
# The dashboard's files are package data (the top-level frontend package), so a plain install serves them.
COPY frontend ./frontend
RUN pip install ".[server,cluster]" && useradd --system --uid 1000 rebalancer
USER rebalancer
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"
ENTRYPOINT ["rebalancer"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
