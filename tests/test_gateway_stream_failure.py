"""How a stream's first events tell an engine's failure from an answer (``stream.first_failure``)
and what of a failed answer is kept to pass on (``failed_answer``, ``forwarded_headers``), against
a reference written from the module docs — not from the code — over every status class boundary
(``code`` 399 to 600, non-integers, booleans), each error shape engines send, and the SSE
spellings of a ``data`` field (with or without its space, ``\\r\\n`` lines, several data lines,
comments and other fields first).

The end-to-end behaviour (retried, charged, answered) is ``test_gateway_failover.py``'s; this is
the classification itself, where a boundary off by one shows only for one code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re

import pytest
from kvroute.gateway.errors import EMPTY_STREAM, STREAM_ERROR
from kvroute.gateway.stream import (
    SseScanner,
    failed_answer,
    first_events,
    first_failure,
    forwarded_headers,
)

CODES = [None, 0, 200, 399, 400, 401, 404, 422, 429, 498, 499, 500, 501, 503, 598, 599, 600, 700]
ODD_CODES = [True, False, 500.0, 404.0, "500", "overloaded", [500], {"code": 500}]


def reference(events: list[bytes]):
    """The docs of ``first_failure``, read literally: the first event with data decides."""
    if not events:
        return EMPTY_STREAM, "no event before the end", None
    for event in events:
        lines = event.replace(b"\r\n", b"\n").split(b"\n")
        data_lines = []
        for line in lines:
            if line.startswith(b"data:"):
                value = line[len(b"data:") :]
                data_lines.append(value[1:] if value.startswith(b" ") else value)
        if not data_lines:
            continue
        data = b"\n".join(data_lines)
        try:
            payload = json.loads(data)
        except (ValueError, RecursionError):  # not JSON, or deeper than Python parses
            return None
        if not isinstance(payload, dict):
            return None
        if isinstance(payload.get("error"), dict):
            code = payload["error"].get("code")
        elif payload.get("object") == "error":
            code = payload.get("code")
        else:
            return None
        is_int = isinstance(code, int) and not isinstance(code, bool)
        if is_int and 400 <= code < 500:
            return None  # the request's own error: passed through
        status = code if is_int and 500 <= code < 600 else 502
        return (
            STREAM_ERROR,
            f"error event, code {code!r}",
            (
                status,
                data,
                {"content-type": "application/json"},
            ),
        )
    return None


def shapes(code) -> list[dict]:
    """Each error shape an engine sends, with ``code`` (left out when None)."""
    field = {} if code is None else {"code": code}
    return [
        {"error": {"message": "m", "type": "t", "param": None, **field}},  # vLLM >= 0.10, SGLang
        {"error": {"object": "error", "message": "m", **field}},  # older vLLM, wrapped
        {"object": "error", "message": "m", "type": "t", **field},  # a bare ErrorResponse
        {"object": "chat.completion.chunk", "error": "a string", **field},  # not an error
        {"object": "not-an-error", **field},
    ]


@pytest.mark.parametrize("code", CODES + ODD_CODES, ids=repr)
def test_every_error_shape_and_code_is_classified_as_the_docs_say(code):
    for shape in shapes(code):
        data = json.dumps(shape).encode()
        for first in ([b"data: " + data + b"\n\n"], [b": ping\n\n", b"data:" + data + b"\r\n\r\n"]):
            expected = reference(first)
            assert first_failure(first) == expected, (shape, first)
            if expected is not None:  # the answer kept: exactly the event's data, as JSON
                assert expected[2][1] == data


def test_the_first_event_with_data_decides_whatever_its_spelling():
    error = json.dumps({"error": {"message": "m", "code": 503}}).encode()
    chunk = json.dumps({"id": "c", "choices": [{"delta": {"content": '"error"'}}]}).encode()
    half = len(error) // 2
    events = [
        b"data: " + error + b"\n\n",
        b"data:" + error + b"\n\n",
        b"data: " + error + b"\r\n\r\n",
        b"event: message\nid: 1\ndata: " + error + b"\n\n",  # other fields first
        b"retry: 100\n\n",  # no data: the next event decides
        b": comment\n\n",
        b"data: " + error[:half] + b"\ndata: " + error[half:] + b"\n\n",  # two data lines
        b"data: " + chunk + b"\n\n",  # output: not a failure
        b"data: [DONE]\n\n",
        b'data: {"error": \n\n',  # not JSON
        b'data: ["error"]\n\n',  # JSON, not an object
        b'data: "error"\n\n',
        b"data: " + b"[" * 5000 + b'"error"' + b"]" * 5000 + b"\n\n",  # nested past recursion
    ]
    for first in itertools.chain(
        ([e] for e in events), itertools.permutations(events[3:8], 2), [events[4:6]]
    ):
        assert first_failure(list(first)) == reference(list(first)), first
    assert first_failure([]) == (EMPTY_STREAM, "no event before the end", None)


def test_a_failed_answer_keeps_only_the_forwarded_headers_json_by_default():
    """``failed_answer``: the status and body as given; of the headers, the body's type,
    encoding and caching, ``retry-after`` / ``retry-after-ms`` and every ``x-ratelimit-*``
    (README, "What reaches the caller"), the type JSON when the upstream named none."""
    forwarded = {
        "content-type": "text/plain",
        "content-encoding": "gzip",
        "cache-control": "no-store",
        "retry-after": "3",
        "retry-after-ms": "3000",
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-requests": "1s",
    }
    dropped = {
        "x-request-id": "upstream-id",
        "server": "uvicorn",
        "set-cookie": "a=b",
        "content-length": "5",
        "x-ratelimit": "no suffix",
        "retry-after-s": "3",
        "x-kvroute-worker": "w",
        "date": "today",
    }
    for n in range(len(forwarded) + 1):
        for kept in itertools.combinations(sorted(forwarded), n):
            headers = {**dropped, **{k: forwarded[k] for k in kept}}
            expected = {k: forwarded[k] for k in kept}
            assert forwarded_headers(headers) == expected
            want = {"content-type": "application/json", **expected}
            assert failed_answer(503, b"body", headers) == (503, b"body", want)
    assert failed_answer(599, b"", {}) == (599, b"", {"content-type": "application/json"})


def test_the_first_events_are_read_to_the_first_whole_one_the_first_byte_told_once():
    """``first_events`` reads chunks until one completes an event and returns every complete
    event read so far (the rest left to read, the partial event in the scanner), or [] when the
    stream ends first; ``on_first_byte`` — the upstream's first output — is called once, when the
    first chunk arrives, before it is scanned, and never for a stream without a byte. Against a
    reference that splits the bytes read on blank lines, for every split of a stream into two
    chunks and for byte-by-byte arrival."""
    stream = b': ping\r\n\r\ndata: {"a": 1}\n\ndata: [DONE]\n\n'

    def reference(chunks: list[bytes]) -> tuple[list[bytes], int]:
        """The complete events in the shortest prefix of chunks holding one; chunks read."""
        for used in range(1, len(chunks) + 1):
            got = b"".join(chunks[:used])
            ends = [m.end() for m in re.finditer(rb"\r?\n\r?\n", got)]
            if ends:
                return [got[a:b] for a, b in zip([0, *ends], ends, strict=False)], used
        return [], len(chunks)

    async def run(chunks: list[bytes]) -> tuple[list[bytes], int, list[int], SseScanner]:
        scanner = SseScanner(1 << 20)
        read = 0
        told: list[int] = []  # bytes the scanner had seen at each call

        async def source():
            nonlocal read
            for chunk in chunks:
                read += 1
                yield chunk

        events = await first_events(source(), scanner, lambda: told.append(scanner.scanned))
        return events, read, told, scanner

    cases = [[stream[:i], stream[i:]] for i in range(1, len(stream))]
    cases += [[stream[i : i + 1] for i in range(len(stream))], [stream], [], [b"data: x"]]
    for chunks in cases:
        events, read, told, scanner = asyncio.run(run(chunks))
        expected, used = reference(chunks)
        assert (events, read) == (expected, used), chunks
        assert told == ([0] if chunks else []), chunks
        assert scanner.pending == b"".join(chunks[:used])[sum(map(len, events)) :]
