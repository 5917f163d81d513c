"""Background tasks of a server: ended for sure when it stops.

:func:`cancel_tasks` cancels every task given (``None`` skipped) and returns only once each has
ended, however often a cancel is lost: Python 3.11's ``asyncio.wait_for`` returns the result when
a cancel meets the completion it was waiting for, and the task runs on — so a task still running
is cancelled again. A task's cancellation is not raised to the caller; another exception of a
task is (the first in the order given; the others are logged), after every task has ended.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvroute.server")

# How long to wait for the cancelled tasks before cancelling the ones still running again.
RECANCEL_S = 0.1


async def cancel_tasks(*tasks: asyncio.Task | None) -> None:
    """Cancels ``tasks`` (``None`` ignored) until each has ended; raises the first exception a
    task ended with, other than its cancellation."""
    live = [t for t in tasks if t is not None]
    while pending := [t for t in live if not t.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_S)
    errors = [e for t in live if not t.cancelled() and (e := t.exception()) is not None]
    for error in errors[1:]:
        log.error("a task ended with an error while stopping: %r", error, exc_info=error)
    if errors:
        raise errors[0]
