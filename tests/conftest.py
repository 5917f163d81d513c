from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def load_vectors(name: str) -> dict:
    return json.loads((DATA / "vectors" / name).read_text())


@pytest.fixture(scope="session")
def jump_vectors() -> dict:
    return load_vectors("jump_consistent_hash.json")


@pytest.fixture(scope="session")
def ketama_vectors() -> dict:
    return load_vectors("ketama.json")


@pytest.fixture(scope="session")
def maglev_vectors() -> dict:
    return load_vectors("maglev.json")


@pytest.fixture(scope="session")
def mooncake():
    """The bundled Mooncake conversation trace as a (read-only) simulator workload."""
    from kvroute.sim.traces import mooncake_conversation

    return mooncake_conversation()
