"""Who may call what, end to end: every configured key opens its targets, and only those.

An endpoint with several ``api_keys`` accepts each of them (not only the last one parsed), the
gateway-wide ``api_keys`` guard the directly served models on every request (not only at config
parsing), and a key opens nothing it was not given: the answer is then the same as for a model
that does not exist (404 with a valid key, 401 without one).
"""

from __future__ import annotations

import openai
import pytest
from support.gateway_fleet import Fleet, GatewayServer, chat, config_dict

ENDPOINT_KEYS = ["sk-acme-1", "sk-acme-2", "sk-acme-3"]
DIRECT_KEYS = ["sk-direct-1", "sk-direct-2"]


@pytest.fixture(scope="module")
def gw():
    fleet = Fleet(2)
    config = config_dict(
        fleet,
        gateway={"models": ["base-model"], "api_keys": DIRECT_KEYS},
        endpoints=[
            {"id": "ep-acme", "model": "acme-model", "pool_size": 1, "api_keys": ENDPOINT_KEYS},
            {"id": "ep-open", "model": "open-model", "pool_size": 1},
        ],
    )
    try:
        with GatewayServer(config) as g:
            yield g
    finally:
        fleet.close()


def status(gw, key, model) -> int:
    try:
        chat(gw.client(key), model, "hello")
    except openai.APIStatusError as e:
        return e.status_code
    return 200


@pytest.mark.parametrize("key", ENDPOINT_KEYS)
def test_each_key_of_an_endpoint_opens_it(gw, key):
    _, headers = chat(gw.client(key), "ep-acme", "which fuel?")
    assert headers["x-kvroute-worker"]
    assert status(gw, key, "base-model") == 404  # an endpoint key is not a gateway key


@pytest.mark.parametrize("key", DIRECT_KEYS)
def test_each_gateway_key_opens_the_direct_models(gw, key):
    assert status(gw, key, "base-model") == 200
    assert status(gw, key, "ep-acme") == 404  # nor is a gateway key an endpoint key


def test_direct_models_are_closed_without_a_gateway_key(gw):
    for key in (None, "sk-wrong", "sk-acme-11", "sk-direct"):
        assert status(gw, key, "base-model") == 401, key
        assert status(gw, key, "ep-acme") == 401, key
        assert status(gw, key, "ep-open") == 200, key  # an endpoint without keys is open


def test_models_lists_what_each_key_opens(gw):
    def listed(key):
        return {m.id for m in gw.client(key).models.list()}

    assert listed(None) == {"ep-open"}
    for key in ENDPOINT_KEYS:
        assert listed(key) == {"ep-acme", "ep-open"}
    for key in DIRECT_KEYS:
        assert listed(key) == {"base-model", "ep-open"}
