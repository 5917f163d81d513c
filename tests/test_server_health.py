"""The shared health model (``kvroute.server.health.Health``) against a reference model.

A Hypothesis state machine drives one ``Health`` over a small fleet with a virtual clock and
scripted health probes (answering, refusing, raising, or answering something other than True),
the real ``kvroute.Router`` as the sink of ``set_healthy``; a pure-Python model written from the
module's documented rules says after every step which workers are in, how many failures in a row
each has, and what ``failed`` answers. The gateway's end-to-end tests (``test_gateway_faults``)
check that the gateway reports to the model; this one checks the model itself, in milliseconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import kvroute
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvroute.server.config import HealthConfig
from kvroute.server.health import Health

NAMES = ["w0", "w1", "w2", "w3", "w4"]
ANSWERS = st.sampled_from(["ok", "refused", "raises", "not-true"])


@dataclass
class Reference:
    """The documented rules, kept apart from the implementation's bookkeeping."""

    workers: list[str]
    eject_after: int
    fraction: float
    interval: float
    eject_seconds: float
    out_since: dict[str, float] = field(default_factory=dict)  # ejected worker -> its ejection
    in_a_row: dict[str, int] = field(default_factory=dict)
    last_suspected: dict[str, float] = field(default_factory=dict)

    def count(self, worker: str) -> int:
        return self.in_a_row.get(worker, 0)

    def take_out(self, worker: str, now: float) -> None:
        self.out_since.setdefault(worker, now)  # a second ejection does not restart the clock

    def succeeded(self, worker: str) -> None:
        self.in_a_row[worker] = 0

    def failed(self, worker: str, now: float) -> bool:
        self.in_a_row[worker] = self.count(worker) + 1
        if worker in self.out_since:
            return True
        if self.count(worker) < self.eject_after:
            return False
        return self.take_out_within_fraction(worker, now)

    def take_out_within_fraction(self, worker: str, now: float) -> bool:
        # Never more than the fraction of the fleet out (counting those already out).
        if (len(self.out_since) + 1) > self.fraction * len(self.workers):
            return False
        self.take_out(worker, now)
        return True

    def down(self, worker: str, now: float) -> None:
        self.in_a_row[worker] = self.count(worker) + 1
        self.take_out(worker, now)

    def suspect(self, worker: str, now: float, answer: str) -> bool:
        """Whether a probe is made; the worker goes out when it does not answer True."""
        if worker in self.out_since:
            return False
        last = self.last_suspected.get(worker)
        if last is not None and now - last < self.interval:
            return False
        self.last_suspected[worker] = now
        if answer != "ok":  # a failed probe is a failure: within the fraction too
            self.take_out_within_fraction(worker, now)
        return True

    def readmit(self, worker: str) -> None:
        """An ejected worker comes back with no failures; one that is in is left as it is."""
        if self.out_since.pop(worker, None) is not None:
            self.in_a_row[worker] = 0

    def probe_due(self, now: float, answers: dict[str, str]) -> list[str]:
        """The ejected workers probed now; those answering come back with no failures."""
        due = [w for w, t in self.out_since.items() if now - t >= self.eject_seconds]
        for worker in due:
            if answers[worker] == "ok":
                del self.out_since[worker]
                self.in_a_row[worker] = 0
        return due


class HealthMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()

    def teardown(self) -> None:
        self.loop.run_until_complete(self.health.stop())
        self.loop.close()

    @initialize(
        workers=st.integers(1, len(NAMES)),
        eject_after=st.integers(1, 4),
        fraction=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
        interval=st.sampled_from([1.0, 3.0]),
        eject_seconds=st.sampled_from([0.0, 2.0, 5.0]),
    )
    def start(self, workers, eject_after, fraction, interval, eject_seconds):
        names = NAMES[:workers]
        self.now = 100.0
        self.answers = dict.fromkeys(names, "ok")
        self.probed: list[str] = []
        self.calls: list[tuple[str, bool]] = []
        self.router = kvroute.Router(names)
        config = HealthConfig(
            interval=interval,
            eject_seconds=eject_seconds,
            eject_after=eject_after,
            max_ejected_fraction=fraction,
        )

        def set_healthy(worker: str, ok: bool) -> None:
            self.calls.append((worker, ok))
            self.router.set_healthy(worker, ok)

        async def probe(worker: str) -> bool:
            self.probed.append(worker)
            answer = self.answers[worker]
            if answer == "raises":
                raise ConnectionError("probe failed")
            return {"ok": True, "refused": False, "not-true": 1}[answer]  # type: ignore[return-value]

        self.health = Health(
            names, config, set_healthy=set_healthy, probe=probe, clock=lambda: self.now
        )
        self.ref = Reference(names, eject_after, fraction, interval, eject_seconds)
        self.names = names

    def worker(self, data) -> str:
        return data.draw(st.sampled_from(self.names))

    def expect_calls(self, before: set[str]) -> None:
        """``set_healthy`` was called once per worker whose state changed, with its new state."""
        after = set(self.ref.out_since)
        expected = sorted(
            [(w, False) for w in after - before] + [(w, True) for w in before - after]
        )
        assert sorted(self.calls) == expected
        self.calls.clear()

    @rule(data=st.data(), answer=ANSWERS)
    def set_answer(self, data, answer):
        self.answers[self.worker(data)] = answer

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0]))
    def wait(self, seconds):
        self.now += seconds

    @rule(data=st.data())
    def succeeded(self, data):
        worker = self.worker(data)
        self.health.succeeded(worker)
        self.ref.succeeded(worker)

    @rule(data=st.data())
    def failed(self, data):
        worker, before = self.worker(data), set(self.ref.out_since)
        assert self.health.failed(worker, "test") is self.ref.failed(worker, self.now)
        self.expect_calls(before)

    @rule(data=st.data())
    def down(self, data):
        worker, before = self.worker(data), set(self.ref.out_since)
        self.health.down(worker, "refused")
        self.ref.down(worker, self.now)
        self.expect_calls(before)

    @rule(data=st.data())
    def suspect(self, data):
        worker, before = self.worker(data), set(self.ref.out_since)

        async def suspect_and_wait() -> None:
            self.health.suspect(worker, "test")
            await asyncio.gather(*self.health._probes)

        self.probed.clear()
        self.loop.run_until_complete(suspect_and_wait())
        assert not self.health._probes  # a finished probe is not kept
        probed = self.ref.suspect(worker, self.now, self.answers[worker])
        assert self.probed == ([worker] if probed else [])
        self.expect_calls(before)

    @rule(data=st.data())
    def readmit(self, data):
        worker, before = self.worker(data), set(self.ref.out_since)
        self.health.readmit(worker)
        self.ref.readmit(worker)
        self.expect_calls(before)

    @rule()
    def probe_due(self):
        before = set(self.ref.out_since)
        self.probed.clear()
        self.loop.run_until_complete(self.health.probe_due())
        due = self.ref.probe_due(self.now, self.answers)
        assert sorted(self.probed) == sorted(due)
        self.expect_calls(before)

    @precondition(lambda self: hasattr(self, "ref"))
    @invariant()
    def same_state(self):
        out = set(self.ref.out_since)
        assert self.health.status() == {w: w not in out for w in self.names}
        assert set(self.health.ejected) == out
        assert self.health.any_in() is (len(out) < len(self.names))
        assert {w: self.health.failures.get(w, 0) for w in self.names} == {
            w: self.ref.count(w) for w in self.names
        }
        # The real router sees the same fleet.
        assert {w for w in self.names if not self.router.is_healthy(w)} == out


HealthMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestHealth = HealthMachine.TestCase


def test_loop_readmits_once_a_probe_answers(caplog):
    """The background loop probes every ``interval``; a prober that raises (a bug, not an
    answer) is logged and does not end readmission. Ejection and readmission are logged with
    the worker's name."""
    calls: list[tuple[str, bool]] = []
    rounds = 0

    async def answer() -> bool:
        return True

    def probe(worker: str):
        nonlocal rounds
        rounds += 1
        if rounds == 1:
            raise RuntimeError("a prober bug")
        return answer()

    async def main() -> None:
        config = HealthConfig(interval=0.01, eject_seconds=0.0)
        health = Health(
            ["a", "b"], config, set_healthy=lambda w, ok: calls.append((w, ok)), probe=probe
        )
        health.start()
        task = health._task
        health.start()  # idempotent: one loop
        assert health._task is task and task.get_name() == "kvroute-health"  # in task dumps
        health.down("a", "refused")
        for _ in range(500):
            if health.status()["a"]:
                break
            await asyncio.sleep(0.01)
        await health.stop()
        assert health._task is None and task.cancelled()

    with caplog.at_level("INFO", logger="kvroute.server.health"):
        asyncio.run(main())
    assert calls == [("a", False), ("a", True)]
    assert rounds >= 2
    assert [r.getMessage() for r in caplog.records] == [
        "ejecting upstream a: refused",
        "health probe round failed",
        "upstream a is healthy again",
    ]


def test_every_log_line_names_the_worker_and_why(caplog):
    """Each failure, ejection, refusal to eject (the fleet fraction), readmission and failed
    suspicion probe is logged whole, at its level, with the worker, the reason and the counts."""
    answers = {"a": True, "b": False}

    async def probe(worker: str) -> bool:
        return answers[worker]

    async def main() -> None:
        config = HealthConfig(
            interval=1.0, eject_seconds=0.0, eject_after=2, max_ejected_fraction=0.5
        )
        health = Health(["a", "b"], config, set_healthy=lambda w, ok: None, probe=probe)
        health.failed("a", "timeout")
        assert health.failed("a", "timeout")
        health.failed("b", "reset")
        assert not health.failed("b", "reset")  # half the fleet is out already
        health.readmit("a")
        health.suspect("b", "a 5xx")
        await asyncio.gather(*health._probes)
        assert not health._probes  # a finished probe is not kept
        health.down("a", "connection refused")
        await health.stop()

    with caplog.at_level("INFO", logger="kvroute.server.health"):
        asyncio.run(main())
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "upstream a failed (timeout, 1 in a row)"),
        ("WARNING", "upstream a failed (timeout, 2 in a row)"),
        ("WARNING", "ejecting upstream a: 2 failures in a row"),
        ("WARNING", "upstream b failed (reset, 1 in a row)"),
        ("WARNING", "upstream b failed (reset, 2 in a row)"),
        (
            "WARNING",
            "not ejecting b (2 failures in a row): 1 of 2 workers are out already "
            "(max_ejected_fraction 0.50)",
        ),
        ("INFO", "upstream a is healthy again"),
        ("WARNING", "ejecting upstream b: a 5xx, and its health probe failed"),
        ("WARNING", "ejecting upstream a: connection refused"),
    ]


PROBE_ANSWERS = {
    "true": True,
    "false": False,
    "none": None,
    "one": 1,  # truthy, not True
    "refused": ConnectionRefusedError("refused"),
    "timeout": TimeoutError("no answer"),
    "bug": RuntimeError("a prober bug"),
}


@pytest.mark.parametrize("answer", sorted(PROBE_ANSWERS))
@pytest.mark.parametrize("room", [True, False])
def test_each_suspicion_probe_answer_ejects_within_the_fraction(caplog, answer, room):
    """A suspicion probe keeps the worker in only when it answers True; any other answer —
    another value, or an exception of any kind — ejects it, within ``max_ejected_fraction``
    (the refusal logged with the reason), exactly as a failure would. The state machine reaches
    these only when Hypothesis draws an answer, a suspicion and a fraction with room together."""
    calls: list[tuple[str, bool]] = []

    async def probe(worker: str) -> bool:
        result = PROBE_ANSWERS[answer]
        if isinstance(result, Exception):
            raise result
        return result  # type: ignore[return-value]

    async def main() -> Health:
        config = HealthConfig(interval=1.0, eject_seconds=5.0, max_ejected_fraction=0.5)
        health = Health(
            ["a", "b"], config, set_healthy=lambda w, ok: calls.append((w, ok)), probe=probe
        )
        if not room:
            health.down("a", "refused")  # half the fleet out: no room for b
        health.suspect("b", "a 5xx")
        await asyncio.gather(*health._probes)
        await health.stop()
        return health

    with caplog.at_level("INFO", logger="kvroute.server.health"):
        health = asyncio.run(main())
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    before = [] if room else [("WARNING", "ejecting upstream a: refused")]
    if answer == "true":
        assert lines == before
        assert health.status()["b"] and ("b", False) not in calls
    elif room:
        assert lines == [("WARNING", "ejecting upstream b: a 5xx, and its health probe failed")]
        assert calls == [("b", False)] and not health.status()["b"]
        assert health.failures.get("b", 0) == 0  # a probe is not a request's failure
    else:
        assert lines == [
            *before,
            (
                "WARNING",
                "not ejecting b (a 5xx, and its health probe failed): 1 of 2 workers are out "
                "already (max_ejected_fraction 0.50)",
            ),
        ]
        assert calls == [("a", False)] and health.status()["b"]


def test_a_worker_ejected_while_its_suspicion_probe_runs_is_not_ejected_again(caplog):
    """A worker taken out (``down``) while its suspicion probe is on its way is not ejected a
    second time when the probe fails: one ejection, logged once, its clock not restarted."""
    calls: list[tuple[str, bool]] = []
    now = [100.0]

    async def main() -> Health:
        started, release = asyncio.Event(), asyncio.Event()

        async def probe(worker: str) -> bool:
            started.set()
            await release.wait()
            return False

        # Room for one: were b taken for in, its failed probe would log a refusal.
        config = HealthConfig(interval=1.0, eject_seconds=5.0, max_ejected_fraction=0.5)
        health = Health(
            ["a", "b"],
            config,
            set_healthy=lambda w, ok: calls.append((w, ok)),
            probe=probe,
            clock=lambda: now[0],
        )
        health.suspect("b", "a 5xx")
        await started.wait()
        health.down("b", "connection refused")
        now[0] = 101.0
        release.set()
        await asyncio.gather(*health._probes)
        await health.stop()
        return health

    with caplog.at_level("INFO", logger="kvroute.server.health"):
        health = asyncio.run(main())
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "ejecting upstream b: connection refused")
    ]
    assert calls == [("b", False)] and health.ejected == {"b": 100.0}
