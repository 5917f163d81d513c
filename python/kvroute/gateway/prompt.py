"""Prompt → routing tokens: the engine's own tokens with a model directory, else a canonical
rendering and a byte-level fallback.

**With ``[tokenizer] model_dir``** (``ModelTokenizer``) the gateway routes by the token ids the
engine prefills, so exact (events) mode sees the same blocks the engine caches. It reproduces
vLLM's ``/v1/chat/completions`` preprocessing without transformers or torch:

- the model's chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s
  ``chat_template``; a named ``tool_use`` template when tools are passed) rendered with
  jinja2's ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` and the
  ``loopcontrols`` extension as Hugging Face's ``apply_chat_template`` does, with HF's ``tojson``
  (``json.dumps``, non-ASCII kept, keys unsorted), ``raise_exception`` and ``strftime_now``, and a
  no-op ``{% generation %}`` block;
- the variables vLLM passes: ``messages``, ``tools``, ``add_generation_prompt`` (the request's,
  default true), ``continue_final_message``, every special token of the tokenizer config
  (``bos_token``, ``eos_token``, …) and the request's ``chat_template_kwargs``;
- messages normalized as vLLM's ``parse_chat_messages`` does: the text-like parts (``text``,
  ``input_text``, ``output_text``, ``refusal``, ``thinking``, each by its own field; ``text`` /
  ``refusal`` parts without it skipped) and tool references (their ``name``) joined with ``"\n"``
  (``"string"`` content format) or kept as ``[{"type": "text", "text": …}]`` (with the part's keys
  no content part type defines, e.g. ``cache_control``) /
  ``{"type": "tool_reference", "name": …}`` (``"openai"`` format); a tool message's parts are
  joined unless one is not text. The format is vLLM's detection (``template.content_format``):
  ``"openai"`` when the template loops over ``m.content`` / ``m['content']`` of a loop variable
  ``m`` over ``messages`` (or over a name assigned from it), also through a filter, a test or a
  slice; over a macro parameter that a call of the macro fills with such a content, by position
  or keyword; or, outside every macro, over a name ``content``. ``name``, assistant
  ``tool_calls`` (their JSON ``arguments`` parsed to objects, as vLLM does), ``reasoning``, tool
  ``tool_call_id`` kept; a system message's text parts lose a first line starting with Claude
  Code's ``x-anthropic-billing-header`` (a part with nothing else goes), as vLLM strips it; when
  the template does not quote the role (``"developer"`` / ``'developer'``) ``developer`` messages
  become ``system`` ones and, if a system message is then not first or not alone, all of them
  merge into one first system message, their texts joined with ``"\n\n"``;
- ``tools`` passed as vLLM passes them: ``None`` only when the request has no ``tools`` (or, with
  ``[tokenizer] exclude_tools_when_tool_choice_none = true`` — vLLM's
  ``--exclude-tools-when-tool-choice-none``, off by default — when ``tool_choice`` is ``"none"``);
  ``"tools": []`` reaches the template as ``[]`` (and selects a named ``tool_use`` template);
- each tool as vLLM's request model dumps it: ``{"type", "function": {"name", "description",
  "parameters"[, "strict"][, "defer_loading"]}}``;
- the text tokenized by the model's ``tokenizer.json`` (HF ``tokenizers``) with
  ``add_special_tokens`` = the request's (chat default false, completions default true — vLLM's
  defaults, so a completions prompt gets its BOS as the engine's does).

Multimodal parts are not expanded (the engine replaces them by placeholder tokens the gateway
cannot know); their text parts still route.

**Without a model directory.** A chat request is rendered canonically (``render_chat``) as the
concatenation of

- ``"<|tools|>\\n" + J(tools) + "\\n"`` when ``tools`` is a non-empty list, then for each message
- ``"<|" + role + "|>\\n" + content + extras + "\\n"``, where ``content`` is the string content,
  or for a list of parts the ``text`` of each text part and ``J(part)`` of any other part
  (images, audio …), concatenated; ``extras`` is ``J({other keys})`` of the message's keys other
  than ``role`` and ``content`` (``name``, ``tool_calls`` …), or nothing when there are none.

``J(x)`` is canonical JSON: ``json.dumps(x, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)``. A message that is not an object renders as ``J(message)``. Because each
message's rendering depends only on that message, a conversation that grows by appending messages
renders to a string that extends the previous one, and one long system prompt renders identically
whatever follows it.

A completions request uses its ``prompt``: a string as is, a list of strings by its first string
(a batch goes to one worker), and token ids (a list of ints, or a list of such lists: the first)
directly — they are already what the engine sees.

With ``[tokenizer] path`` a Hugging Face ``tokenizers`` file (``tokenizer.json``) encodes the
rendered text without special tokens. Otherwise the **byte-level fallback** is used: the UTF-8
bytes of the rendered text, zero-padded to a multiple of ``bytes_per_token`` (1, 2 or 4; default
4), each group read as a little-endian unsigned integer — one pseudo-token per group. Two prompts
that share their first ``n`` bytes share their first ``n // bytes_per_token`` pseudo-tokens, hence
``n // (bytes_per_token × block_size)`` full blocks: prefix affinity at byte granularity. Neither
is the engine's tokenization: ``/health`` and the metrics say which tokenizer routes
(``Tokenizer.name``: ``"model"``, ``"hf"`` or ``"bytes"``, and ``exact``).

Token counts reported by an engine (``usage.prompt_tokens``, ``cached_tokens``) are in the engine's
tokens; ``to_routing_tokens`` converts them to routing tokens by the ratio of the two prompt lengths
(the identity with a model directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "ModelTokenizer",
    "RequestError",
    "Tokenizer",
    "canonical_json",
    "load_tokenizer",
    "prompt_of",
    "render_chat",
    "to_routing_tokens",
]

#: The named special tokens a chat template sees (``transformers``' ``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

#: Prompts longer than this (characters) are tokenized off the event loop by an HF tokenizer.
OFFLOAD_CHARS = 32_768


class RequestError(ValueError):
    """The request body cannot be rendered (answered with HTTP 400)."""


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                out.append(part["text"])
            else:
                out.append(canonical_json(part))
        return "".join(out)
    return canonical_json(content)


def render_chat(messages: Any, tools: Any = None) -> str:
    """The canonical text of a chat request (see the module docs)."""
    if not isinstance(messages, list):
        raise RequestError(f"'messages' must be a list, got {type(messages).__name__}")
    out = []
    if isinstance(tools, list) and tools:
        out.append("<|tools|>\n" + canonical_json(tools) + "\n")
    for m in messages:
        if not isinstance(m, dict):
            out.append(canonical_json(m))
            continue
        role = m.get("role")
        extras = {k: v for k, v in m.items() if k not in ("role", "content")}
        out.append(
            "<|"
            + (role if isinstance(role, str) else canonical_json(role))
            + "|>\n"
            + _content(m.get("content"))
            + (canonical_json(extras) if extras else "")
            + "\n"
        )
    return "".join(out)


def prompt_of(prompt: Any) -> str | np.ndarray:
    """A completions ``prompt`` as text to tokenize, or as token ids (uint32) used directly."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            prompt = first
        if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt):
            return np.asarray(prompt, dtype=np.uint32)
    raise RequestError("'prompt' must be a string, a list of strings, or token ids")


class Tokenizer:
    """A request → routing token ids (uint32)."""

    name = "tokenizer"
    #: Whether encoding a long text is worth running off the event loop.
    slow = False
    #: Whether the ids are the engine's own (chat template and tokenizer of the served model).
    exact = False

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError

    def chat_tokens(self, payload: dict[str, Any]) -> np.ndarray:
        """The routing tokens of a ``/v1/chat/completions`` body."""
        return self.encode(render_chat(payload.get("messages"), payload.get("tools")))

    def completion_tokens(self, payload: dict[str, Any]) -> np.ndarray:
        """The routing tokens of a ``/v1/completions`` body."""
        prompt = prompt_of(payload.get("prompt"))
        return prompt if isinstance(prompt, np.ndarray) else self.encode(prompt)

    def describe(self) -> dict[str, Any]:
        """What ``/health`` reports about the tokenizer."""
        return {"name": self.name, "exact": self.exact}


class ByteTokenizer(Tokenizer):
    """The byte-level fallback: ``bytes_per_token`` UTF-8 bytes per little-endian pseudo-token."""

    name = "bytes"

    def __init__(self, bytes_per_token: int = 4) -> None:
        if bytes_per_token not in (1, 2, 4):
            raise ValueError(f"bytes_per_token must be 1, 2 or 4, got {bytes_per_token!r}")
        self.bytes_per_token = bytes_per_token
        self._dtype = np.dtype({1: "u1", 2: "<u2", 4: "<u4"}[bytes_per_token])

    def encode(self, text: str) -> np.ndarray:
        data = text.encode("utf-8")
        tail = len(data) % self.bytes_per_token
        if tail:
            data += b"\0" * (self.bytes_per_token - tail)
        tokens = np.frombuffer(data, dtype=self._dtype)
        return tokens if self.bytes_per_token == 4 else tokens.astype(np.uint32)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bytes_per_token": self.bytes_per_token}


def _load_hf(path: str, what: str) -> Any:
    try:
        from tokenizers import Tokenizer as _HF
    except ImportError as e:
        raise ImportError(
            f"{what} needs the 'tokenizers' package (pip install 'kvroute[gateway]')"
        ) from e
    try:
        return _HF.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise ValueError(f"cannot load tokenizer file {path!r}: {e}") from e


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` file loaded from a local path (no download), encoding the
    canonical rendering without special tokens."""

    name = "hf"
    slow = True

    def __init__(self, path: str) -> None:
        self._tok = _load_hf(path, f"[tokenizer] path = {path!r}")
        self.path = path

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer configs spell it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _flag(payload: dict[str, Any], key: str, default: bool) -> bool:
    value = payload.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key!r} must be a boolean, got {type(value).__name__}")
    return value


class ModelTokenizer(Tokenizer):
    """The served model's chat template and tokenizer, from a local model directory: the ids
    the engine prefills (see the module docs)."""

    name = "model"
    slow = True
    exact = True

    def __init__(self, model_dir: str, exclude_tools_when_tool_choice_none: bool = False) -> None:
        from .template import ChatTemplate

        #: vLLM's ``--exclude-tools-when-tool-choice-none`` (``[tokenizer]``'s key of that name).
        self.exclude_tools = exclude_tools_when_tool_choice_none

        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(
                f"[tokenizer] model_dir = {model_dir!r} has no tokenizer.json (a Hugging Face "
                "model directory is expected)"
            )
        self._tok = _load_hf(str(root / "tokenizer.json"), f"[tokenizer] model_dir = {model_dir!r}")
        config: dict[str, Any] = {}
        config_file = root / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"cannot read {config_file}: {e}") from e
        special: dict[str, str] = {}
        for source in (root / "special_tokens_map.json", config_file):
            if not source.is_file():
                continue
            data = config if source == config_file else json.loads(source.read_text("utf-8"))
            for key, value in data.items():
                text = _token_text(value)
                if key in SPECIAL_TOKENS and text is not None:
                    special[key] = text
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                    templates[str(entry.get("name", "default"))] = entry["template"]
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        for extra in sorted((root / "additional_chat_templates").glob("*.jinja")):
            templates.setdefault(extra.stem, extra.read_text(encoding="utf-8"))
        if "default" not in templates:
            raise ValueError(
                f"[tokenizer] model_dir = {model_dir!r} has no chat template "
                "(chat_template.jinja or tokenizer_config.json's chat_template)"
            )
        self.model_dir = model_dir
        self.templates = {name: ChatTemplate(text, special) for name, text in templates.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, dtype=np.uint32)

    def render(self, payload: dict[str, Any]) -> str:
        """The chat request's prompt text, as the engine renders it."""
        from .template import template_tools

        template = self.templates["default"]
        # transformers picks the named tool_use template whenever tools are passed, [] too.
        if template_tools(payload, self.exclude_tools) is not None:
            template = self.templates.get("tool_use", template)
        return template.render(payload, self.exclude_tools)

    def chat_tokens(self, payload: dict[str, Any]) -> np.ndarray:
        text = self.render(payload)
        return self.encode(text, _flag(payload, "add_special_tokens", False))

    def completion_tokens(self, payload: dict[str, Any]) -> np.ndarray:
        prompt = prompt_of(payload.get("prompt"))
        if isinstance(prompt, np.ndarray):
            return prompt
        return self.encode(prompt, _flag(payload, "add_special_tokens", True))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "model_dir": self.model_dir}


def load_tokenizer(
    path: str | None,
    bytes_per_token: int = 4,
    model_dir: str | None = None,
    exclude_tools_when_tool_choice_none: bool = False,
) -> Tokenizer:
    """The tokenizer a config asks for: the model directory's, else a tokenizer file's, else the
    byte-level fallback."""
    if model_dir is not None:
        return ModelTokenizer(model_dir, exclude_tools_when_tool_choice_none)
    return ByteTokenizer(bytes_per_token) if path is None else HFTokenizer(path)


def to_routing_tokens(engine_tokens: int, engine_prompt: int | None, routing_prompt: int) -> int:
    """Engine-reported tokens converted to routing tokens (by the prompts' length ratio)."""
    if not engine_prompt or engine_prompt <= 0 or engine_prompt == routing_prompt:
        return min(max(engine_tokens, 0), routing_prompt)
    scaled = round(engine_tokens * routing_prompt / engine_prompt)
    return min(max(scaled, 0), routing_prompt)
