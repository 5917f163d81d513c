"""A model's Jinja chat template rendered as Hugging Face and vLLM render it (see ``prompt``).

``ChatTemplate(source, special_tokens).render(payload)`` turns a ``/v1/chat/completions`` body
into the prompt text the engine tokenizes. The environment is the one ``transformers`` builds for
``apply_chat_template`` (a sandbox, so a template cannot reach the gateway's objects); the
messages and tools are normalized as vLLM's request parsing leaves them. Bad input — messages
that are not a list of objects, a template that raises — is a ``RequestError`` (HTTP 400).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from .prompt import RequestError

__all__ = ["ChatTemplate", "content_format", "template_tools"]

#: transformers' marker for ``continue_final_message`` (appended, rendered, cut at).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _environment() -> Any:
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError(
            "[tokenizer] model_dir needs jinja2 to render the chat template "
            "(pip install 'kvroute[gateway]')"
        ) from e

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker): its body."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class _Unsupported(Exception):
    """A loop or assignment target vLLM's walk requires to be a plain name and that is not."""


def _names(target: Any, nodes: Any) -> str:
    if not isinstance(target, nodes.Name):
        raise _Unsupported
    return str(target.name)


def _reads(node: Any, nodes: Any, var: str, key: str | None = None) -> bool:
    """``var`` (``key`` given: ``var.key`` / ``var['key']``), also under filters, tests and
    slices — what vLLM counts as reading a variable or its elements."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)):
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, nodes.Getitem):
            if not (isinstance(node.arg, nodes.Const) and node.arg.value == key):
                return False
        elif not (isinstance(node, nodes.Getattr) and node.attr == key):
            return False
        node = node.node
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var


def _loops_over_content(ast: Any, nodes: Any) -> bool:
    """vLLM's walk (``vllm/renderers/hf.py``, 0.32), re-implemented: the rules are in the
    ``prompt`` module docs."""
    lists = ["messages"]
    for var in lists:
        for a in ast.find_all(nodes.Assign):
            if _reads(a.node, nodes, var):
                name = _names(a.target, nodes)
                if name not in lists:
                    lists.append(name)
    loops = list(ast.find_all(nodes.For))
    messages = [
        _names(f.target, nodes) for f in loops if any(_reads(f.iter, nodes, v) for v in lists)
    ]

    def is_content(node: Any) -> bool:
        return any(_reads(node, nodes, m, "content") for m in messages)

    bound: dict[int, set[str]] = {}
    in_macro: set[int] = set()
    calls = list(ast.find_all(nodes.Call))
    for macro in ast.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        filled: set[str] = set()
        for call in calls:
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                filled.update(
                    params[i] for i, a in enumerate(call.args[: len(params)]) if is_content(a)
                )
                filled.update(k.key for k in call.kwargs if k.key in params and is_content(k.value))
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if filled:
                bound[id(loop)] = filled
    for loop in loops:
        it = loop.iter
        if is_content(it):
            pass
        elif isinstance(it, nodes.Name) and it.name in bound.get(id(loop), ()):
            pass
        elif not (isinstance(it, nodes.Name) and it.name == "content" and id(loop) not in in_macro):
            continue
        _names(loop.target, nodes)
        return True
    return False


def content_format(env: Any, source: str) -> str:
    """vLLM's detection: ``"openai"`` when the template loops over a message's content (it
    expects a list of parts), ``"string"`` otherwise — also for a template that does not parse
    or whose walk meets a target that is not a plain name (vLLM's default)."""
    from jinja2 import nodes

    try:
        return "openai" if _loops_over_content(env.parse(source), nodes) else "string"
    except Exception:
        return "string"


#: Content parts vLLM reads as text (``TEXT_PART_TYPES``), each by its field.
_TEXT_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


#: vLLM's media part types (a part without a ``type`` is one when it has such a key).
_MEDIA = (
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)


#: The fields of vLLM's content part types; a text part keeps its other keys (``cache_control``
#: …) in the "openai" format, as vLLM's ``_collect_extra_fields`` keeps them.
_PART_FIELDS = frozenset(
    "type text refusal thinking name uuid data file closed prompt_cache_breakpoint image_url "
    "image_pil image_embeds audio_url input_audio audio_embeds video_url video_embeds".split()
)


def _parts(role: str, content: Any) -> list[dict[str, Any]]:
    """The text-like parts of a message as vLLM's "openai" format hands them to a template:
    ``{"type": "text", "text": …}`` for every text-like part (``text``, ``input_text``,
    ``output_text``, ``refusal``, ``thinking``; a ``text`` or ``refusal`` part without its
    field is skipped, as vLLM skips it) and ``{"type": "tool_reference", "name": …}``."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"{role} message content must be a string or a list of parts")
    out = []
    for part in content:
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            raise RequestError(f"a content part of a {role} message is not an object")
        kind = part.get("type")
        if kind is None:
            kind = next((k for k in _MEDIA if k in part), None)
            if kind is None:
                raise RequestError(f"a content part of a {role} message has no 'type'")
        if kind in _TEXT_FIELDS:
            text = part.get(_TEXT_FIELDS[kind])
            if text is None and kind in ("text", "refusal"):
                continue
            if not isinstance(text, str):
                raise RequestError(
                    f"a {kind} part of a {role} message has no string {_TEXT_FIELDS[kind]!r}"
                )
            extra = {k: v for k, v in part.items() if k not in _PART_FIELDS}
            out.append({"type": "text", "text": text, **extra})
        elif kind == "tool_reference":
            if not isinstance(part.get("name"), str):
                raise RequestError(
                    f"a tool_reference part of a {role} message has no string 'name'"
                )
            out.append({"type": "tool_reference", "name": part["name"]})
        elif kind not in _MEDIA:
            raise RequestError(f"unsupported content part type {kind!r} in a {role} message")
        # Media parts (images, audio …) become engine-specific placeholders: not routed.
    return out


def _tool_call(call: Any) -> Any:
    """An assistant tool call with its JSON ``arguments`` parsed to an object, as vLLM does."""
    if not isinstance(call, dict):
        raise RequestError("assistant tool_calls entries must be objects")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise RequestError("chat completions only support assistant tool_calls of type 'function'")
    arguments = function.get("arguments")
    if arguments:
        parsed = arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
        if not isinstance(parsed, dict):
            parsed = {}
    else:
        parsed = {}
    return {**call, "function": {**function, "arguments": parsed}}


#: Claude Code's attribution line, which vLLM strips from system text parts (its ``cch`` value
#: changes on every request).
_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(content: Any) -> Any:
    """A system message's content without the text lines vLLM strips: a text part starting with
    the billing header loses its first line (and goes when nothing is left)."""
    if not isinstance(content, (str, list)):
        return content
    out = []
    for part in [content] if isinstance(content, str) else content:
        text = part if isinstance(part, str) else None
        if isinstance(part, dict) and part.get("type") == "text":
            text = part.get("text")
        if not (isinstance(text, str) and text.startswith(_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _message(m: Any, fmt: str) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError("every message must be an object with a string 'role'")
    role = m["role"]
    content = m.get("content")
    parts = _parts(role, _without_billing_header(content) if role == "system" else content)
    out: dict[str, Any] = {"role": role}
    # "string" format: the texts (a tool reference's name among them) joined with newlines.
    joined = "\n".join(p.get("text", p.get("name", "")) for p in parts)
    out["content"] = parts if fmt == "openai" else joined
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_tool_call(c) for c in calls]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        # vLLM joins a tool result's text parts into one string unless a part is not text.
        if fmt == "openai" and all(p["type"] == "text" for p in parts):
            out["content"] = "\n".join(p["text"] for p in parts)
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for a template that does not name the developer role: developer messages
    become system ones, and when a system message is then not first (or not alone) all of them
    merge into one first system message (texts joined with blank lines)."""
    out: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        out.append(m)
    texts: list[str] = []
    merge = False
    for i, m in enumerate(out):
        if m["role"] == "system":
            merge = merge or i > 0 or bool(texts)
            content = m["content"]
            if isinstance(content, list):
                content = "\n".join(p["text"] for p in content if "text" in p)
            if content:
                texts.append(content)
    if not merge:
        return out
    return [{"role": "system", "content": "\n\n".join(texts)}] + [
        m for m in out if m["role"] != "system"
    ]


def _tool(tool: Any) -> dict[str, Any]:
    """A tool as vLLM's request model dumps it (unknown keys dropped, optional ones kept)."""
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        raise RequestError("every tool must be an object with a 'function' object")
    f = tool["function"]
    if not isinstance(f.get("name"), str):
        raise RequestError("every tool function must have a string 'name'")
    function: dict[str, Any] = {
        "name": f["name"],
        "description": f.get("description"),
        "parameters": f.get("parameters"),
    }
    defer = f.get("defer_loading")
    if defer is None:
        defer = tool.get("defer_loading")
    if f.get("strict") is not None:
        function["strict"] = f["strict"]
    if defer is not None:
        function["defer_loading"] = defer
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": function}
    if tool.get("defer_loading") is not None:
        out["defer_loading"] = tool["defer_loading"]
    return out


def template_tools(payload: dict[str, Any], exclude_when_choice_none: bool) -> Any:
    """The ``tools`` a template sees, as vLLM passes them: ``None`` when the request has none
    (or with vLLM's ``--exclude-tools-when-tool-choice-none`` when ``tool_choice`` is
    ``"none"``), else the list — an empty one included."""
    tools = payload.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    if tools is None or (exclude_when_choice_none and payload.get("tool_choice") == "none"):
        return None
    return [_tool(t) for t in tools]


class ChatTemplate:
    """One compiled chat template and the tokenizer's special tokens."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
        except Exception as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.special_tokens = dict(special_tokens)
        self.content_format = content_format(env, source)
        # vLLM's test: the role named as a quoted string.
        self.developer_role = '"developer"' in source or "'developer'" in source
        from jinja2 import meta

        self.variables = meta.find_undeclared_variables(env.parse(source))

    def render(
        self, payload: dict[str, Any], exclude_tools_when_tool_choice_none: bool = False
    ) -> str:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise RequestError(f"'messages' must be a list, got {type(messages).__name__}")
        conversation = [_message(m, self.content_format) for m in messages]
        if not self.developer_role and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        tool_dicts = template_tools(payload, exclude_tools_when_tool_choice_none)
        extra = payload.get("chat_template_kwargs")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise RequestError("'chat_template_kwargs' must be an object")
        continue_final = payload.get("continue_final_message") is True
        add_generation = payload.get("add_generation_prompt", True) is not False
        kwargs = {k: v for k, v in extra.items() if k in self.variables}
        final = ""
        if continue_final:
            # As transformers does: tag the final text, render, cut at the tag.
            if not conversation:
                raise RequestError("continue_final_message needs a final message")
            last = conversation[-1]
            content = last["content"]
            if isinstance(content, list):
                texts = [p for p in content if "text" in p]
                if not texts:
                    raise RequestError("continue_final_message: the final message has no text")
                final = texts[-1]["text"]
                texts[-1]["text"] = final + _CONTINUE_TAG
            else:
                final = content
                last["content"] = content + _CONTINUE_TAG
        variables = {
            **self.special_tokens,
            **kwargs,
            "messages": conversation,
            "tools": tool_dicts,
            "documents": payload.get("documents"),
            "add_generation_prompt": add_generation,
        }
        try:
            text = self._template.render(**variables)
        except RequestError:
            raise
        except Exception as e:
            raise RequestError(f"the chat template rejected the request: {e}") from e
        if continue_final:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise RequestError(
                    "continue_final_message: the template drops part of the final message"
                )
            at = text.rindex(tag)
            if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                text = text[:at]
            else:
                text = text[:at].rstrip()
        return text
