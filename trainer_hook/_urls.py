"""The hook's websocket URLs: the backend base URL a user gives, turned into where a rank
connects (``hook_ws_url``), and the form of a node agent's unix socket in that list."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

__all__ = ["UNIX", "WS_PATH", "hook_ws_url", "hook_ws_urls"]

WS_PATH = "/ws/hook"
UNIX = "unix:"  # a URL in a route's list that is a node agent's unix socket (trainer_hook/node_agg.py)


def hook_ws_url(server: str) -> str:
    """Turn the backend base URL a user gives into the hook's websocket URL.

    ``http://host:8000`` -> ``ws://host:8000/ws/hook``; ``https`` -> ``wss``; ``ws(s)://``
    is kept; a path prefix (a reverse proxy mount) is kept. Raises ValueError otherwise.
    """
    if not isinstance(server, str) or not server.strip():
        raise ValueError(f"server must be a URL like 'http://127.0.0.1:8000', got {server!r}.")
    parts = urlsplit(server.strip())
    schemes = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(
            f"server must be a URL like 'http://127.0.0.1:8000' (scheme http, https, ws or wss "
            f"and a host), got {server!r}."
        )
    path = parts.path.rstrip("/")
    if not path.endswith(WS_PATH):
        path += WS_PATH
    return urlunsplit((schemes[parts.scheme], parts.netloc, path, parts.query, ""))


def hook_ws_urls(server: str) -> list[str]:
    """``hook_ws_url`` for each of several comma-separated backend URLs (replicas)."""
    if not isinstance(server, str) or not server.strip():
        raise ValueError(f"server must be a URL like 'http://127.0.0.1:8000', got {server!r}.")
    urls = [hook_ws_url(part) for part in server.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"server must be a URL like 'http://127.0.0.1:8000', got {server!r}.")
    return urls
