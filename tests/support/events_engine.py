"""A KV-event publisher over real ZMQ sockets on 127.0.0.1, as vLLM's ``ZmqEventPublisher`` is.

Frames ``[topic, seq (8-byte big-endian), payload]``, sequence numbers from 0, and a replay ROUTER
that answers ``[b"", start]`` with every buffered batch from ``start`` and an end marker, in the
>= 0.28 form with a topic frame or the <= 0.24 form without (KV_EVENTS_SPEC.md section 1). The
publisher is an XPUB socket (wire-compatible with PUB) only so that a test can wait until the
subscriber has joined.

The replay ROUTER is served by a thread (``answer_replays=True``) or, for replays a test must
time or falsify — answered before the live stream delivers the same batches, never finished,
repeating old numbers, claiming numbers the engine never reached — by the test itself:
``take_replay_request()`` then ``answer(...)`` from the test's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import zmq
from kvroute import BlockHasher
from kvroute.events import END_SEQ

from support import events_payloads as P


def own(tokens: Sequence[int], block_size: int = 16, **opts) -> list[int]:
    """The router's own (native) block hashes of ``tokens``: what rehash mode indexes."""
    return [int(h) for h in BlockHasher(block_size, **opts).hash(list(tokens))]


def stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int]) -> bytes:
    """One batch with one BlockStored event of 16-token blocks."""
    return P.batch([P.map16(P.stored_fields(hashes, parent, tokens, 16))])


def chain_payloads(tokens: Sequence[int], n_blocks: int, first: int = 0) -> list[bytes]:
    """One BlockStored per block, engine hash i+1 for block i chained on block i-1 (any engine
    algorithm): a batch whose parent was lost is skipped by the applier."""
    out = []
    for i in range(first, first + n_blocks):
        parent = None if i == 0 else i
        out.append(stored([i + 1], parent, tokens[16 * i : 16 * i + 16]))
    return out


class Engine:
    """A KV-event publisher with an optional replay ROUTER, like vLLM's."""

    def __init__(
        self,
        topic="",
        replay=True,
        new_replay_form=True,
        answer_replays=True,
        host="127.0.0.1",
        port=None,
    ):
        """``host``/``port``: where the live stream binds (a random port by default)."""
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber, not only the first
        if port is None:
            port = self.pub.bind_to_random_port(f"tcp://{host}")
        else:
            self.pub.bind(f"tcp://{host}:{port}")
        self.endpoint = f"tcp://{host}:{port}"
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.new_replay_form = new_replay_form
        self.replay_requests: list[list[bytes]] = []
        self.router = None
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._thread = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            if answer_replays:
                self._thread = threading.Thread(target=self._serve, daemon=True)
                self._thread.start()

    def wait_subscriber(self) -> None:
        while True:  # skip unsubscriptions (a subscriber that stopped)
            assert self.pub.poll(10_000), "no subscriber joined"
            if self.pub.recv()[:1] == b"\x01":
                return

    def subscriptions(self) -> list[bytes]:
        """The (un)subscription messages received since the last call, without waiting: a
        subscriber that left (``\\x00`` + topic) or joined (``\\x01`` + topic)."""
        out = []
        while self.pub.poll(0):
            out.append(self.pub.recv())
        return out

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Numbers and buffers a batch; ``send=False``: lost on the way (ZMQ dropped it), or not
        sent yet (``send_buffered``)."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if send:
            self.send_buffered(seq)
        return seq

    def send_buffered(self, seq: int) -> None:
        """Sends buffered batch ``seq`` on the live stream (late, after a replay gave it)."""
        payload = dict(self.buffer)[seq]
        self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        """A new engine process: numbering from 0, an empty replay buffer."""
        self.seq = 0
        self.buffer = []

    def send_raw(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    # ---- the replay ROUTER ----------------------------------------------------------------

    def take_replay_request(self) -> tuple[bytes, int]:
        """Waits for a replay request (manual mode): ``(identity, start)``."""
        assert self.router.poll(20_000), "no replay request"
        frames = self.router.recv_multipart()
        self.replay_requests.append(frames)
        assert len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8, frames
        return frames[0], int.from_bytes(frames[2], "big")

    def answer(
        self, identity: bytes, batches: Iterable[tuple[int, bytes]], *, end: bool = True
    ) -> None:
        """Sends ``(seq, payload)`` replies to one request, then (``end``) the end marker."""
        for seq, payload in batches:
            body = [seq.to_bytes(8, "big"), payload]
            if self.new_replay_form:
                body = [self.topic, *body]
            self.router.send_multipart([identity, b"", *body])
        if end:
            marker = [END_SEQ, b""]
            if self.new_replay_form:
                marker = [b"", *marker]
            self.router.send_multipart([identity, b"", *marker])

    def buffered_from(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, payload) for seq, payload in self.buffer if seq >= start]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            self.replay_requests.append(frames)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.answer(identity, self.buffered_from(start))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.term()
