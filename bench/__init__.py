"""Benchmarks that measure what Rebalancer buys and what it costs.

Not part of the test run: ``make bench`` (``python -m bench.run_all``) writes JSON and PNG
results under ``bench/results/``; ``make bench-quick`` runs a smaller version. The smoke
tests in ``tests/bench/`` only check that each benchmark runs in tiny mode.
"""

__all__: list[str] = []
