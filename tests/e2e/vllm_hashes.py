"""vLLM's own block hashes for given cases, from the installed wheel (run with ``.venv-e2e``).

Reads ``[{"algo", "seed", "block_size", "tokens", "salt", "lora": [name, path] | null}, …]`` as
JSON on stdin and prints, for each case, the hex digests and the published 64-bit values that
vLLM's ``init_none_hash`` / ``get_request_block_hasher`` / ``maybe_convert_block_hash`` compute —
the engine's code, not a copy of it. ``make e2e`` compares them with ``kvroute.BlockHasher``.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace


def main() -> None:
    import vllm
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as k

    cases = json.load(sys.stdin)
    out = []
    for case in cases:
        fn = get_hash_fn_by_name(case["algo"])
        os.environ["PYTHONHASHSEED"] = case["seed"]
        k.init_none_hash(fn)
        lora = None
        if case.get("lora"):
            name, path = case["lora"]
            lora = SimpleNamespace(lora_name=name, lora_path=path, adapter_id=1, lora_int_id=1)
        request = SimpleNamespace(
            block_hashes=[],
            num_tokens=len(case["tokens"]),
            all_token_ids=case["tokens"],
            mm_features=[],
            lora_request=lora,
            cache_salt=case.get("salt"),
            prompt_embeds=None,
        )
        hasher = k.get_request_block_hasher(case["block_size"], fn)
        digests = hasher(request)
        os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
        values = [k.maybe_convert_block_hash(d) for d in digests]
        out.append(
            {
                **case,
                "vllm_version": vllm.__version__,
                "none_hash": k.NONE_HASH.hex(),
                "digests": [d.hex() for d in digests],
                "values": values,
            }
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
