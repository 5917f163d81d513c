"""A lazy deadline for asyncio protocols: the gateway's listener (a request's head, a kept-alive
connection's next request) and its upstream client (the next byte of a response).

Guarantee: ``fired(owner)`` is called once the loop's clock has passed the latest deadline
``set`` and neither ``clear`` nor ``cancel`` came after it; never otherwise. ``set`` only moves the
deadline while a timer is pending (a timer that fires early waits out the rest), so arming one
for every request or chunk costs no timer made and cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["LazyDeadline"]


class LazyDeadline:
    """One deadline, at most one pending timer (see the module docs)."""

    __slots__ = ("at", "fired", "handle", "loop", "owner")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, fired: Callable[[Any], None], owner: Any
    ) -> None:
        self.loop = loop
        self.fired = fired
        self.owner = owner
        self.at: float | None = None
        self.handle: asyncio.TimerHandle | None = None

    def set(self, seconds: float) -> None:
        """The deadline is ``seconds`` from now."""
        self.at = self.loop.time() + seconds
        if self.handle is None:
            self.handle = self.loop.call_later(seconds, self._check)

    def clear(self) -> None:
        """No deadline (a pending timer lapses when it fires)."""
        self.at = None

    def cancel(self) -> None:
        """No deadline, and no pending timer (the owner is going away)."""
        self.at = None
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _check(self) -> None:
        self.handle = None
        if self.at is None:
            return
        left = self.at - self.loop.time()
        if left > 0:
            self.handle = self.loop.call_later(left, self._check)
            return
        self.at = None
        self.fired(self.owner)
