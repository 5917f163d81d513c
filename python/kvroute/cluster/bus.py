"""The NATS side every cluster component shares: connecting (and reconnecting), declaring a
stream, and consuming one in order."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from kvroute.server.metrics import Counter
from kvroute.server.tasks import cancel_tasks

from .config import ClusterConfig

__all__ = ["StreamConsumer", "cancel", "connect", "ensure_stream", "keep_connected", "unsubscribe"]

log = logging.getLogger("kvroute.cluster")


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancels ``task`` and waits for its end (:func:`~kvroute.server.tasks.cancel_tasks`),
    whatever it ended with: the caller is stopping and has nothing left to do with an error."""
    with contextlib.suppress(Exception):
        await cancel_tasks(task)


async def connect(
    config: ClusterConfig, name: str, error_cb: Any = None, *, no_echo: bool = False
) -> Any:
    """A NATS connection that does not reconnect by itself: the caller's loop reconnects and
    resumes from its own stream sequence (so no message is applied twice or skipped). With
    ``no_echo`` the server does not deliver the connection's own messages back to it."""
    import nats

    async def ignore(e: Exception) -> None:
        pass

    return await asyncio.wait_for(
        nats.connect(
            servers=list(config.nats),
            name=name,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=config.connect_timeout,
            error_cb=error_cb or ignore,
            no_echo=no_echo,
        ),
        config.connect_timeout * (len(config.nats) + 1),
    )


async def unsubscribe(nc: Any, sub: Any) -> None:
    """Ends a JetStream subscription while ``nc`` is still connected: nats-py cancels an ordered
    consumer's heartbeat and flow-control tasks only there (on a lost connection they end when
    they next wake). Failures are ignored: the caller is closing."""
    if sub is not None and nc.is_connected:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sub.unsubscribe(), 1.0)


async def ensure_stream(js: Any, stream: str, subject: str, config: ClusterConfig) -> None:
    """Creates the file-backed stream ``stream`` on ``subject`` (kept ``max_age`` seconds, with a
    duplicate window for re-sent messages), or uses it as it is if another process made it."""
    from nats.js import api

    try:
        await js.add_stream(
            api.StreamConfig(
                name=stream,
                subjects=[subject],
                max_age=config.max_age,
                storage=api.StorageType.FILE,
                duplicate_window=min(120.0, config.max_age),
            )
        )
    except Exception:
        await js.stream_info(stream)


async def keep_connected(
    config: ClusterConfig,
    name: str,
    session: Callable[[Any], Awaitable[None]],
    *,
    failed: Callable[[BaseException], None],
    closed: Callable[[], None],
    no_echo: bool = False,
) -> None:
    """Connects (``no_echo``: see :func:`connect`) and runs ``session(connection)`` until the
    connection is lost or anything in it fails (``failed(error)``); then ``closed()``, closes
    the connection, waits (50 ms, doubling to 2 s, reset by every connection made) and starts
    again. Returns only when cancelled."""
    backoff = 0.05
    while True:
        nc = None
        try:
            nc = await connect(config, name, no_echo=no_echo)
            backoff = 0.05
            await session(nc)
            raise ConnectionError("NATS connection lost")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            failed(e)
        finally:
            closed()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 1.0)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 2.0)


class StreamConsumer:
    """Takes one stream's messages once each, in stream order: a message at or below the last
    stream sequence handled (redelivered after a reconnect) is dropped and counted as a
    ``duplicate`` in ``skipped``; the others go to ``apply(headers, data)``.

    A consumer resumes after the last sequence it handled (:meth:`resume_from`) — unless the
    stream is not the one it consumed: made anew (NATS restarted without its store, the stream
    deleted) or ending before that sequence. It then starts from the new stream's beginning, so
    that nothing published there is taken for a duplicate (counted as a ``stream_reset``)."""

    stream_seq: int
    skipped: Counter
    #: The creation time of the stream instance consumed (``None`` before the first connection).
    stream_created: str | None = None

    async def resume_from(self, js: Any, stream: str) -> int:
        """The stream sequence to consume ``stream`` from (see the class docs)."""
        info = await js.stream_info(stream)
        created, last = info.created, info.state.last_seq
        known = self.stream_created
        if self.stream_seq and ((known is not None and created != known) or last < self.stream_seq):
            log.warning(
                "cluster: stream %s is not the one consumed up to sequence %d (created %s, was "
                "%s; its last sequence %d): consuming it from its start",
                stream,
                self.stream_seq,
                created,
                known,
                last,
            )
            self.skipped.inc("stream_reset")
            self.stream_seq = 0
            self.on_stream_reset()
        self.stream_created = created
        return self.stream_seq + 1

    def on_stream_reset(self) -> None:
        """Called when the stream consumed was made anew (before consuming the new one)."""

    async def _on_msg(self, msg: Any) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.stream_seq:
            self.skipped.inc("duplicate")
            return
        self.stream_seq = seq
        self.apply(msg.headers or {}, msg.data)

    def apply(self, headers: Mapping[str, str], data: bytes) -> None:
        raise NotImplementedError
