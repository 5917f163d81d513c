"""Helpers shared by several test modules: running work in threads, waiting for a condition, and
independent references that more than one module checks against."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on 127.0.0.1: all bound at once while read (ports picked one
    at a time can repeat: Linux draws them at random)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def run_threads(*calls: tuple[Callable[..., Any], tuple]) -> None:
    """Runs each ``(function, args)`` in its own thread, all at once; re-raises the first
    exception any of them raised (an assertion inside a thread fails the test)."""
    errors: list[BaseException] = []

    def guarded(fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as e:  # pragma: no cover - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=call) for call in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 20.0) -> None:
    """Polls ``predicate`` until it holds; fails naming ``what`` after ``timeout`` seconds (only
    a failing test waits that long: a loaded machine delays, it does not fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def start_raising(sub: Any, timeout: float = 10.0) -> list[BaseException]:
    """Calls ``sub.start()`` in a thread and returns what it raised (nothing: ``[]``); fails the
    test if ``start`` has not returned within ``timeout`` seconds (a clean-up that hangs)."""
    raised: list[BaseException] = []

    def start() -> None:
        try:
            sub.start()
        except BaseException as e:
            raised.append(e)

    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    starter.join(timeout)
    assert not starter.is_alive(), "start() did not return"
    return raised


def paper_jump(key: int, n: int) -> int:
    """The loop of Lamping & Veach's jump consistent hash reference code, in Python floats."""
    b, j = -1, 0
    while j < n:
        b = j
        key = (key * 2862933555777941757 + 1) % 2**64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def tenant_system_prompts(tenants: int = 20, rules: int = 180) -> list[str]:
    """Long, distinct system prompts (~8 kB, ~2,000 routing tokens each), one per tenant."""
    return [
        f"Tenant {t} support policy. "
        + " ".join(f"Rule {i}: item {t}-{i} costs {i * t % 97} credits." for i in range(rules))
        for t in range(tenants)
    ]


def tenant_requests(count: int, tenants: int = 20, seed: int = 0) -> list[tuple[int, str]]:
    """``count`` (tenant, question) pairs, tenants drawn uniformly in a fixed random order."""
    import random

    rng = random.Random(seed)
    return [(rng.randrange(tenants), f"question {q}") for q in range(count)]


def hit_rate(usages: list[Any]) -> float:
    """Cached ÷ prompt tokens over OpenAI ``usage`` objects or dicts (the engines' own report)."""

    def field(obj: Any, name: str) -> Any:
        return obj[name] if isinstance(obj, dict) else getattr(obj, name)

    prompt = sum(field(u, "prompt_tokens") for u in usages)
    cached = sum(field(field(u, "prompt_tokens_details"), "cached_tokens") for u in usages)
    return cached / prompt


async def until(cond: Callable[[], Any], timeout: float = 15.0) -> bool:
    """Whether ``cond()`` holds within ``timeout`` seconds (polled, the event loop running)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False
