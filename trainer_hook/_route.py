"""Where a rank's transport connects next: its node agent first (when it has one), then the
backend URLs in turn, or the replica a redirect named. Owned by the transport's thread.

A replica that cannot be reached, or went silent, moves the route on to the next URL of the
list; a redirect is followed at once and forgotten when its target fails (the owner may have
died: the list is asked again). An agent that cannot be trusted, or refused this rank, leaves
the route for good: the rank uses its own connection from then on."""

from __future__ import annotations

import logging
import time

from trainer_hook._urls import UNIX, hook_ws_url

__all__ = ["Route"]

log = logging.getLogger("trainer_hook.transport")


class Route:
    """The transport's URLs and which one it tries next (``pick``)."""

    def __init__(self, urls: list[str], *, agent: str | None, agent_wait_s: float) -> None:
        self.urls = ([UNIX + agent] if agent is not None else []) + list(urls)
        self.agent_wait_until = time.monotonic() + float(agent_wait_s)
        self.fallback_said = False  # the warning that this rank connects on its own
        self.redirect: str | None = None  # the replica that controls the job, when told
        self.redirects = 0  # redirects followed since the last session that was not one
        self._next = 0  # which of ``urls`` to try next
        self.url = self.urls[0]  # the URL of the current (or last) connection attempt

    @property
    def on_agent(self) -> bool:
        return self.url.startswith(UNIX)

    def pick(self) -> str:
        self.url = self.redirect or self.urls[self._next]
        return self.url

    def move_on(self) -> None:
        """The URL tried failed: the next replica of the list (a redirect's target is forgotten)."""
        if self.redirect is None:
            self._next = (self._next + 1) % len(self.urls)
        self.redirect = None

    def drop_agent(self) -> None:
        """Never the node agent again: this rank's own connection from now on."""
        self.fallback_said = True
        if self.urls[0].startswith(UNIX):
            self.urls.pop(0)
        self._next, self.redirect = 0, None

    def follow(self, url: str) -> None:
        """A redirect to ``url``: kept when it is a backend URL we may connect to."""
        try:
            target = hook_ws_url(url)
        except ValueError as exc:
            log.warning("Ignoring a redirect from %s to %r: %s", self.url, url, exc)
            return
        if target != self.url:
            log.info("%s sends this rank to %s (the replica that controls the job).", self.url, target)
            self.redirect = target

    def last_chance(self) -> str:
        """Where a closing rank flushes while disconnected: never an agent (it is gone)."""
        target = self.redirect or self.url
        return next(u for u in self.urls if not u.startswith(UNIX)) if target.startswith(UNIX) else target
