"""The README's Python examples run as written, and say what they claim."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
    pytest = __import__("pytest")
    pytest.importorskip("zmq")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    ns: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
    # The values the comments promise.
    assert ns["hashes"].shape == (256,)
    assert ns["idx"].match(ns["hashes"]) == {"gpu-0": 256, "gpu-1": 100}
    assert ns["cache"].match(ns["hashes"]) == 256 - 100  # the last 100 blocks were removed
    assert len(ns["dropped"]) == 0  # nothing was idle for 10 minutes
    assert ns["d"].worker in {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}
    assert ns["ring"].preference("ep-0042", 2)[0] == ns["ring"].get("ep-0042")
