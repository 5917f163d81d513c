"""One upstream attempt's accounting (``kvroute.gateway.upstream``) against a reference model.

A Hypothesis state machine begins, prefills and closes flights (in any order, closing twice,
prefilling after close), has non-streamed ones expect their prefill at a predicted time (soon,
later, never, or no prediction) and moves the loop's clock, on the real ``kvroute.Router``; a
reference model says how many attempts each worker has in flight and how many of them wait for
their first output, which workers are at their in-flight bound, and what the gateway's
cache-usage counters hold. The router's own
``load()`` must agree after every step: a flight that forgot ``finish`` or ran it twice would
leave a worker looking busy (or idle) for good.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import kvroute
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule
from kvroute.gateway.client import ConnectFailed
from kvroute.gateway.config import ServerConfig
from kvroute.gateway.errors import CONNECT
from kvroute.gateway.metrics import GatewayMetrics
from kvroute.gateway.upstream import Upstreams, release
from kvroute.server.config import WorkerConfig

BS = 16
NAMES = ["a", "b", "c"]


def usage(cached: int | None, prompt: int | None) -> dict:
    out: dict = {"prompt_tokens": prompt, "completion_tokens": 1}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


class FlightMachine(RuleBasedStateMachine):
    flights = Bundle("flights")

    @initialize(
        bound=st.sampled_from([None, 1, 2]), connections=st.integers(1, 3), observe=st.booleans()
    )
    def start(self, bound, connections, observe):
        self.loop = asyncio.new_event_loop()
        self.now = 0.0  # the loop's clock: timers fire only when a rule moves it
        self.loop.time = lambda: self.now  # type: ignore[method-assign]
        workers = tuple(
            WorkerConfig(name=n, url=f"http://127.0.0.1:{9 + k}", max_connections=connections)
            for k, n in enumerate(NAMES)
        )
        self.router = kvroute.Router(NAMES, block_size=BS)
        metrics = GatewayMetrics(lambda: {}, lambda: {})
        self.upstreams = Upstreams(
            workers, ServerConfig(max_in_flight_per_worker=bound), self.router, metrics
        )
        self.loop.run_until_complete(self._start())
        self.bound = bound or connections
        self.open: dict[object, bool] = {}  # open flight -> prefilled
        self.queued_at_begin: dict[object, int] = {}
        self.usages: dict[object, dict] = {}  # closed flight -> the usage it was closed with
        self.reported = dict.fromkeys(NAMES, 0)
        self.predicted = dict.fromkeys(NAMES, 0)
        self.prefill_work: list[float] = []
        self.expected_work: list[float] = []
        self.began: dict[object, tuple[float, float]] = {}  # the clock around begin()
        self.seconds: list[float] = []
        self.observe = observe  # the gateway leaves on_prefilled unset with a configured rate
        self.expected: set[object] = set()  # flights told to expect their prefill
        self.pending: dict[object, float] = {}  # flight -> predicted seconds, not yet reached
        self.prediction: float | None = None
        self.asked: list[float] = []  # the work each prediction was asked for
        self.upstreams.predict_prefill = lambda work: (self.asked.append(work), self.prediction)[1]
        if observe:
            self.upstreams.on_prefilled = lambda work, seconds: (
                self.prefill_work.append(work),
                self.seconds.append(seconds),
            )

    async def _start(self) -> None:
        self.upstreams.start()

    def teardown(self) -> None:
        if hasattr(self, "loop"):
            self.loop.run_until_complete(self.upstreams.stop())
            self.loop.close()

    def load(self, worker: str) -> dict:
        return self.router.load(worker)

    @rule(target=flights, data=st.data(), blocks=st.integers(1, 4))
    def begin(self, data, blocks):
        worker = data.draw(st.sampled_from(NAMES))
        tokens = np.arange(blocks * BS, dtype=np.uint32) + data.draw(st.integers(0, 3)) * 1000
        d = self.router.route(
            tokens=tokens, endpoint=None, exclude=[w for w in NAMES if w != worker]
        )
        queued = self.load(worker)["prefill_blocks"] * BS
        before = time.perf_counter()
        flight = self.upstreams.begin(d, len(tokens))
        self.began[flight] = (before, time.perf_counter())
        self.open[flight] = False
        self.queued_at_begin[flight] = queued
        return flight

    @rule(flight=flights)
    def prefilled(self, flight):
        first = flight in self.open and not self.open[flight]
        if first:
            self.open[flight] = True
        if first and self.observe:
            d = flight.decision
            # Work ahead of it when it began (blocks being prefilled there) plus its own.
            work = self.queued_at_begin[flight] + max(d.prompt_tokens - d.cached_tokens, 0)
            self.expected_work.append(work)
        self.pending.pop(flight, None)  # the first output came first
        before = time.perf_counter()
        flight.prefilled()
        after = time.perf_counter()
        assert self.prefill_work == self.expected_work
        assert len(self.seconds) == len(self.expected_work)
        if first and self.observe:
            # The time from its begin to its first output, by the same clock: within what the
            # test saw around the two calls.
            began_before, began_after = self.began[flight]
            assert before - began_after <= self.seconds[-1] <= after - began_before

    @rule(
        flight=flights,
        cached=st.one_of(st.none(), st.integers(0, 80)),
        prompt=st.sampled_from([None, "same", "double"]),
    )
    def close(self, flight, cached, prompt):
        d = flight.decision
        engine_prompt = {None: None, "same": d.prompt_tokens, "double": 2 * d.prompt_tokens}[prompt]
        reported = usage(cached, engine_prompt)
        self.pending.pop(flight, None)
        if flight in self.open:
            del self.open[flight]
            self.usages[flight] = reported  # what the rate limits charge (Gateway._ended)
            if cached is not None:
                # Engine tokens in routing tokens: by the prompts' ratio, within the prompt.
                ratio = 0.5 if prompt == "double" else 1.0
                routed = min(round(cached * ratio), d.prompt_tokens)
                self.reported[d.worker] += routed
                self.predicted[d.worker] += d.cached_tokens
        self.loop.run_until_complete(release(_Closed(), flight, reported))
        assert flight.usage == self.usages[flight]  # the first close's, kept

    @rule(flight=flights, seconds=st.sampled_from([None, 0.01, 0.03, 3600.0, float("inf")]))
    def expect_prefill(self, flight, seconds):
        """A non-streamed attempt (once per flight, as the gateway does before sending)."""
        if flight in self.expected:
            return
        self.expected.add(flight)
        self.prediction = seconds
        asked = len(self.asked)
        self.loop.run_until_complete(self._expect(flight))
        d = flight.decision
        work = self.queued_at_begin[flight] + max(d.prompt_tokens - d.cached_tokens, 0)
        assert self.asked[asked:] == [work]
        if seconds is not None and seconds < float("inf") and self.open.get(flight) is False:
            self.pending[flight] = seconds

    async def _expect(self, flight) -> None:
        flight.expect_prefill()

    @rule()
    def wait(self):
        """20 ms pass on the loop's clock: the predictions then reached fire."""
        self.now += 0.02
        self.loop.run_until_complete(asyncio.sleep(0))
        for flight, seconds in list(self.pending.items()):
            self.pending[flight] = seconds - 0.02
            if seconds <= 0.02 + 1e-9:
                del self.pending[flight]
                self.open[flight] = True  # prefilled, but no sample of the model

    @invariant()
    def accounting(self):
        if not hasattr(self, "open"):
            return
        active = dict.fromkeys(NAMES, 0)
        waiting = dict.fromkeys(NAMES, 0)
        for flight, done in self.open.items():
            active[flight.worker] += 1
            waiting[flight.worker] += not done
        assert self.upstreams.in_flight == active
        assert self.upstreams.full == {w for w in NAMES if active[w] >= self.bound}
        for w in NAMES:
            load = self.load(w)
            assert (load["active"], load["queued"]) == (active[w], waiting[w])
        assert self.prefill_work == self.expected_work  # a prediction is never a sample
        m = self.upstreams.metrics
        assert {w: m.reported.get(w) for w in NAMES} == self.reported
        assert {w: m.predicted.get(w) for w in NAMES} == self.predicted


class _Closed:
    """A response already read to its end."""

    async def aclose(self) -> None:
        return None


FlightMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=25, deadline=None)
TestFlight = FlightMachine.TestCase


@pytest.mark.parametrize("sends", [1, 2])
def test_attempt_refused_before_sending_is_withdrawn_not_finished(sends):
    """A connection refused (a real port bound but not listening): no byte of the request left,
    so the decision is withdrawn — its load and the prompt its route recorded leave the router's
    model — where ``finish`` would have kept the prompt as cached on a worker that never saw it
    (the same prompt routed there again would be predicted a full hit)."""

    async def run() -> None:
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            port = dead.getsockname()[1]
            workers = (
                WorkerConfig(name="a", url=f"http://127.0.0.1:{port}"),
                WorkerConfig(name="b", url=f"http://127.0.0.1:{port}"),
            )
            router = kvroute.Router(["a", "b"], block_size=BS)
            metrics = GatewayMetrics(lambda: {}, lambda: {})
            upstreams = Upstreams(workers, ServerConfig(), router, metrics)
            upstreams.start()
            tokens = np.arange(4 * BS, dtype=np.uint32)
            for _ in range(sends):  # a retry of the same prompt there is no different
                d = router.route(tokens=tokens, exclude=["b"])
                assert (d.worker, d.cached_tokens) == ("a", 0)
                flight = upstreams.begin(d, len(tokens))
                assert router.load("a")["active"] == 1
                failure, error, answer = await flight.send("/v1/completions", "", b"{}")
                assert failure is CONNECT and isinstance(error, ConnectFailed) and answer is None
                assert upstreams.in_flight == {"a": 0, "b": 0} and not upstreams.full
                load = router.load("a")
                assert (load["active"], load["queued"], load["prefill_blocks"]) == (0, 0, 0)
                assert router.withdraw(d) is False  # withdrawn already, not finished
                flight.close()  # the callers' later close changes nothing
                assert router.load("a")["active"] == 0
            again = router.route(tokens=tokens, exclude=["b"])
            assert again.cached_tokens == 0  # a finished decision would leave 64 here
            await upstreams.stop()

    asyncio.run(run())


def test_decode_half_reports_no_cached_tokens():
    """A prefill/decode pair (the real router's ``route_pd``): the decode engine counts the KV
    it received as cached, so only the prefill half's usage reaches ``observe`` and the cache
    counters; the decode worker's report is dropped."""

    async def run() -> dict:
        workers = tuple(
            WorkerConfig(name=n, url=f"http://127.0.0.1:{9 + k}") for k, n in enumerate("pd")
        )
        router = kvroute.Router(["p", "d"], roles={"p": "prefill", "d": "decode"}, block_size=BS)
        metrics = GatewayMetrics(lambda: {}, lambda: {})
        upstreams = Upstreams(workers, ServerConfig(), router, metrics)
        upstreams.start()
        tokens = np.arange(250 * BS, dtype=np.uint32)  # 4,000 uncached tokens: disaggregated
        pair = router.route_pd(tokens=tokens)
        assert pair.disaggregate and (pair.prefill.worker, pair.decode.worker) == ("p", "d")
        n = len(tokens)
        prefill, decode = upstreams.begin(pair.prefill, n), upstreams.begin(pair.decode, n)
        await release(_Closed(), decode, usage(n, n))  # "all of it cached": the KV it received
        await release(_Closed(), prefill, usage(BS, n))  # one block it held
        await upstreams.stop()
        return {
            c: {w: getattr(metrics, c).get(w) for w in "pd"}
            for c in ("reported", "predicted", "prompt_tokens")
        }

    counters = asyncio.run(run())
    assert counters == {
        "reported": {"p": BS, "d": 0},
        "predicted": {"p": 0, "d": 0},
        "prompt_tokens": {"p": 250 * BS, "d": 0},
    }


class _ObserveFails:
    """The real router, except that ``observe`` raises (a report it cannot take)."""

    def __init__(self, real: kvroute.Router) -> None:
        self.real = real

    def __getattr__(self, name: str):
        return getattr(self.real, name)

    def observe(self, *args, **kwargs) -> None:
        raise RuntimeError("observe broke")


def test_a_failing_observe_is_logged_and_the_flight_still_finishes(caplog):
    """A report the router cannot take never skips ``finish``: the error is logged, naming the
    worker, with its traceback."""
    router = kvroute.Router(["a"], block_size=BS)
    workers = (WorkerConfig(name="a", url="http://127.0.0.1:9"),)
    metrics = GatewayMetrics(lambda: {}, lambda: {})
    upstreams = Upstreams(workers, ServerConfig(), _ObserveFails(router), metrics)

    async def run() -> None:
        upstreams.start()
        tokens = np.arange(4 * BS, dtype=np.uint32)
        flight = upstreams.begin(router.route(tokens=tokens), len(tokens))
        assert router.load("a")["active"] == 1
        with caplog.at_level(logging.ERROR, logger="kvroute.gateway"):
            await release(_Closed(), flight, usage(BS, len(tokens)))
        await upstreams.stop()

    asyncio.run(run())
    assert router.load("a")["active"] == 0 and upstreams.in_flight == {"a": 0}
    (record,) = [r for r in caplog.records if r.name == "kvroute.gateway"]
    assert record.getMessage() == "observe failed for worker a"
    assert record.exc_info[0] is RuntimeError


@pytest.mark.parametrize("end", ["first_output", "close", "withdraw", "predicted", "no_model"])
def test_a_predicted_prefill_ends_once_whatever_comes_first(end):
    """A non-streamed attempt's predicted prefill (``expect_prefill``), ended by its first output,
    its close, its withdrawal, its own timer — or never started, with no model to predict from
    (``predict_prefill`` unset): the router hears ``prefilled`` at most once, the timer is gone
    after, and ending the flight once more changes nothing."""

    async def run() -> list[tuple[int, int]]:
        workers = (WorkerConfig(name="a", url="http://127.0.0.1:9"),)
        router = kvroute.Router(["a"], block_size=BS)
        upstreams = Upstreams(workers, ServerConfig(), router, GatewayMetrics(dict, dict))
        upstreams.start()
        if end != "no_model":
            upstreams.predict_prefill = lambda work: 0.001 if end == "predicted" else 3600.0
        flight = upstreams.begin(router.route(tokens=np.arange(BS, dtype=np.uint32)), BS)
        flight.expect_prefill()
        seen = [(router.load("a")["active"], router.load("a")["queued"])]
        if end == "first_output":
            flight.prefilled()
        elif end == "close":
            flight.close()
        elif end == "withdraw":
            flight.withdraw()
        await asyncio.sleep(0.05)
        seen.append((router.load("a")["active"], router.load("a")["queued"]))
        assert flight.prefill_timer is None
        flight.prefilled()
        flight.close()
        flight.withdraw()
        seen.append((router.load("a")["active"], router.load("a")["queued"]))
        await upstreams.stop()
        return seen

    after = {
        "first_output": (1, 0),
        "close": (0, 0),
        "withdraw": (0, 0),
        "predicted": (1, 0),
        "no_model": (1, 1),
    }[end]
    assert asyncio.run(run()) == [(1, 1), after, (0, 0)]
