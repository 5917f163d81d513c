"""The NATS side every cluster component shares: one way to connect and to declare a stream."""

from __future__ import annotations

import asyncio
from typing import Any

from .config import ClusterConfig

__all__ = ["connect", "ensure_stream"]


async def connect(config: ClusterConfig, name: str, error_cb: Any = None) -> Any:
    """A NATS connection that does not reconnect by itself: the caller's loop reconnects and
    resumes from its own stream sequence (so no message is applied twice or skipped)."""
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
        ),
        config.connect_timeout * (len(config.nats) + 1),
    )


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
