"""The public listener's HTTP/1.1 (``gateway.listener.GuardedHTTP``) on the wire, with h11 — an
independent HTTP/1.1 implementation — as the client that reads every answer: framing
(content-length, chunked, HEAD, 204), keep-alive and ``connection: close``, HTTP/1.0, pipelined
requests answered in order, ``Expect: 100-continue``, request bodies in many pieces, an app that
fails (500, or the connection closed once its head is out), header bytes HTTP forbids, invalid
HTTP (400), and the ``kvroute`` extension (``respond``, ``watch``). The gateway's own behaviour
through this listener is tests/test_gateway*.py's.
"""

from __future__ import annotations

import asyncio
import socket
import time

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvroute.gateway.listener import ConnectionGuard, uvicorn_config
from kvroute.gateway.stream import WholeResponse
from starlette.responses import Response
from support.gateway_fleet import wait_for
from support.gateway_upstream import ServerThread

GONE: list[str] = []


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/early":  # answered before the body is read (as a 401 or a 413 is)
        head = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 401, "headers": head})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if path == "/echo":  # content-length
        head = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": body})
    elif path == "/chunks":  # no content-length: chunked
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"a", b"", b"bc"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"d"})
    elif path == "/empty":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/close":
        head = [(b"connection", b"close"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/fail":
        raise RuntimeError("the app failed")
    elif path == "/fail-late":
        head = [(b"content-length", b"10")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b"12345", "more_body": True})
        raise RuntimeError("the app failed mid-body")
    elif path == "/silent":
        return
    elif path == "/inject":
        head = [(b"x-a", b"1\r\nx-injected: yes")]
        await send({"type": "http.response.start", "status": 200, "headers": head})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/respond":
        cycle = scope["extensions"]["kvroute"]
        cycle.respond(201, [(b"content-length", b"5")], b"whole")
    elif path == "/watch":
        cycle = scope["extensions"]["kvroute"]
        gone = asyncio.Event()
        cycle.watch(gone.set)
        try:
            await asyncio.wait_for(gone.wait(), 10)
            GONE.append("gone")
        finally:
            cycle.watch(None)
    else:
        head = [(b"content-length", b"0")]
        await send({"type": "http.response.start", "status": 404, "headers": head})
        await send({"type": "http.response.body", "body": b""})


def serve(asgi, header_timeout: float, keep_alive_timeout: float) -> ServerThread:
    """``asgi`` behind the listener on 127.0.0.1 (``.guard`` its connection guard)."""
    guard = ConnectionGuard(
        header_timeout=header_timeout,
        keep_alive_timeout=keep_alive_timeout,
        write_timeout=60.0,
        max_connections=64,
    )
    s = ServerThread(asgi, config=uvicorn_config(asgi, guard, log_level="critical", lifespan="off"))
    s.guard = guard
    return s


@pytest.fixture(scope="module")
def server():
    s = serve(app, header_timeout=5.0, keep_alive_timeout=5.0)
    yield s
    s.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def request(method: str, path: str, body: bytes = b"", **headers: str) -> h11.Request:
    fields = [("host", "x"), *((k.replace("_", "-"), v) for k, v in headers.items())]
    if body and "content_length" not in headers and "transfer_encoding" not in headers:
        fields.append(("content-length", str(len(body))))
    return h11.Request(method=method, target=path, headers=fields)


def read_responses(s: socket.socket, client: h11.Connection, n: int, method: str = "GET"):
    """The next ``n`` answers as (status, headers, body), read by h11."""
    out = []
    for _ in range(n):
        status, headers, body = None, None, b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(s.recv(65536))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                status, headers = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError("closed before the answer was complete")
        out.append((status, headers, body))
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return out


def exchange(server, *calls: tuple[str, str, bytes]) -> list:
    """Each call on one kept-alive connection, one after the other."""
    client = h11.Connection(h11.CLIENT)
    with connect(server) as s:
        out = []
        for method, path, body in calls:
            s.sendall(client.send(request(method, path, body)))
            if body:
                s.sendall(client.send(h11.Data(data=body)))
            s.sendall(client.send(h11.EndOfMessage()))
            out += read_responses(s, client, 1)
        return out


def read_until_closed(s: socket.socket, timeout: float = 5.0) -> bytes:
    s.settimeout(timeout)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not data:
            break
        out += data
    return out


def test_framing_on_one_kept_alive_connection(server):
    answers = exchange(
        server,
        ("POST", "/echo", b"hello"),
        ("GET", "/chunks", b""),
        ("GET", "/empty", b""),
        ("HEAD", "/echo", b""),
        ("POST", "/respond", b""),
        ("GET", "/nowhere", b""),
    )
    assert [(status, body) for status, _, body in answers] == [
        (200, b"hello"),
        (200, b"abcd"),
        (204, b""),
        (200, b""),
        (201, b"whole"),
        (404, b""),
    ]
    assert answers[1][1][b"transfer-encoding"] == b"chunked"
    assert b"date" in answers[0][1]


def test_pipelined_requests_are_answered_in_order(server):
    bodies = [b"one", b"two" * 30000, b"three"]  # the second past the high-water mark
    wire = b"".join(
        b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(b), b)
        for b in bodies
    )
    with connect(server) as s:
        s.sendall(wire)
        reader = h11.Connection(h11.CLIENT)
        got = []
        for body in bodies:
            reader.send(request("POST", "/echo", body))
            reader.send(h11.Data(data=body))
            reader.send(h11.EndOfMessage())
            got += read_responses(s, reader, 1)
    assert [b for _, _, b in got] == bodies


def test_a_body_in_many_pieces_and_expect_100_continue(server):
    with connect(server) as s:
        body = b"x" * 200_000  # past the listener's high-water mark: reading pauses, resumes
        s.sendall(
            b"POST /echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(body)
        )
        s.settimeout(5)
        assert s.recv(64).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        for i in range(0, len(body), 7000):
            s.sendall(body[i : i + 7000])
        client = h11.Connection(h11.CLIENT)
        client.send(request("POST", "/echo", body))
        client.send(h11.Data(data=body))
        client.send(h11.EndOfMessage())
        [(status, _, echoed)] = read_responses(s, client, 1)
    assert status == 200 and echoed == body


def test_an_answer_before_an_expected_body_is_read_closes_the_connection(server):
    # The client waits for 100 Continue before sending its body; the app answers first. Kept
    # alive, the body the client may or may not send next would be read as the next request's
    # bytes (or the next request as this one's body): the answer says close, and closes.
    with connect(server) as s:
        s.sendall(
            b"POST /early HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 10\r\n\r\n"
        )
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    assert b"100 Continue" not in answer and b"connection: close\r\n" in answer
    # Without the expectation the body follows the head: read and dropped, the connection stays.
    [(early, early_headers, _), echoed] = exchange(
        server, ("POST", "/early", b"0123456789"), ("POST", "/echo", b"0123456789")
    )
    assert early == 401 and b"connection" not in early_headers
    assert echoed[::2] == (200, b"0123456789")


def test_connection_close_and_http_1_0_close_after_the_answer(server):
    for wire in (
        b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        b"GET /echo HTTP/1.0\r\n\r\n",
        b"GET /close HTTP/1.1\r\nhost: x\r\n\r\n",
    ):
        with connect(server) as s:
            s.sendall(wire)
            answer = read_until_closed(s)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"connection: close\r\n" in answer


@pytest.mark.parametrize(
    "path,expected",
    [
        ("/fail", b"HTTP/1.1 500 Internal Server Error\r\n"),
        ("/silent", b"HTTP/1.1 500 Internal Server Error\r\n"),
        ("/inject", b"HTTP/1.1 500 Internal Server Error\r\n"),
        ("/fail-late", b"HTTP/1.1 200 OK\r\n"),
    ],
)
def test_an_app_that_fails_gets_500_or_its_connection_closed(server, path, expected):
    with connect(server) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        answer = read_until_closed(s)  # closed by the server either way
    assert answer.startswith(expected), answer
    assert b"x-injected" not in answer
    if path == "/fail-late":
        assert answer.endswith(b"12345")  # 5 of the 10 promised bytes, then the close


def test_invalid_http_is_answered_400_and_closed(server):
    with connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: -1\r\n\r\n")
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_watch_is_called_when_the_client_goes(server):
    GONE.clear()
    s = connect(server)
    s.sendall(b"GET /watch HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for(lambda: len(server.guard.open) >= 1, "the connection open")
    time.sleep(0.2)
    s.close()
    wait_for(lambda: GONE == ["gone"], "watch's callback")
    wait_for(lambda: not server.guard.open, "the connection forgotten by the guard")


async def slow_app(scope, receive, send):
    """Answers ``/slow`` after 1 s (a request in progress while the next one's head arrives)."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    head = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def strict_server():
    """Header deadline 0.3 s, idle deadline 30 s: a head held past 0.3 s must be refused."""
    s = serve(slow_app, header_timeout=0.3, keep_alive_timeout=30.0)
    yield s
    s.stop()


def test_a_pipelined_head_has_the_header_deadline_of_a_first_request(strict_server):
    """While ``/slow`` is served, the next request's head starts and never ends: its deadline
    runs from its first byte, as a first request's does — ``/slow`` is answered, then 408 and
    the close (not the 30 s idle deadline, nor no deadline at all)."""
    with connect(strict_server) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.1)
        s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: ")  # never finished
        answer = read_until_closed(s, timeout=5.0)
    first, _, rest = answer.partition(b"\r\n\r\nok")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert rest.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
    assert strict_server.guard.timed_out >= 1


def test_a_pipelined_head_has_the_header_size_cap_of_a_first_request(strict_server):
    """A head over ``MAX_HEADER_BYTES`` sent while ``/slow`` is served is refused 431 after
    ``/slow``'s answer, and the connection closed: its bytes are not gathered without bound."""
    with connect(strict_server) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n")
        time.sleep(0.1)
        try:
            s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n")
            for i in range(12):  # 12 x 8 KiB header lines, each its own read
                s.sendall(b"x-pad-%d: %s\r\n" % (i, b"p" * 8192))
                time.sleep(0.01)
            s.sendall(b"\r\n")
        except OSError:  # closed by the server already
            pass
        answer = read_until_closed(s, timeout=5.0)
    first, _, rest = answer.partition(b"\r\n\r\nok")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert rest.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"), answer


def test_watch_is_called_when_the_client_goes_with_a_request_pipelined(server):
    """A request pipelined behind one in progress does not stop the listener from seeing the
    client go: the one in progress learns of it (the gateway cancels its upstream then)."""
    GONE.clear()
    s = connect(server)
    s.sendall(b"GET /watch HTTP/1.1\r\nhost: x\r\n\r\n")
    wait_for(lambda: len(server.guard.open) >= 1, "the connection open")
    time.sleep(0.2)  # /watch has read its body and waits
    s.sendall(b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n")
    time.sleep(0.2)
    s.close()
    wait_for(lambda: GONE == ["gone"], "watch's callback", timeout=5.0)
    wait_for(lambda: not server.guard.open, "the connection forgotten by the guard")


def test_invalid_http_after_a_request_in_progress_is_answered_after_it(strict_server):
    """Bytes that are not HTTP after a request in progress are answered 400 after that
    request's answer (the client reads answers in order: an early 400 would be read as the
    answer to ``/slow``)."""
    with connect(strict_server) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
        answer = read_until_closed(s, timeout=5.0)
    first, _, rest = answer.partition(b"\r\n\r\nok")
    assert first.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert rest.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer


def test_a_broken_body_of_the_request_in_progress_is_its_400(server):
    with connect(server) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer


def test_a_head_held_behind_a_waiting_request_is_not_timed_out(strict_server):
    """The third of three pipelined requests arrives in two reads, its second half while the
    second request waits for its turn (its bytes held unparsed): it was sent within the header
    deadline, and is answered, not refused 408 for the time the two before it took."""
    with connect(strict_server) as s:
        s.sendall(
            b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\nGET /slow HTTP/1.1\r\nhost: x\r\n\r\n"
            b"GET /echo HTTP/1.1\r\n"
        )
        time.sleep(0.1)
        s.sendall(b"host: x\r\nconnection: close\r\n\r\n")
        answer = read_until_closed(s, timeout=5.0)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 3, answer
    assert b" 408 " not in answer


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=64),
    status=st.integers(100, 599),
    headers=st.dictionaries(
        st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).filter(
            lambda n: n != "content-length"
        ),
        st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=20),
        max_size=4,
    ),
)
def test_whole_response_has_the_headers_starlette_gives(body, status, headers):
    """The gateway's reply response (``WholeResponse``, which the listener sends whole) carries
    exactly what starlette's ``Response`` would: the reference is starlette itself."""
    ours = WholeResponse(body, status, headers)
    reference = Response(body, status_code=status, headers=headers)
    assert ours.raw_headers == reference.raw_headers
    assert (ours.body, ours.status_code, ours.background) == (body, status, None)
