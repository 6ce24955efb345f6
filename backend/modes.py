"""The control modes, named once: ``observe`` (show only), ``approve`` (proposals wait for an
operator), ``auto`` (proposals apply under guardrails). Standard library only (the client's
CLI imports it)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MODES", "Mode"]

Mode = Literal["observe", "approve", "auto"]
MODES: tuple[str, ...] = get_args(Mode)
