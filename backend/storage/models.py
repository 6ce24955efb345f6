"""``load_models()``: import every module that declares tables on ``Base``, so that
``Base.metadata`` knows the whole schema (migrations' create_head, tests)."""

from __future__ import annotations

__all__ = ["load_models"]


def load_models() -> None:
    import backend.storage.control  # noqa: F401
    import backend.storage.metrics  # noqa: F401
    import backend.storage.owners  # noqa: F401
    import backend.storage.summaries  # noqa: F401
    import backend.storage.tokens  # noqa: F401
