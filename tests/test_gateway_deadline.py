"""gateway.deadline.LazyDeadline against its guarantee, on a real event loop: ``fired(owner)``
once the loop's clock has passed the latest deadline set, unless cleared or cancelled after it;
never before it (a timer that fires early waits out the rest). Only "not before" and "once" are
asserted: a loaded machine can make a timer late, never early."""

from __future__ import annotations

import asyncio

from kvroute.gateway.deadline import LazyDeadline


async def moved_deadline() -> None:
    loop = asyncio.get_running_loop()
    fired: list[tuple[object, float]] = []
    d = LazyDeadline(loop, lambda owner: fired.append((owner, loop.time())), "conn")
    # Seconds apart, so that a stalled loop (a full GC, a busy CI machine) cannot fire the
    # first timer before the move.
    d.set(1.0)
    first = d.handle
    await asyncio.sleep(0.03)
    d.set(1.2)  # moved while the first timer is pending: no new timer
    assert d.handle is first
    latest = loop.time() + 1.2
    await asyncio.sleep(1.5)
    assert [owner for owner, _ in fired] == ["conn"]
    assert fired[0][1] >= latest
    assert d.handle is None and d.at is None


async def cleared_and_cancelled() -> None:
    loop = asyncio.get_running_loop()
    fired: list[object] = []
    cleared = LazyDeadline(loop, fired.append, "cleared")
    cleared.set(0.02)
    cleared.clear()
    cancelled = LazyDeadline(loop, fired.append, "cancelled")
    cancelled.set(0.02)
    cancelled.cancel()
    assert cancelled.handle is None
    rearmed = LazyDeadline(loop, fired.append, "rearmed")
    rearmed.set(0.02)
    rearmed.clear()
    await asyncio.sleep(0.05)  # the cleared timer lapsed
    assert fired == [] and cleared.handle is None
    rearmed.set(0.02)
    await asyncio.sleep(0.1)
    assert fired == ["rearmed"]


def test_a_moved_deadline_fires_once_and_not_before_it():
    asyncio.run(moved_deadline())


def test_cleared_or_cancelled_deadlines_never_fire():
    asyncio.run(cleared_and_cancelled())
