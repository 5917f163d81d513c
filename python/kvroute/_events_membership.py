"""``KvEventSubscriber``'s workers joining and leaving while it runs (see ``kvroute.events``):
a change is queued, the poll thread is woken through its stop socket and makes it — the new
worker's sockets opened, or the leaving worker's closed and what it held forgotten — between two
polls, so the other workers' sockets and sequence state are never touched. Without a running poll
thread the caller makes the change itself."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Change", "Membership"]


class Change:
    """A membership change the poll thread makes (``add_worker``, ``remove_worker``): ``worker``
    added, or (None) ``name`` removed; ``done`` once made, ``error`` if it failed."""

    __slots__ = ("done", "error", "name", "worker")

    def __init__(self, name: str, worker: Any) -> None:
        self.name = name
        self.worker = worker
        self.done = threading.Event()
        self.error: BaseException | None = None


class Membership:
    """``add_worker`` / ``remove_worker`` of ``KvEventSubscriber`` (its state and socket helpers:
    ``kvroute.events``)."""

    _accepting: bool
    _changes: list[Change]
    _control: threading.Lock
    _lock: threading.Lock
    _stop_sock: Any
    _workers: dict[str, Any]
    applier: Any
    # and KvEventSubscriber's _open(w), _close(w), _notify(w, stale)

    def add_worker(
        self,
        name: str,
        endpoint: str,
        *,
        replay: str | None = None,
        bind: bool = False,
        timeout: float = 10.0,
    ) -> None:
        """Subscribes to one more engine, before ``start()`` or while running (then the poll
        thread connects — or, ``bind``, binds — its sockets). The other workers keep their
        sockets and sequence state: nothing they publish meanwhile is lost. The new worker's
        numbering is learned from its first message, as at start (with ``replay``, a catch-up
        from 0). Raises ``KeyError`` for a worker subscribed already, the ``zmq.ZMQError`` of a
        socket that cannot be made (the worker is left out), ``TimeoutError`` when the running
        poll thread has not made the change within ``timeout`` seconds (it is stuck in the
        applier; the change is made once it frees)."""
        if not isinstance(name, str) or not isinstance(endpoint, str):
            raise TypeError(f"worker and endpoint must be str, got {name!r}: {endpoint!r}")
        if replay is not None and not isinstance(replay, str):
            raise TypeError(f"replay must be a str or None, got {replay!r}")
        from .events import _Worker

        self._change(Change(name, _Worker(name, endpoint, replay, bool(bind))), timeout)

    def remove_worker(self, name: str, *, timeout: float = 10.0) -> None:
        """Unsubscribes ``name``, before ``start()`` or while running (then the poll thread closes
        its sockets: nothing of it is applied afterwards). Its blocks and counters are forgotten
        (the applier's ``remove_worker``; an event sink's ``clear``) and, if it was waiting for a
        replay, it is marked fresh. The other workers keep their sockets and sequence state.
        Raises ``KeyError`` for a worker not subscribed, ``TimeoutError`` as ``add_worker``."""
        self._change(Change(name, None), timeout)

    def _change(self, change: Change, timeout: float) -> None:
        with self._control:
            if self._accepting:
                self._changes.append(change)
                self._stop_sock.send(b"change")
            else:  # no poll thread takes changes: made here
                self._make(change, live=False)
        if not change.done.wait(timeout):
            raise TimeoutError(
                f"the KV-event poll thread did not make the change of worker {change.name!r} "
                f"within {timeout} s (it is stuck in the applier; the change is made once it "
                "frees)"
            )
        if change.error is not None:
            raise change.error

    def _take_changes(self) -> None:
        """Makes the queued membership changes (the poll thread, polling)."""
        with self._control:
            changes, self._changes = self._changes, []
        for change in changes:
            self._make(change, live=True)

    def _make(self, change: Change, live: bool) -> None:
        try:
            w = change.worker
            if w is None:
                self._remove(change.name)
            else:
                if w.name in self._workers:
                    raise KeyError(f"worker {w.name!r} is subscribed already")
                if live:
                    self._open(w)
                with self._lock:
                    self._workers[w.name] = w
        except BaseException as e:
            change.error = e
        finally:
            change.done.set()

    def _remove(self, name: str) -> None:
        w = self._workers.get(name)
        if w is None:
            raise KeyError(f"worker {name!r} is not subscribed")
        self._close(w)
        with self._lock:
            del self._workers[name]
        remove = getattr(self.applier, "remove_worker", None)
        if callable(remove):
            remove(name)
        else:  # an event sink: what it holds of the worker is cleared
            self.applier.clear(name)
        if w.stale:
            self._notify(w, False)
