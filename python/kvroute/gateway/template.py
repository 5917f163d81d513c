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

__all__ = ["ChatTemplate", "content_format"]

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


def _is_content(node: Any, nodes: Any, aliases: set[str]) -> bool:
    """``x['content']`` / ``x.content`` for any ``x``, or a name assigned from one."""
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Filter) and node.node is not None:
        return _is_content(node.node, nodes, aliases)
    return isinstance(node, nodes.Name) and node.name in aliases


def content_format(env: Any, source: str) -> str:
    """vLLM's detection: ``"openai"`` when the template loops over a message's content (it
    expects a list of parts), ``"string"`` otherwise."""
    from jinja2 import nodes

    try:
        ast = env.parse(source)
    except Exception:
        return "string"
    aliases: set[str] = set()
    for assign in ast.find_all(nodes.Assign):
        if isinstance(assign.target, nodes.Name) and _is_content(assign.node, nodes, set()):
            aliases.add(assign.target.name)
    for loop in ast.find_all(nodes.For):
        if _is_content(loop.iter, nodes, aliases):
            return "openai"
    return "string"


def _text_parts(role: str, content: Any) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise RequestError(f"{role} message content must be a string or a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") in ("text", "input_text"):
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"a text part of a {role} message has no string 'text'")
            texts.append(text)
        # Non-text parts (images, audio …) become engine-specific placeholders: not routed.
    return texts


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


def _message(m: Any, fmt: str, developer: bool) -> dict[str, Any]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError("every message must be an object with a string 'role'")
    role = m["role"]
    texts = _text_parts(role, m.get("content"))
    out: dict[str, Any] = {"role": role}
    if fmt == "openai":
        out["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        out["content"] = "\n".join(texts)
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [_tool_call(c) for c in calls]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool":
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(out["content"], list):
            out["content"] = "\n".join(texts)
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if role == "developer" and not developer:
        out["role"] = "system"
    return out


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
        self.developer_role = "developer" in source
        from jinja2 import meta

        self.variables = meta.find_undeclared_variables(env.parse(source))

    def render(self, payload: dict[str, Any]) -> str:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise RequestError(f"'messages' must be a list, got {type(messages).__name__}")
        conversation = [_message(m, self.content_format, self.developer_role) for m in messages]
        tools = payload.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("'tools' must be a list")
        tool_dicts = [_tool(t) for t in tools] if tools else None
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
