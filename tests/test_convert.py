"""The conversions at the Python boundary against inputs that lie about their size.

An iterable's ``len()`` (or an iterator's ``__length_hint__``) is a claim, not data. Every
converter must survive one that lies — a few items behind a ``len()`` of 2**36 or 2**62 — and one
that tells the truth about more items than memory holds (``range(2**40)``): the call either
answers correctly from the items it reads or raises ``MemoryError`` naming the value, never aborts
the interpreter ("memory allocation of … bytes failed", SIGABRT) or raises
``pyo3_runtime.PanicException``, and a failed call changes nothing. Each API runs in a child
process, so a converter that still aborts fails its test instead of killing the test run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Defines the lying inputs in the child, then ``check(label, thunk, expected, state)`` prints one
# JSON line per case: the outcome (result, or exception type and message) and ``state()`` after.
PRELUDE = textwrap.dedent(
    """
    import json, sys
    from collections.abc import Mapping
    import numpy as np
    import kvroute

    class LenLiar:
        '''len() says `n`; iterating yields `items`.'''
        def __init__(self, n, items):
            self.n, self.items = n, items
        def __len__(self):
            return self.n
        def __iter__(self):
            return iter(self.items)
        def __repr__(self):
            return f"LenLiar({self.n})"

    class HintLiar:
        '''An iterator whose __length_hint__ says `n`.'''
        def __init__(self, n, items):
            self.n, self.it = n, iter(items)
        def __iter__(self):
            return self
        def __next__(self):
            return next(self.it)
        def __length_hint__(self):
            return self.n

    class MapLiar(Mapping):
        '''A mapping whose len() says `n`.'''
        def __init__(self, n, items):
            self.n, self.d = n, dict(items)
        def __len__(self):
            return self.n
        def __iter__(self):
            return iter(self.d)
        def __getitem__(self, k):
            return self.d[k]

    def liars(items):
        return [
            ("len 2**36", lambda: LenLiar(2**36, items)),
            ("len 2**62", lambda: LenLiar(2**62, items)),
            ("len sys.maxsize", lambda: LenLiar(sys.maxsize, items)),
            ("hint 2**62", lambda: HintLiar(2**62, items)),
        ]

    def check(label, thunk, expected, state=lambda: None):
        before = state()
        try:
            got = thunk()
            out = {"case": label, "ok": True, "equal": got == expected}
        except BaseException as e:
            out = {"case": label, "ok": False, "type": type(e).__name__, "msg": str(e)}
        out["changed"] = state() != before
        print(json.dumps(out), flush=True)
    """
)

INTS = [5, 7, 11]
HUGE = "range(2**40)"

CASES = {
    "jump_hash_many": """
        want = kvroute.jump_hash_many(np.array(INTS, dtype=np.uint64), 5).tolist()
        for label, make in liars(INTS):
            check(label, lambda: kvroute.jump_hash_many(make(), 5).tolist(), want)
        check("huge", lambda: kvroute.jump_hash_many(HUGE, 5), None)
    """,
    "hashers.get_many": """
        for kind in ("HashRing", "Maglev", "Rendezvous", "JumpHash"):
            h = getattr(kvroute, kind)(["a", "b", "c"])
            state = lambda: h.nodes
            want, want_str = h.get_many(INTS), h.get_many(["k1", "k2"])
            for label, make in liars(INTS):
                check(kind + " " + label, lambda: h.get_many(make()), want, state)
            for label, make in liars(["k1", "k2"]):
                check(kind + " str " + label, lambda: h.get_many(make()), want_str, state)
            check(kind + " huge", lambda: h.get_many(HUGE), None, state)
    """,
    "hashers(nodes)": """
        for kind in ("HashRing", "Maglev", "Rendezvous", "JumpHash"):
            cls = getattr(kvroute, kind)
            for label, make in liars(["a", "b"]):
                check(kind + " " + label, lambda: cls(make()).nodes, ["a", "b"])
            if kind != "JumpHash":
                liar = lambda: MapLiar(2**62, {"a": 1, "b": 2})
                check(kind + " map len 2**62", lambda: sorted(cls(liar()).nodes), ["a", "b"])
    """,
    "BlockHasher.hash": """
        h = kvroute.BlockHasher(2)
        items = list(range(6))
        want = h.hash(np.array(items, dtype=np.int64)).tolist()
        for label, make in liars(items):
            check(label, lambda: h.hash(make()).tolist(), want)
        check("huge", lambda: h.hash(HUGE), None)
    """,
    "PrefixIndex": """
        for label, make in liars(INTS):
            idx = kvroute.PrefixIndex()
            state = lambda: (len(idx), idx.workers)
            check("store " + label, lambda: idx.store("w", make()), None, state)
            idx.store("w", INTS)
            check("match " + label, lambda: idx.match(make()), {"w": 3}, state)
            check("remove " + label, lambda: idx.remove("w", make()), 3, state)
        idx = kvroute.PrefixIndex()
        idx.store("w", INTS)
        state = lambda: (len(idx), idx.workers)
        check("store huge", lambda: idx.store("v", HUGE), None, state)
        check("match huge", lambda: idx.match(HUGE), None, state)
        check("remove huge", lambda: idx.remove("w", HUGE), None, state)
    """,
    "BlockCache": """
        for label, make in liars(INTS):
            c = kvroute.BlockCache(100)
            state = lambda: (len(c), sorted(h for h in INTS if h in c))
            check("insert " + label, lambda: c.insert(make(), now=0)[0], 3, state)
            c.insert(INTS, now=0)
            check("match " + label, lambda: c.match(make()), 3, state)
            check("pin " + label, lambda: c.pin(make()), None)
            check("unpin " + label, lambda: c.unpin(make()), None)
        c = kvroute.BlockCache(100)
        c.insert(INTS, now=0)
        state = lambda: len(c)
        check("insert huge", lambda: c.insert(HUGE, now=0), None, state)
        check("match huge", lambda: c.match(HUGE), None, state)
        check("pin huge", lambda: c.pin(HUGE), None, state)
    """,
    "Router": """
        r = kvroute.Router(["a", "b"], block_size=2)
        state = lambda: (r.workers, len(r.index))
        toks = list(range(6))
        for label, make in liars(toks):
            check("tokens " + label, lambda: r.route(tokens=make()).prompt_blocks, 3)
        for label, make in liars(INTS):
            check("block_hashes " + label, lambda: r.route(block_hashes=make()).prompt_blocks, 3)
        for label, make in liars(["a"]):
            check("exclude " + label, lambda: r.route(tokens=toks, exclude=make()).worker, "b")
            check("workers " + label, lambda: kvroute.Router(make()).workers, ["a"])
        check("workers map", lambda: kvroute.Router(MapLiar(2**62, {"a": 1})).workers, ["a"])
        check("tokens huge", lambda: r.route(tokens=HUGE), None, state)
        check("block_hashes huge", lambda: r.route(block_hashes=HUGE), None, state)
        check("salt huge", lambda: r.salt_block_hashes("x", HUGE), None, state)
    """,
}


def run_child(body: str) -> list[dict]:
    code = (
        PRELUDE
        + f"INTS = {INTS!r}\nHUGE = {HUGE}\n"
        + textwrap.dedent(body)
        + "\nprint('DONE', flush=True)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    lines = proc.stdout.splitlines()
    last = json.loads(lines[-1])["case"] if lines and lines[-1].startswith("{") else None
    assert proc.returncode == 0 and lines and lines[-1] == "DONE", (
        f"the child died (exit {proc.returncode}) after case {last!r}: {proc.stderr[-2000:]}"
    )
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("api", sorted(CASES))
def test_lying_and_huge_lengths_never_crash(api):
    for out in run_child(CASES[api]):
        case = out["case"]
        if out["ok"]:
            # Answered: only a lying length may be read past, and then the answer is right.
            assert "huge" not in case, f"{case}: answered for 2**40 items?"
            assert out["equal"], f"{case}: wrong answer"
        else:
            # A length hint is a hint: it never makes a call fail.
            assert "hint" not in case, f"{case}: {out['type']}: {out['msg']}"
            assert out["type"] == "MemoryError", f"{case}: {out['type']}: {out['msg']}"
            assert not out["changed"], f"{case}: the failed call changed the object's state"
            # The message names the value (its repr) and the length it claimed.
            assert "Liar(" in out["msg"] or "range(0, 1099511627776)" in out["msg"], (
                f"{case}: {out['msg']}"
            )


# Sizes a caller passes as numbers: each is refused with ValueError naming the value before
# anything is allocated (issue 14, "what held up"); run in a child for the same reason as above.
BOMBS = {
    "BlockCache(2**62)": "capacity",
    "BlockCache(10, reserved={'a': 2**62})": "4611686018427387904",
    "Maglev(['a'], table_size=2**40)": "table_size",
    "HashRing(['a'], vnodes=10**9)": "vnodes",
    "HashRing({'a': 10**6}, hash='xxh3')": "too large",
    "Router(['a'], capacity_blocks=2**62)": "capacity",
    "Router(['a']).add_endpoint('e', pool_size=2**62)": "pool_size",
    "PrefixIndex(max_bytes=2**64)": "max_bytes",
}


def test_allocation_bombs_are_refused():
    body = "\n".join(f"check({expr!r}, lambda: kvroute.{expr}, None)" for expr in BOMBS)
    for out in run_child(body):
        expr = out["case"]
        assert not out["ok"], f"{expr} was accepted"
        assert out["type"] == "ValueError", f"{expr}: {out['type']}"
        assert BOMBS[expr] in out["msg"], f"{expr}: {out['msg']}"
