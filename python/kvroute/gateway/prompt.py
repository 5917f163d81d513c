"""Prompt → routing tokens: a canonical rendering of the request, then a tokenizer.

The router needs token ids whose blocks repeat exactly when two requests share a prompt prefix.
It does not need the engine's own token ids, so nothing here downloads a model or applies a
model's chat template; what matters is that a shared prefix of the request yields a shared prefix
of tokens.

**Rendering** (``render_chat``). A chat request is rendered to text as the concatenation of

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

**Tokenizers.** With ``[tokenizer] path`` a Hugging Face ``tokenizers`` file (``tokenizer.json``)
is loaded from that local path (``pip install tokenizers``) and encodes the rendered text without
special tokens. Otherwise the **byte-level fallback** is used: the UTF-8 bytes of the rendered
text, zero-padded to a multiple of ``bytes_per_token`` (1, 2 or 4; default 4), each group read as a
little-endian unsigned integer — one pseudo-token per group. Two prompts that share their first
``n`` bytes share their first ``n // bytes_per_token`` pseudo-tokens, hence ``n // (bytes_per_token
× block_size)`` full blocks: prefix affinity at byte granularity. Four bytes per pseudo-token is
close to the usual 3.5–4.5 characters per token of English BPE, so block counts and the load terms
the router derives from them stay in a realistic range.

Token counts reported by an engine (``usage.prompt_tokens``, ``cached_tokens``) are in the engine's
tokens; ``to_routing_tokens`` converts them to routing tokens by the ratio of the two prompt lengths
(exact when the gateway and engine tokenize alike, as the tests' upstreams do).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "RequestError",
    "Tokenizer",
    "canonical_json",
    "load_tokenizer",
    "prompt_of",
    "render_chat",
    "to_routing_tokens",
]

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
    """Text → routing token ids (uint32)."""

    name = "tokenizer"
    #: Whether encoding a long text is worth running off the event loop.
    slow = False

    def encode(self, text: str) -> np.ndarray:
        raise NotImplementedError


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


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` file loaded from a local path (no download)."""

    name = "hf"
    slow = True

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as e:
            raise ImportError(
                f"[tokenizer] path = {path!r} needs the 'tokenizers' package "
                "(pip install tokenizers)"
            ) from e
        try:
            self._tok = _HF.from_file(path)
        except Exception as e:  # tokenizers raises its own Exception type
            raise ValueError(f"cannot load tokenizer file {path!r}: {e}") from e
        self.path = path

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)


def load_tokenizer(path: str | None, bytes_per_token: int = 4) -> Tokenizer:
    return ByteTokenizer(bytes_per_token) if path is None else HFTokenizer(path)


def to_routing_tokens(engine_tokens: int, engine_prompt: int | None, routing_prompt: int) -> int:
    """Engine-reported tokens converted to routing tokens (by the prompts' length ratio)."""
    if not engine_prompt or engine_prompt <= 0 or engine_prompt == routing_prompt:
        return min(max(engine_tokens, 0), routing_prompt)
    scaled = round(engine_tokens * routing_prompt / engine_prompt)
    return min(max(scaled, 0), routing_prompt)
