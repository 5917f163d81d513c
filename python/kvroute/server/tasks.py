"""Background tasks of a server: ended for sure when it stops.

:func:`cancel_tasks` cancels every task given (``None`` skipped) and waits for each to end; a
task's cancellation is not raised to the caller (another exception of the task is).
"""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_tasks(*tasks: asyncio.Task | None) -> None:
    """Cancels ``tasks`` (all first, then waits for each), ignoring ``None``."""
    live = [t for t in tasks if t is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
