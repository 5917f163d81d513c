"""The two-call experiment: does the gateway keep a long system prompt's cache hot?

Two chat calls through an OpenAI-compatible gateway (``kvroute serve``) to one endpoint, with the
same long system prompt and a different question. Each call prints its elapsed time and the
``usage`` it got back; at the end the prompt-cache hit tokens of both are compared. Through a
gateway that keeps the endpoint on the worker that already holds the prompt, the first call finds
nothing cached (``prompt_cache_hit_tokens`` 0) and the second finds the whole system prompt.

    python examples/two_calls.py --base-url http://127.0.0.1:8000/v1 --api-key sk-acme \\
        --endpoint ep-acme

Base URL, key and endpoint also come from ``KVROUTE_BASE_URL``, ``KVROUTE_API_KEY`` and
``KVROUTE_ENDPOINT``. Needs the OpenAI SDK (``pip install openai``). Exits with 1 when a reply has
no ``prompt_cache_hit_tokens`` (a gateway or engine that does not report cached tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from openai import OpenAI

SYSTEM_PROMPT = (
    "You are the support assistant of ACME Rockets. Answer in one short sentence. "
    "The policy handbook follows; quote the rule you apply.\n"
    + "\n".join(
        f"Rule {i}: rockets of series R{i} are fuelled with mixture M{i % 7}, inspected every "
        f"{10 + i % 13} days and never launched in winds above {20 + i % 9} knots."
        for i in range(1, 81)
    )
)

QUESTIONS = (
    "Which mixture does a rocket of series R12 take?",
    "How often is a rocket of series R40 inspected?",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("KVROUTE_BASE_URL", "http://127.0.0.1:8000/v1")
    )
    parser.add_argument("--api-key", default=os.environ.get("KVROUTE_API_KEY", "sk-none"))
    parser.add_argument("--endpoint", default=os.environ.get("KVROUTE_ENDPOINT", "ep-demo"))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    print(f"system prompt: {len(SYSTEM_PROMPT)} characters; endpoint {args.endpoint}")
    hits = []
    for n, question in enumerate(QUESTIONS, 1):
        started = time.perf_counter()
        response = client.chat.completions.create(
            model=args.endpoint,
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question},
            ],
            max_tokens=args.max_tokens,
        )
        elapsed = time.perf_counter() - started
        usage = response.usage
        hit = getattr(usage, "prompt_cache_hit_tokens", None)
        miss = getattr(usage, "prompt_cache_miss_tokens", None)
        hits.append(hit)
        print(f"call {n}: {elapsed * 1e3:.0f} ms")
        print(f"  answer: {(response.choices[0].message.content or '').strip()[:100]}")
        print(f"  usage: {usage.model_dump_json(exclude_none=True) if usage else None}")
        print(f"  prompt_tokens={usage.prompt_tokens if usage else None}")
        print(f"  prompt_cache_hit_tokens={hit}")
        print(f"  prompt_cache_miss_tokens={miss}")
    if None in hits:
        print(
            "no prompt_cache_hit_tokens in the usage: the gateway or engine reports no cache hits"
        )
        return 1
    print(f"hit tokens: first call {hits[0]}, second call {hits[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
