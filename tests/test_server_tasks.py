"""cancel_tasks: every task given has ended when it returns, even when a cancel is lost."""

from __future__ import annotations

import asyncio

import pytest
from kvroute.server.tasks import cancel_tasks


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def ends_within(coro, seconds: float) -> bool:
    waiter = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({waiter}, timeout=seconds)
    return bool(done)


def test_a_lost_cancel_is_sent_again():
    """Python 3.11's wait_for returns its result when the cancel meets the completion it was
    waiting for: the task runs on into a long wait. A single cancel then waits forever (this test
    fails on that code under 3.11; 3.12's wait_for does not lose the cancel)."""

    async def main() -> tuple[bool, bool]:
        async def loop_step() -> None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            await asyncio.wait_for(done, 10)  # the first cancel arrives here
            await asyncio.sleep(3600)

        task = asyncio.create_task(loop_step())
        await asyncio.sleep(0)  # the task waits inside wait_for, its future already done
        ended = await ends_within(cancel_tasks(task), 5)
        stuck = not task.done()
        task.cancel()
        return ended, stuck

    ended, stuck = run(main())
    assert ended and not stuck


def test_every_task_ends_before_the_first_error_is_raised(caplog):
    order: list[str] = []

    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            order.append("fails")
            raise ValueError("probe broke") from None

    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            order.append("slow")
            raise

    async def also_fails() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise KeyError("second") from None

    async def main() -> list[asyncio.Task]:
        tasks = [asyncio.create_task(f()) for f in (fails_on_cancel, slow_to_stop, also_fails)]
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="probe broke"):
            await cancel_tasks(tasks[0], None, tasks[1], tasks[2])
        return tasks

    tasks = run(main())
    assert [t.done() for t in tasks] == [True, True, True]
    assert order == ["fails", "slow"]
    assert tasks[1].cancelled()
    logged = [r for r in caplog.records if r.name == "kvroute.server"]
    assert [type(r.exc_info[1]) for r in logged if r.exc_info] == [KeyError]


def test_cancellation_is_not_raised_and_finished_tasks_are_left_as_they_are():
    async def main() -> None:
        finished = asyncio.create_task(asyncio.sleep(0, result=7))
        await asyncio.sleep(0.01)
        sleeping = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)
        await cancel_tasks(None, finished, sleeping)
        assert finished.result() == 7
        assert sleeping.cancelled()
        await cancel_tasks()

    run(main())
