"""The README's Python examples run as written, and say what they claim.

Every ```python block runs, statement by statement, in one namespace. Where the README shows an
expression's value — a comment after it that starts with a Python literal (``# 256, refreshes
recency``, ``# {'gpu-0': 256, 'gpu-1': 100}``, ``# 1.25: the defaults``) — the value must be
that literal; a bare boolean expression (``x in pool``) states a fact and must be True.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
SEPARATORS = ",:;"


def shown_value(comment: str) -> tuple[bool, object]:
    """``(True, value)`` when the comment starts with a Python literal: the longest prefix, cut
    before a separator or a space, that parses as one (a tuple only if written in parentheses)."""
    text = comment.lstrip("#").strip()
    cuts = [i for i, ch in enumerate(text) if ch in SEPARATORS or ch.isspace()] + [len(text)]
    for i in sorted(cuts, reverse=True):
        head = text[:i].strip()
        if not head:
            continue
        try:
            value = ast.literal_eval(head)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(value, tuple) and not head.startswith("("):
            continue
        return True, value
    return False, None


def comments_by_line(source: str) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}


def test_shown_value_reads_only_literals():
    assert shown_value("# 256, refreshes recency") == (True, 256)
    assert shown_value("# {'gpu-0': 256, 'gpu-1': 100}") == (True, {"gpu-0": 256, "gpu-1": 100})
    assert shown_value("# 1.25: the defaults in effect") == (True, 1.25)
    assert shown_value("# (1, 'a')") == (True, (1, "a"))
    assert shown_value("# whole batch in Rust, GIL released") == (False, None)
    assert shown_value("# Lamping–Veach on the u64 as given") == (False, None)
    assert shown_value("# 256 uint64 hashes") == (True, 256)


def test_readme_python_examples_run_and_show_true_values():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    ns: dict = {}
    checked = []
    for block in blocks:
        comments = comments_by_line(block)
        for stmt in ast.parse(block).body:
            if not isinstance(stmt, ast.Expr):
                exec(compile(ast.Module([stmt], []), str(README), "exec"), ns)
                continue
            value = eval(compile(ast.Expression(stmt.value), str(README), "eval"), ns)
            text = ast.get_source_segment(block, stmt)
            shown, expected = shown_value(comments.get(stmt.end_lineno, ""))
            if shown:
                assert value == expected, f"README shows {text} = {expected!r}, it is {value!r}"
                checked.append(text)
            elif isinstance(value, bool):
                assert value, f"README states {text}, which is False"
                checked.append(text)
    # The shown values include the index match, the cache match and the router's load bound.
    assert len(checked) >= 4, checked
    # The values other comments promise.
    assert ns["hashes"].shape == (256,)
    assert ns["idx"].match(ns["hashes"]) == {"gpu-0": 256, "gpu-1": 100}
    assert ns["cache"].match(ns["hashes"]) == 256 - 100  # the last 100 blocks were removed
    assert len(ns["dropped"]) == 0  # nothing was idle for 10 minutes
    assert ns["d"].worker in {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
    assert ns["ring"].preference("ep-0042", 2)[0] == ns["ring"].get("ep-0042")
    pair, short = ns["pair"], ns["short"]
    assert (pair.disaggregate, pair.reason) == (True, "remote")
    assert (pair.prefill.worker, pair.decode.worker) == ("p-0", "d-0")
    assert (short.disaggregate, short.reason) == (False, "short")
    assert ns["pd_router"].role("b-0") == "both"
