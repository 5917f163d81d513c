"""The `kvroute sticky` demo runs and reports movement close to the ideal 1/n."""

from __future__ import annotations

import re

from kvroute.cli import HASHERS, main


def test_sticky_demo(capsys):
    assert main(["sticky", "--workers", "10", "--endpoints", "5000", "--show", "3"]) == 0
    out = capsys.readouterr().out
    assert "ep-00002" in out and "ep-00003" not in out
    moved = re.findall(r"^  (.+?)\s+moved\s+([\d.]+)%", out, flags=re.M)
    assert [name for name, _ in moved] == list(HASHERS) * 2
    leave, join = moved[: len(HASHERS)], moved[len(HASHERS) :]
    for _, pct in leave:
        assert abs(float(pct) - 10.0) < 3.0  # ideal 1/10
    for _, pct in join:
        assert abs(float(pct) - 100 / 11) < 3.0  # ideal 1/11
    assert "did not restore" not in out
