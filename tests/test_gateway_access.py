"""``gateway.auth.Auth`` against a small reference model of who may call what, via Hypothesis.

Random configurations (endpoints with overlapping key sets, direct models behind gateway-wide
keys or open, admin keys) and random ``Authorization`` headers: each header opens exactly the
targets the reference says (endpoints holding the key, the direct models when it is a gateway
key, and every target without keys); a caller that opens nothing is refused with 401 before
anything else; an unknown or forbidden model is 404 with a valid key and 401 without, alike.
The end-to-end version (real requests through ``kvroute serve``) is tests/test_gateway_auth.py.
"""

from __future__ import annotations

from unittest import mock

import kvroute.gateway.auth as auth_module
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.gateway import parse_config
from kvroute.gateway.auth import Auth, bearer
from kvroute.gateway.errors import HTTPError

KEYS = ["k0", "k1", "k2", "k3"]
keys = st.lists(st.sampled_from(KEYS), unique=True, max_size=3)
headers = st.one_of(
    st.none(),
    st.sampled_from(["", "Bearer", "Bearer ", "Basic k1", "k1", "Bearer k9", "Bearerk1"]),
    st.builds(
        lambda scheme, pad, key: f"{scheme} {pad}{key}{pad}",
        st.sampled_from(["Bearer", "bearer", "BEARER"]),
        st.sampled_from(["", " ", "\t"]),
        st.sampled_from(KEYS),
    ),
)


@st.composite
def configs(draw):
    n_ep = draw(st.integers(0, 3))
    endpoints = [
        {
            "id": f"ep{i}",
            "model": f"m{i}",
            "pool_size": 1,
            "api_keys": draw(keys),
            "cache_salt": draw(st.booleans()),
        }
        for i in range(n_ep)
    ]
    models = draw(st.lists(st.sampled_from(["direct-a", "direct-b"]), unique=True, max_size=2))
    gateway = {"models": models, "api_keys": draw(keys), "admin_api_keys": draw(keys)}
    data = {"workers": [{"name": "w0", "url": "http://127.0.0.1:9000"}], "gateway": gateway}
    if endpoints:
        data["endpoints"] = endpoints
    return data


def reference_key(header: str | None) -> str | None:
    if header is None or " " not in header:
        return None
    scheme, token = header.split(" ", 1)
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def reference_targets(data) -> dict[str, tuple[str, str | None, list[str], bool]]:
    """name -> (upstream model, endpoint id or None, keys that open it (none: open), salted)."""
    out = {
        e["id"]: (e["model"], e["id"], e["api_keys"], e["cache_salt"])
        for e in data.get("endpoints", [])
    }
    for m in data["gateway"]["models"]:
        out[m] = (m, None, data["gateway"]["api_keys"], False)
    return out


def check_target(t, name, expected) -> None:
    assert (t.name, t.upstream_model, t.endpoint, t.salted) == (name, *expected[:2], expected[3])


def refusal(e: HTTPError) -> tuple:
    """The OpenAI-style error a client sees: (status, type, code, message)."""
    error = e.body()["error"]
    return (e.status, error["type"], error["code"], error["message"])


@settings(max_examples=300, deadline=None)
@given(configs(), headers, st.sampled_from(["ep0", "ep1", "ep2", "direct-a", "direct-b", "x"]))
def test_each_key_opens_exactly_its_targets(data, header, model):
    auth = Auth(parse_config(data))
    targets = reference_targets(data)
    key = reference_key(header)
    assert bearer(header) == key
    open_ = {n for n, (_, _, ks, _) in targets.items() if not ks}
    keyed = {n for n, (_, _, ks, _) in targets.items() if key is not None and key in ks}
    for n, t in auth.targets.items():
        check_target(t, n, targets[n])
    assert set(auth.targets) == set(targets)
    assert auth.is_admin(header) == (key is not None and key in data["gateway"]["admin_api_keys"])
    assert {t.name for t in auth.visible(header)} == (keyed | open_ if keyed else open_)
    if not keyed and not open_:
        with pytest.raises(HTTPError) as refused:
            auth.access(header)
        assert refusal(refused.value) == (
            401,
            "invalid_request_error",
            "invalid_api_key",
            "missing or invalid API key (Authorization: Bearer ...)",
        )
        return
    access = auth.access(header)
    assert (access.digest is not None) == bool(keyed)
    assert set(access.targets) == keyed | open_
    if model in keyed | open_:
        check_target(access.target(model), model, targets[model])
        return
    with pytest.raises(HTTPError) as refused:
        access.target(model)
    if keyed:
        assert refusal(refused.value) == (
            404,
            "invalid_request_error",
            "model_not_found",
            f"the model {model!r} does not exist or you do not have access to it",
        )
    else:
        assert refusal(refused.value) == (
            401,
            "invalid_request_error",
            "invalid_api_key",
            f"missing or invalid API key for model {model!r} (Authorization: Bearer ...)",
        )


def test_a_model_that_is_not_a_string_or_too_long_is_not_echoed():
    data = {
        "workers": [{"name": "w0", "url": "http://127.0.0.1:9000"}],
        "endpoints": [{"id": "ep0", "model": "m0", "pool_size": 1}],
    }
    auth = Auth(parse_config(data))
    access = auth.access(None)
    for model in (None, 7, ["m"], "x" * 257):
        with pytest.raises(HTTPError) as refused:
            access.target(model)
        assert str(refused.value) == (
            "missing or invalid API key for model '(invalid)' (Authorization: Bearer ...)"
        )
    with pytest.raises(HTTPError, match="'" + "x" * 256 + "'"):
        access.target("x" * 256)


def answer(auth: Auth, header: str | None) -> tuple:
    try:
        access = auth.access(header)
    except HTTPError as e:
        return refusal(e)
    return access.digest, sorted(access.targets)


@settings(max_examples=200, deadline=None)
@given(configs(), st.lists(headers, max_size=30), st.integers(2, 6))
def test_remembered_headers_answer_as_a_fresh_check(data, sequence, bound):
    """One ``Auth`` over many requests (valid headers remembered, the memory bounded) answers
    each header exactly as a fresh ``Auth`` that remembers nothing; only valid headers are
    remembered, never more than ``SEEN_HEADERS``."""
    config = parse_config(data)
    with mock.patch.object(auth_module, "SEEN_HEADERS", bound):
        auth = Auth(config)
        for header in sequence:
            assert answer(auth, header) == answer(Auth(config), header)
            assert len(auth._seen) <= bound
            for remembered, access in auth._seen.items():
                assert access.digest is not None and reference_key(remembered) is not None


def test_remembered_headers_hold_bounded_memory():
    """A caller with one valid key can send it under endless distinct headers (padding the
    token with blanks, which ``bearer`` strips): only headers of at most 1,024 characters are
    remembered, so the memory stays under ``SEEN_HEADERS`` x 1,024 whatever the headers' sizes
    (the listener lets a header reach 64 KiB: 4,096 of those would be 256 MiB)."""
    data = {
        "workers": [{"name": "w0", "url": "http://127.0.0.1:9000"}],
        "gateway": {"models": ["direct-a"], "api_keys": ["k0"]},
    }
    with mock.patch.object(auth_module, "SEEN_HEADERS", 8):
        auth = Auth(parse_config(data))
        for n in range(1, 50):
            header = "Bearer k0" + " " * (n * 1000)  # up to ~49 KB
            assert sorted(auth.access(header).targets) == ["direct-a"]  # valid, each time
            assert sum(map(len, auth._seen)) <= 8 * 1024
        auth.access("Bearer k0")
        assert "Bearer k0" in auth._seen  # a header of ordinary size is still remembered
