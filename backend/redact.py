"""Secrets never reach a log: a logging filter that blanks token values in every line.

Browsers and older clients may still put ``?token=SECRET`` in a URL, and uvicorn's access
and websocket lines print the URL with its query string. ``RedactSecrets`` rewrites each
record's message and string arguments before any handler formats them: ``token=`` (and
``access_token=``) values and anything shaped like a Rebalancer secret (``rb_...``) become
``[redacted]``. ``install()`` puts it on every handler of the root logger; ``log_config()``
is uvicorn's logging configuration with the filter on its handlers.
"""

from __future__ import annotations

import copy
import logging
import re
from typing import Any

__all__ = ["RedactSecrets", "redact", "install", "log_config"]

_PATTERNS = (
    (re.compile(r"(?i)((?:^|[?&;\s])(?:access_)?token=)[^&\s\"';]+"), r"\1[redacted]"),
    (re.compile(r"\brb_[A-Za-z0-9_\-]{8,}"), "rb_[redacted]"),
)


def redact(text: str) -> str:
    """``text`` with every token value replaced by ``[redacted]``."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class RedactSecrets(logging.Filter):
    """Blank token values in a record's message and arguments (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def install() -> None:
    """Add the filter to every handler of the root logger (call after basicConfig)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactSecrets) for f in handler.filters):
            handler.addFilter(RedactSecrets())


def log_config() -> dict[str, Any]:
    """uvicorn's default logging configuration with ``RedactSecrets`` on its handlers."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_secrets"] = {"()": RedactSecrets}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_secrets")
    return config
