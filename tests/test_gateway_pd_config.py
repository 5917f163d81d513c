"""``[pd]`` checked at load against the fleet it pairs, and the workers' URLs
(``kvroute.server.config``): each fleet, key or URL the gateway cannot serve is refused, naming
why."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kvroute.gateway import parse_config


def config(protocol: str, roles: list[str], **pd: Any) -> dict[str, Any]:
    """A gateway config of one worker per role, all of ``protocol``'s kind."""
    workers = [
        {"name": f"w{i}", "url": f"http://127.0.0.1:{8001 + i}", "kind": protocol, "role": role}
        for i, role in enumerate(roles)
    ]
    return {
        "gateway": {"models": ["m"]},
        "router": {"policy": "kv_aware", "block_size": 16},
        "workers": workers,
        "pd": {"protocol": protocol, **pd},
    }


def test_good_pd_fleets_load():
    for protocol in ("vllm", "sglang"):
        cfg = parse_config(config(protocol, ["prefill", "decode"]))
        assert cfg.pd is not None and cfg.pd.protocol == protocol
        assert [w.role for w in cfg.workers] == ["prefill", "decode"]
    assert parse_config(config("vllm", ["both", "both"])).pd is not None


@pytest.mark.parametrize("roles", [["both"], ["prefill", "both"], ["both", "decode"]])
def test_sglang_refuses_workers_that_do_both(roles):
    """SGLang's PD mode has no server that does both: a plain server would get the bootstrap
    fields of a split pair and compute the whole prompt, the prefill's room never taken."""
    names = [f"w{i}" for i, r in enumerate(roles) if r == "both"]
    with pytest.raises(ValueError, match=re.escape(f"workers {names!r} have role = 'both'")):
        parse_config(config("sglang", roles))


@pytest.mark.parametrize(
    ("protocol", "roles", "message"),
    [
        ("vllm", ["prefill", "prefill"], "needs a worker that decodes"),
        ("sglang", ["prefill"], "needs a worker that decodes"),
        ("vllm", ["decode", "decode"], "needs a worker with role = 'both' or 'prefill': no pair"),
        ("sglang", ["decode", "decode"], "needs a worker with role = 'prefill': SGLang's decode"),
    ],
)
def test_a_fleet_that_cannot_form_a_pair_is_refused(protocol, roles, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(config(protocol, roles))


@pytest.mark.parametrize(
    ("protocol", "pd", "message"),
    [
        ("vllm", {"saturation": 0.0}, "pd.saturation must be > 0, got 0.0"),
        ("sglang", {"saturation": 2.0}, "pd.saturation does not apply to SGLang"),
        ("sglang", {"threshold": 10}, "pd.threshold does not apply to SGLang"),
    ],
)
def test_pd_keys_that_would_do_nothing_are_refused(protocol, pd, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(config(protocol, ["prefill", "decode"], **pd))
    assert parse_config(config("vllm", ["prefill", "decode"], saturation=0.5)).pd.saturation == 0.5


@pytest.mark.parametrize(
    "key", ["pd_threshold", "pd_saturation", "pd_local_prefill"], ids=lambda k: k
)
def test_router_options_cannot_override_pd(key):
    """``[pd]`` sets the router's pd options (and checks them against the protocol): the same
    keys in ``[router] options`` would override it unchecked."""
    for protocol in ("vllm", "sglang"):
        data = config(protocol, ["prefill", "decode"])
        data["router"]["options"] = {key: 1}
        with pytest.raises(ValueError, match=re.escape(f"router.options must not set ['{key}']")):
            parse_config(data)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:99999", "workers[1].url has a port outside 1..65535"),
        ("http://127.0.0.1:0", "workers[1].url has a port outside 1..65535"),
        ("http://127.0.0.1:8000/v1", "workers[1].url must be the worker's base URL"),
        ("http://127.0.0.1:8000/v1/", "workers[1].url must be the worker's base URL"),
        ("http://127.0.0.1:8000?x=1", "workers[1].url must be the worker's base URL"),
        ("http://127.0.0.1:8000#f", "workers[1].url must be the worker's base URL"),
        ("http://127.0.0.1:8001", "duplicate worker url(s): ['http://127.0.0.1:8001']"),
        ("HTTP://127.0.0.1:8001/", "duplicate worker url(s): ['http://127.0.0.1:8001']"),
        ("http://:8000", "workers[1].url must be an http(s) URL"),
    ],
)
def test_a_worker_url_the_gateway_cannot_use_is_refused(url, message):
    data = config("vllm", ["prefill", "decode"])
    data["workers"][1]["url"] = url
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(data)


def test_a_worker_url_may_have_a_proxys_path_prefix():
    data = config("vllm", ["prefill", "decode"])
    data["workers"][1]["url"] = "https://proxy.example:8443/engines/a/"
    assert parse_config(data).workers[1].url == "https://proxy.example:8443/engines/a"


@pytest.mark.parametrize(
    ("kind", "role", "key"),
    [
        ("vllm", "prefill", "bootstrap_port"),
        ("vllm", "both", "bootstrap_host"),
        ("sglang", "decode", "bootstrap_port"),
        ("sglang", "both", "bootstrap_host"),
    ],
)
def test_bootstrap_address_only_on_sglang_prefill_servers(kind, role, key):
    """Only an SGLang prefill server publishes KV at a bootstrap address: the keys on any other
    worker would do nothing (a wrong port unnoticed until a pair fails), so they are refused,
    naming the worker."""
    value = 9000 if key == "bootstrap_port" else "10.0.0.9"
    data = config(kind, ["prefill", "decode"])
    data["workers"][0].update(role=role, **{key: value})
    message = (
        f"workers[0].{key} applies to SGLang prefill servers only (kind = 'sglang', "
        f"role = 'prefill'); worker 'w0' has kind = {kind!r}, role = {role!r}"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_config(data)
    data = config("sglang", ["prefill", "decode"])
    data["workers"][0].update(bootstrap_port=9000, bootstrap_host="10.0.0.9")
    w = parse_config(data).workers[0]
    assert (w.bootstrap_host, w.bootstrap_port) == ("10.0.0.9", 9000)
