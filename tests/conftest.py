from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# LiteLLM fetches its model cost map over the network at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


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


@pytest.fixture
def engines():
    """Makes test KV-event publishers (support/events_engine.py), closed after the test."""
    from support.events_engine import Engine

    made = []

    def make(**kw):
        e = Engine(**kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
