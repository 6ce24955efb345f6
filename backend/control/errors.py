"""Refused control actions. Each carries the HTTP status the API answers with.

``backend.control.controller`` re-exports these names; routes and tests import them from there.
"""

from __future__ import annotations

__all__ = ["ControlError", "NotFoundError", "ConflictError", "ElsewhereError", "FencedError", "InvalidError",
           "StateError", "error_detail"]


class ControlError(Exception):
    """A refused control action; ``status_code`` is the HTTP status the API answers with."""

    status_code = 400

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class NotFoundError(ControlError):
    status_code = 404


class ConflictError(ControlError):
    status_code = 409


class ElsewhereError(ConflictError):
    """An operator action on a job another replica controls: the API forwards it to
    ``url`` (the owner's advertised URL, "" when it has none) or answers 409 with it."""

    def __init__(self, detail: str, *, job: str, owner: str, url: str):
        super().__init__(detail)
        self.job, self.owner, self.url = job, owner, url


class FencedError(ConflictError):
    """A control write the store of record refused: this replica no longer holds the job's
    lease epoch (another replica took the job). Nothing was written."""

    def __init__(self, detail: str, *, job: str):
        super().__init__(detail)
        self.job = job


class InvalidError(ControlError):
    status_code = 422


class StateError(InvalidError):
    """Well-formed input that the job's state refuses (a placement that does not sum to its
    global batch, breaks its overrides or memory caps): 400, since the OpenAPI document
    cannot say it and a 422 means the request broke the document."""

    status_code = 400


def error_detail(exc: Exception) -> str:
    """The sentence an exception says: ``detail`` for a ControlError, else its text."""
    return exc.detail if isinstance(exc, ControlError) else str(exc)
