"""The e2e workload: tenants with long shared system prompts, asking in random interleaving.

Every tenant has a system prompt of a few hundred words drawn from ``model.WORDS`` (seeded), and
asks questions of 10–60 words; a request is a chat completion (system + user) or a text
completion (``system + "\\n\\n" + question``) — the two APIs never share blocks, as on a real
engine. ``requests(n, seed)`` gives the same list for the same arguments.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from model import WORDS


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    return " ".join(words).capitalize() + "."


def system_prompt(rng: random.Random, words: int) -> str:
    out: list[str] = []
    while sum(len(s.split()) for s in out) < words:
        out.append(sentence(rng, 8, 20))
    return " ".join(out)


@dataclass(frozen=True)
class Request:
    tenant: int
    api: str  # "chat" | "completions"
    body: dict[str, Any]

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"


def tenants(n: int, seed: int, lo: int = 500, hi: int = 1400) -> list[str]:
    rng = random.Random(f"tenants-{seed}")
    return [f"Tenant {i} ({seed}). " + system_prompt(rng, rng.randint(lo, hi)) for i in range(n)]


def requests(
    n: int, n_tenants: int, seed: int, *, model: str = "tiny", max_tokens: int = 4
) -> list[Request]:
    """``n`` requests of ``n_tenants`` tenants, chat and completions mixed, random interleaving
    (a Zipf-like tenant popularity, so some prefixes stay hot and others are evicted)."""
    prompts = tenants(n_tenants, seed)
    rng = random.Random(f"requests-{seed}")
    weights = [1.0 / (i + 1) ** 0.8 for i in range(n_tenants)]
    out = []
    for _ in range(n):
        t = rng.choices(range(n_tenants), weights)[0]
        question = sentence(rng, 10, 60)
        api = "chat" if rng.random() < 0.6 else "completions"
        if api == "chat":
            body: dict[str, Any] = {
                "model": model,
                "messages": [
                    {"role": "system", "content": prompts[t]},
                    {"role": "user", "content": question},
                ],
            }
        else:
            body = {"model": model, "prompt": prompts[t] + "\n\n" + question}
        body.update(max_tokens=max_tokens, temperature=0.0)
        out.append(Request(t, api, body))
    return out


def chat_shapes() -> list[dict[str, Any]]:
    """Chat request shapes whose tokens the gateway must reproduce exactly (vLLM's /tokenize)."""
    rng = random.Random("shapes")
    system = system_prompt(rng, 120)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "now"}},
    ]
    return [
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]},
        {"messages": [{"role": "user", "content": "Only a user, ünïcödé ✓ and  two  spaces. "}]},
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": sentence(rng, 5, 15)},
                {"role": "assistant", "content": sentence(rng, 5, 15)},
                {"role": "user", "content": sentence(rng, 5, 15)},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": [{"type": "text", "text": "part one"}]},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "You can call tools."},
                {"role": "user", "content": "Weather in Paris?"},
            ],
            "tools": tools,
        },
        {
            "messages": [
                {"role": "system", "content": "You can call tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            ],
            "tools": tools,
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "Continue this:"},
                {"role": "assistant", "content": "Once upon"},
            ],
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ]


def responses_shapes() -> list[dict[str, Any]]:
    """Responses request shapes whose tokens the gateway must reproduce exactly (vLLM's
    ``POST /v1/responses/render``): instructions, string and item inputs, tool calls and their
    outputs, reasoning, flat and namespaced function tools, partial final messages."""
    rng = random.Random("responses")
    system = system_prompt(rng, 120)
    weather = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    output = {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Thinking..."}],
    }
    said = {
        "type": "message",
        "role": "assistant",
        "id": "msg_0",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
    }
    return [
        {"input": "Hi."},
        {"instructions": system, "input": "Only a string, ünïcödé ✓."},
        {
            "instructions": system,
            "input": [
                {"role": "user", "content": sentence(rng, 5, 15)},
                {"role": "assistant", "content": sentence(rng, 5, 15)},
                {"type": "message", "role": "user", "content": sentence(rng, 5, 15)},
            ],
        },
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "part one"}]}]},
        {"instructions": "You can call tools.", "input": "Weather in Paris?", "tools": [weather]},
        {
            "instructions": "You can call tools.",
            "input": [{"role": "user", "content": "Weather in Paris?"}, said, call, output],
            "tools": [weather],
        },
        {
            "input": [{"role": "user", "content": "Weather?"}, call, output],
            "tools": [
                {"type": "namespace", "name": "maps", "description": "Maps.", "tools": [weather]},
                {"type": "web_search_preview"},
            ],
        },
        {
            "input": [
                {"role": "user", "content": "Think first."},
                {"role": "assistant", "content": "Sure."},
                thought,  # merged into the assistant message before it
                {"role": "user", "content": "Go on."},
            ]
        },
        {"input": [{"role": "user", "content": "Think first."}, thought, said]},
        {
            "input": [
                {"role": "user", "content": "Continue this:"},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "Once upon", "annotations": []}],
                },
            ]
        },
        {"input": "No tools shown.", "tools": [], "reasoning": {"effort": "low"}},
    ]


def responses_template_shapes() -> list[dict[str, Any]]:
    """``responses_shapes`` and the cases a plain chat template cannot tell apart, for a template
    that prints what it is given (``tests/e2e/responses_template_vectors.py``): every tool kind,
    tool lists that show nothing, reasoning and its merges, effort, continued messages."""
    weather = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    run = {"type": "custom", "name": "run", "description": "Run a shell command."}
    custom_call = {"type": "custom_tool_call", "call_id": "c1", "name": "run", "input": "ls ü"}
    custom_out = {"type": "custom_tool_call_output", "call_id": "c1", "output": "a b"}
    call = {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"}
    spaced = {**call, "call_id": "c3", "namespace": "maps"}
    output = {"type": "function_call_output", "call_id": "c2", "output": "18 C"}
    thought = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "s"}],
    }
    user = {"role": "user", "content": "q"}
    return [
        *responses_shapes(),
        {"input": [user, custom_call, custom_out], "tools": [run]},
        {"input": "hi", "tools": [run, weather]},
        {"input": "hi", "tools": [{"type": "web_search_preview"}]},
        {"input": "hi", "tools": []},
        {"input": "hi", "tools": [weather], "tool_choice": "none"},
        {
            "input": "hi",
            "tools": [
                {"type": "namespace", "name": "m", "description": "d", "tools": [weather, run]}
            ],
        },
        {"input": [user, {"role": "assistant", "content": []}, call, output]},
        {"input": [user, call, spaced, output]},
        {"input": [user, thought, call, thought, {"role": "user", "content": "and?"}]},
        {"input": [user, {"role": "assistant", "content": "Once", "status": "incomplete"}]},
        {"input": [{"role": "developer", "content": "be brief"}, user], "instructions": "sys"},
        {"input": [user, {**output, "output": [{"type": "input_text", "text": "x"}]}]},
        {
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "t", "cache_control": {}}],
                }
            ]
        },
        {"input": "", "instructions": ""},
        *({"input": "hi", "reasoning": {"effort": e}} for e in ("none", "low", "high")),
        {
            "input": "hi",
            "reasoning": {"effort": "low"},
            "chat_template_kwargs": {"enable_thinking": False, "custom": 1},
        },
        {"input": "hi", "reasoning": {}, "chat_template_kwargs": {"add_generation_prompt": False}},
    ]
