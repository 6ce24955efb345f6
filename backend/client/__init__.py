"""A typed Python client for the backend's REST API and dashboard feed (standard library only).

It needs none of the server's packages (FastAPI, pydantic, SQLAlchemy): install plain
``torch-rebalancer`` and it works; ``watch`` also needs ``websockets`` (``torch-rebalancer[client]``).

Example::

    from backend.client import Client, APIError

    rb = Client("http://127.0.0.1:8000", token="rb_...")   # or REBALANCER_SERVER / _TOKEN
    job = rb.job("demo")
    pending = rb.proposals("demo", status="proposed")
    if pending:
        try:
            rb.approve("demo", pending[0]["id"], reason="looks right")
        except APIError as exc:       # exc.status == 409, exc.detail == the server's sentence
            print(exc.detail)

Every method is one HTTP request. The server's refusals raise :class:`APIError` with the
status and the server's ``detail`` sentence; a server that cannot be reached raises
:class:`ServerUnreachable`. Lists come back as Python lists (the server's ``data``).
"""

from __future__ import annotations

from backend.client import resources
from backend.client.resources import *  # noqa: F403  (the response types, generated: resources.__all__)
from backend.client.rest import DEFAULT_SERVER, APIError, Client, ServerUnreachable

__all__ = ["Client", "APIError", "ServerUnreachable", "DEFAULT_SERVER", *resources.__all__]
