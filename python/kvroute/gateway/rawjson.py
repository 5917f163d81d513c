"""A request body forwarded upstream without encoding it again: its top-level fields' JSON text
reused as the client sent it, only the fields the gateway changes encoded anew.

``parse_object(body)`` parses a JSON object as ``json.loads`` does (the same C scanner parses
every value) and also returns, for each top-level key, the span of its value's text — for a key
given twice, the last one's, as ``json.loads`` keeps the last value. It returns None, and the
caller uses ``json.loads`` (whose answer and errors are then the reference), for anything but a
well-formed UTF-8 object without a BOM; and for a text that escapes a UTF-16 surrogate
(``\\ud800``-``\\udfff``), so that a lone one is refused exactly as the re-encoding path refuses it;
and for a text with ``DEEP`` or more opening brackets (``[``, ``{``, in strings too): it parses
the top level itself, so its scanner has more of the recursion budget than ``json.loads``'s and
would take a nesting that ``json.loads`` refuses (the gateway's 400 ``nested_too_deeply``);
below ``DEEP`` brackets the nesting is well inside the default recursion budget.

``RawObject.encode(fields)`` writes the object back: its keys in the order of ``fields`` (a dict
of the parsed object's keys, changed or not, and new ones), a value that is the parsed one (the
same object) as its original text, any other value encoded as ``json.dumps(ensure_ascii=False,
separators=(",", ":"))`` encodes it. The result parses to ``fields``, as the re-encoded body does;
its bytes differ only in whitespace and escapes the client chose (``\\u00e9`` stays escaped). A
text holding a lone surrogate the client sent as raw bytes raises ``UnicodeEncodeError`` when
encoded, as ``json.dumps(...).encode()`` does.
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring
from json.encoder import c_make_encoder, encode_basestring
from typing import Any

__all__ = ["DEEP", "RawObject", "dumps", "parse_object"]

#: Texts with this many opening brackets or more are left to ``json.loads`` (see the module docs).
DEEP = 256

_DECODER = json.JSONDecoder()
_SCAN = json.scanner.make_scanner(_DECODER)  # the C scanner json.loads uses
_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)
# The C encoder _ENCODER.iterencode builds on each call (the same arguments: no circular check,
# str escaping without ensure_ascii, compact separators, unsorted, NaN allowed), built once.
_C_ENCODE = (
    c_make_encoder(None, _ENCODER.default, encode_basestring, None, ":", ",", False, False, True)
    if c_make_encoder is not None
    else None
)


def dumps(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` for values parsed from
    JSON (no cycles: not checked), without building an encoder per call."""
    if _C_ENCODE is not None:
        return "".join(_C_ENCODE(value, 0))
    return "".join(_ENCODER.iterencode(value, _one_shot=True))


class RawObject:
    """A parsed JSON object with its text: ``value`` and each top-level key's value span."""

    __slots__ = ("spans", "text", "value")

    def __init__(self, text: str, value: dict[str, Any], spans: dict[str, tuple[int, int]]):
        self.text = text
        self.value = value
        self.spans = spans

    def encode(self, fields: dict[str, Any]) -> bytes:
        """``fields`` as a JSON object (see the module docs), UTF-8."""
        text, value, spans = self.text, self.value, self.spans
        parts = []
        for key, item in fields.items():
            span = spans.get(key)
            if span is not None and value.get(key) is item:
                parts.append(f"{encode_basestring(key)}:{text[span[0] : span[1]]}")
            else:
                parts.append(f"{encode_basestring(key)}:{dumps(item)}")
        return ("{" + ",".join(parts) + "}").encode()


def parse_object(body: bytes) -> RawObject | None:
    """``body`` parsed with its top-level spans, or None (see the module docs)."""
    if body[:3] == b"\xef\xbb\xbf" or (len(body) >= 2 and (not body[0] or not body[1])):
        return None  # a BOM, or UTF-16/32 (a NUL in the first two bytes): json.loads decides
    try:
        text = body.decode("utf-8", "surrogatepass")
        if _SURROGATE_ESCAPE.search(text) is not None:
            return None
        if len(text) >= DEEP and text.count("[") + text.count("{") >= DEEP:
            return None
        return _parse(text)
    except (ValueError, StopIteration, IndexError, RecursionError):  # incl. UnicodeDecodeError
        return None


def _parse(text: str) -> RawObject | None:
    ws = _WS.match
    blank = " \t\n\r"
    end = ws(text, 0).end()
    if text[end : end + 1] != "{":
        return None
    end = ws(text, end + 1).end()
    value: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    if text[end : end + 1] == "}":
        end += 1
    else:
        while True:  # whitespace is skipped by the regex only where there is some
            if text[end : end + 1] != '"':
                return None
            key, end = scanstring(text, end + 1, True)
            if text[end : end + 1] in blank:
                end = ws(text, end).end()
            if text[end : end + 1] != ":":
                return None
            start = end + 1
            if text[start : start + 1] in blank:
                start = ws(text, start).end()
            item, end = _SCAN(text, start)
            value[key] = item
            spans[key] = (start, end)
            sep = text[end : end + 1]
            if sep in blank:
                end = ws(text, end).end()
                sep = text[end : end + 1]
            end += 1
            if sep == "}":
                break
            if sep != ",":
                return None
            if text[end : end + 1] in blank:
                end = ws(text, end).end()
    if end != len(text) and ws(text, end).end() != len(text):
        return None
    return RawObject(text, value, spans)
