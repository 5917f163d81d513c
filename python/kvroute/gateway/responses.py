"""The OpenAI Responses API (``POST /v1/responses``) as the gateway routes it.

**Routing tokens.** A Responses request is routed by the chat prompt the engine renders for it;
``chat_view`` gives the chat body that renders to that prompt (``Tokenizer.chat_tokens``), as
vLLM's Responses server builds it for a request without ``previous_response_id``:

- ``instructions`` (a non-empty string) as a first ``system`` message;
- ``input`` as a ``user`` message when it is a string; else each item in order:
  ``function_call`` → an assistant ``tool_calls`` entry ``{"id": call_id, "function": {"name",
  "arguments"}, "type": "function"}`` (the name ``<namespace>__<name>`` when it has a
  namespace; merged into the assistant message before it, if any); ``custom_tool_call`` → one
  whose ``arguments`` are ``{"input": <its input>}`` as JSON; ``function_call_output`` and
  ``custom_tool_call_output`` → a ``tool`` message (``content`` = its ``output``,
  ``tool_call_id``);
  ``reasoning`` → the assistant message's ``reasoning`` (its first ``content`` text, else its
  first ``summary`` text; merged into the assistant message before it when that has none;
  ``encrypted_content`` is refused, as vLLM refuses it); an assistant ``message`` → its text
  (a string ``content``, else the first part's ``text``), merged into the assistant message
  before it when that has no content yet; any other item with a ``role`` → itself, as a chat
  message (a copy: the body sent upstream is the caller's); anything else → refused
  (``RequestError``: vLLM answers such a request 400);
- ``tools``: the ``function`` tools as chat tools (``{"type": "function", "function": {the
  tool's other keys}}``), the ``function`` tools of each ``namespace`` tool named
  ``<namespace>__<name>``, each ``custom`` tool as a function of one string parameter
  ``input``; other tool types (web search, MCP, file search …) are not shown to the model and
  are dropped — a request with only those passes an empty list, one with none (or ``[]``, or
  ``tool_choice = "none"`` with ``exclude_tools_when_tool_choice_none``) no tools;
- ``continue_final_message`` when the last item is a ``message`` or ``reasoning`` item whose
  ``status`` is ``in_progress`` or ``incomplete`` (then no generation prompt);
- ``chat_template_kwargs`` the request's, with ``reasoning_effort`` (``reasoning.effort``) and,
  when reasoning is asked for and the caller did not set it, ``enable_thinking``;
- the text tokenized *with* the tokenizer's special tokens (vLLM's default for a Responses
  request, which has no ``add_special_tokens``): a template that writes the BOS itself gets a
  second one, as the engine's prompt does.

The tokens are checked against vLLM's own rendering (``POST /v1/responses/render``) in
``make e2e`` and by the vectors it wrote (``tests/data/vectors``), and what the template is
given (messages, tools, variables) against vLLM's Responses renderer with a template that prints
it (``tests/e2e/responses_template_vectors.py``). Harmony models (gpt-oss) are
rendered by vLLM from a different prompt format: their routing tokens are this chat rendering
(routing still works, approximately; events mode then predicts no exact match).

**``previous_response_id``.** An engine keeps the responses it stored in its own memory (vLLM
with ``VLLM_ENABLE_RESPONSES_API_STORE=1``): a follow-up naming one is answered only by the
engine that produced it. ``ResponseOwners`` remembers which worker produced each response id
this gateway process served (the most recent ``OWNERS`` ids); a follow-up goes to that worker or,
when it cannot be served there, is answered 503 — never sent where the engine would answer 404.
With ``[cluster] share_responses`` the replicas tell each other theirs
(``kvroute.cluster.responses``); an id no replica told this one of (from before a restart,
or learnt while NATS was down) is routed as any request. The stored history is prepended by
the engine, so such a request's routing tokens cover only its new input (and its cached
tokens, which count the history, do not correct the router).

**Streams.** vLLM sends ``response.created`` and ``response.in_progress`` at once, before the
prefill: the gateway commits a stream only at the first event after them (its first output), so
a failure before any output is retried like a chat stream's. The stream ends with
``response.completed``, ``response.incomplete``, ``response.failed`` or an ``error`` event; the
usage the router learns from is the final response's (``input_tokens``,
``input_tokens_details.cached_tokens``, ``output_tokens``).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .prompt import RequestError

__all__ = [
    "OWNERS",
    "PREAMBLE",
    "RESPONSES",
    "RESPONSE_ID",
    "TERMINAL",
    "ResponseOwners",
    "chat_usage",
    "chat_view",
    "event_payload",
]

RESPONSES = "/v1/responses"
#: Response ids remembered per gateway process (~240 bytes each with the id: ~24 MB in all).
OWNERS = 100_000
#: The events vLLM sends before any output.
PREAMBLE = frozenset((b"response.created", b"response.in_progress"))
#: The events that end a Responses stream.
TERMINAL = frozenset((b"response.completed", b"response.incomplete", b"response.failed", b"error"))
#: The response ids remembered (vLLM's are ``resp_`` and 32 hex digits): URL-safe characters
#: only, so the path of a stored response's route is the id itself.
RESPONSE_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_NAMESPACE_SEPARATOR = "__"
#: The parameters of the function a ``custom`` tool is shown as.
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": ["input"],
    "additionalProperties": False,
}


def _text(value: Any) -> Any:
    return value.get("text") if isinstance(value, dict) else None


def _assistant_text(item: dict[str, Any]) -> Any:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        return _text(content[0])
    return None


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    name = item.get("name")
    namespace = item.get("namespace")
    if isinstance(namespace, str) and namespace and isinstance(name, str):
        name = namespace + _NAMESPACE_SEPARATOR + name
    return {
        "id": item.get("call_id"),
        "function": {"name": name, "arguments": item.get("arguments")},
        "type": "function",
    }


def _custom_call(item: dict[str, Any]) -> dict[str, Any]:
    arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
    return {
        "id": item.get("call_id"),
        "function": {"name": item.get("name"), "arguments": arguments},
        "type": "function",
    }


def _message(item: Any, prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message an input item becomes, or None when it was merged into ``prev`` (the
    last message so far, when it is an assistant's: a message this module made, never the
    caller's item itself)."""
    if not isinstance(item, dict):
        raise RequestError(f"'input' items must be objects, got {type(item).__name__}")
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item) if kind == "function_call" else _custom_call(item)
        if prev is not None:
            calls = prev.get("tool_calls")
            if calls is None or isinstance(calls, list):
                prev["tool_calls"] = [*(calls or ()), call]
                return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise RequestError("'input' has a reasoning item with encrypted_content (unsupported)")
        content, summary = item.get("content"), item.get("summary")
        reasoning = ""
        if isinstance(content, list) and content:
            reasoning = _text(content[0])
        elif isinstance(summary, list) and summary:
            reasoning = _text(summary[0])
        if prev is not None and prev.get("reasoning") is None:
            prev["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if item.get("role") == "assistant":
        text = _assistant_text(item)
        if text is not None:
            if prev is not None and prev.get("content") is None:
                prev["content"] = text
                return None
            return {"role": "assistant", "content": text}
    if "role" in item:
        return dict(item)  # a copy: merging into it must not change the body sent upstream
    raise RequestError(f"'input' has an item of unsupported type {kind!r}")


def _messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(f"'instructions' must be a string, got {type(instructions).__name__}")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    given = payload.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
        return messages
    if not isinstance(given, list):
        raise RequestError("'input' must be a string or a list of items")
    start = len(messages)
    for item in given:
        last = messages[-1] if len(messages) > start else None
        prev = last if last is not None and last.get("role") == "assistant" else None
        message = _message(item, prev)
        if message is not None:
            messages.append(message)
    return messages


def _tools(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The chat tools shown to the model: None without tools, a list (possibly empty: only
    tools the model is not shown) with them."""
    tools = payload.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise RequestError(f"'tools' entries must be objects, got {type(tool).__name__}")
        if tool.get("type") == "function":
            out.append(tool)
        elif tool.get("type") == "custom":  # shown as a function of one string, "input"
            shim = {"name": tool.get("name"), "description": tool.get("description")}
            out.append({**shim, "parameters": _CUSTOM_PARAMETERS})
        elif tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                if isinstance(inner, dict) and inner.get("type") == "function":
                    name = f"{tool.get('name')}{_NAMESPACE_SEPARATOR}{inner.get('name')}"
                    out.append({**inner, "name": name})
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in out
    ]


def _continues(given: Any) -> bool:
    if not isinstance(given, list) or not given or not isinstance(given[-1], dict):
        return False
    last = given[-1]
    return last.get("type", "message") in ("message", "reasoning") and last.get("status") in (
        "in_progress",
        "incomplete",
    )


def chat_view(payload: dict[str, Any]) -> dict[str, Any]:
    """The chat body whose rendering is the Responses request's prompt (see the module docs).
    Raises ``RequestError`` for a body vLLM would refuse."""
    previous = payload.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise RequestError(
            f"'previous_response_id' must be a string, got {type(previous).__name__}"
        )
    # The rendered text is tokenized with the tokenizer's special tokens (vLLM's Responses
    # requests have no add_special_tokens: its default, true), unlike a chat request's.
    view: dict[str, Any] = {"messages": _messages(payload), "add_special_tokens": True}
    tools = _tools(payload)
    if tools is not None:
        view["tools"] = tools
        if "tool_choice" in payload:
            view["tool_choice"] = payload["tool_choice"]
    continues = _continues(payload.get("input"))
    view["continue_final_message"] = continues
    view["add_generation_prompt"] = not continues
    kwargs = payload.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    kwargs = dict(kwargs or {})
    reasoning = payload.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise RequestError(f"'reasoning' must be an object, got {type(reasoning).__name__}")
    effort = reasoning.get("effort") if reasoning is not None else None
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
    if kwargs:  # (add_generation_prompt and continue_final_message in them: overridden)
        view["chat_template_kwargs"] = kwargs
    return view


def chat_usage(usage: Any, cached: bool = True) -> Any:
    """A Responses ``usage`` in chat terms (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``) for the router and the token buckets; anything
    else as it is. Without ``cached`` (a follow-up, whose prompt starts with a stored history
    its routing tokens do not have: the engine's cached tokens say nothing about them) the
    cached tokens are left out, so the router is not corrected by them."""
    if not isinstance(usage, dict) or "input_tokens" not in usage:
        return usage
    out: dict[str, Any] = {
        "prompt_tokens": usage.get("input_tokens"),
        "completion_tokens": usage.get("output_tokens"),
    }
    details = usage.get("input_tokens_details")
    if cached and isinstance(details, dict) and "cached_tokens" in details:
        out["prompt_tokens_details"] = {"cached_tokens": details["cached_tokens"]}
    return out


def event_payload(event: bytes) -> tuple[bytes, Any]:
    """An SSE event's type (its ``event:`` field, else its data's ``type``) and its data parsed
    (None when it has none or it is not JSON)."""
    kind = b""
    data: list[bytes] = []
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            kind = line[6:].strip()
        elif line.startswith(b"data:"):  # a space or CR around JSON is whitespace it ignores
            data.append(line[5:])
    payload = None
    if data:
        try:
            payload = json.loads(b"\n".join(data))
        except (ValueError, RecursionError):
            payload = None
    if not kind and isinstance(payload, dict) and isinstance(payload.get("type"), str):
        kind = payload["type"].encode()
    return kind, payload


class ResponseOwners:
    """Which worker produced each response id (the most recent ``capacity`` ids), and for which
    target, so only callers of that target reach it. ``on_learn`` (set by
    ``kvroute.cluster.ResponseShare``) hears of each one this process learns itself."""

    def __init__(self, capacity: int = OWNERS) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.on_learn: Callable[[str, str, str], None] | None = None

    def learn(self, response_id: Any, worker: str, target: str, *, told: bool = False) -> None:
        """Remembers a response's worker and target (an id that is not ``RESPONSE_ID``'s: not);
        ``told``: another replica's, not passed on."""
        if not isinstance(response_id, str) or not RESPONSE_ID.fullmatch(response_id):
            return
        if not told and self.on_learn is not None:
            self.on_learn(response_id, worker, target)
        self._owners[response_id] = (worker, target)
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, response_id: Any) -> tuple[str, str] | None:
        """``(worker, target name)`` of a response this process served, else None."""
        if not isinstance(response_id, str):
            return None
        return self._owners.get(response_id)

    def __len__(self) -> int:
        return len(self._owners)
