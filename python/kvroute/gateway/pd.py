"""Prefill/decode pairs: how the gateway serves a request on two workers (``[pd]``).

With a ``[pd]`` section every request is routed as a pair (``Router.route_pd``): a prefill worker
chosen by the KV-aware cost over the workers that prefill, a decode worker by its KV load less the
prompt prefix it holds; a pair that is not disaggregated (a short uncached part, a saturated
prefill side, one worker best for both) is an ordinary request to the decode worker. A
disaggregated pair is handed over as the engines' own proxies do (``protocol``):

- **vLLM** (its KV-connector proxy flow, as ``toy_proxy_server.py`` of vLLM's NIXL tests and the
  disaggregated-serving examples do): the prefill worker gets the request with
  ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false,
  "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port":
  null}``, ``stream = false``, ``max_tokens = 1`` (and ``max_completion_tokens = 1`` when
  given), without ``stream_options``, ``min_tokens`` and ``min_completion_tokens``; its reply's
  ``kv_transfer_params`` (the prefill engine's block ids, engine id, host and port) go with the
  original request to the decode worker, whose answer (streamed or not, as asked) is the
  client's. Both carry the same ``x-request-id``. A reply without ``kv_transfer_params`` (a
  connector that hands the KV over out of band, such as vLLM's shared-storage
  ``ExampleConnector``) sends the decode request without them.
- **SGLang** (its bootstrap flow, as ``sglang.srt.disaggregation.mini_lb`` and SGLang's router
  do): the request goes to the prefill and the decode worker at once, both with the prefill
  worker's ``bootstrap_host`` (its URL's host unless configured; IPv6 in brackets),
  ``bootstrap_port`` (its ``bootstrap_port``, default SGLang's 8998) and a fresh random
  ``bootstrap_room`` (63 bits); the decode worker's answer is the client's, the prefill's is read
  and dropped.

Fields a client sends under these names (``kv_transfer_params``, ``bootstrap_*``) are never
forwarded (``kvroute.gateway.app`` drops them): they would point an engine at another host's KV.

Failures (each looked up in ``kvroute.gateway.errors`` as for single requests, and charged to the
worker that failed): a prefill that fails before the decode has started is retried with another
prefill worker (the pair routed again without it: for SGLang the waiting decode request is
aborted first, and the retry gets a new room); a decode failure before the first event retries
the pair from scratch without that decode worker — vLLM: a new prefill under the same
``x-request-id``, the first prefill's KV (offered, never pulled) held by its engine until the
engine's own timeout frees it; a prefill's 4xx answer is the client's. Every
attempt of either half counts toward ``max_attempts``. The client gets exactly one answer, the
decode worker's; the prefill's one token is never forwarded nor charged to rate limits (which
charge the decode's completion tokens), so nothing is billed twice.

Load: each half is a ``Flight`` (``kvroute.gateway.upstream``) — begun when sent, prefilled at
its first output, finished once; a vLLM prefill half is finished when the decode worker has
answered (it holds the KV until the decode pulls it). Only the prefill half reports its engine's
``cached_tokens`` to the router (the decode worker counts the KV it received as cached), and the
client's usage carries the prefill's ``cached_tokens`` too (``PrefillUsage``). A half
never sent — a pair shed on ``x-slo-ttft-ms``, a vLLM decode whose prefill failed or whose
client left during the prefill — is withdrawn (``Router.withdraw``), so its prompt leaves the
router's model. A client that leaves an SGLang pair before the decode answered cancels both
halves (no decode will take the prefill's KV); once the decode answered, the prefill's reply is
drained in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import secrets
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np
from starlette.responses import Response

from kvroute import Decision, PdDecision
from kvroute.server.config import SGLANG_BOOTSTRAP_PORT, engine_fields
from kvroute.server.metrics import Counter
from kvroute.server.routing import NoWorkerError

from .client import BodyTooLarge, UpstreamError
from .errors import STATUS_5XX, TOO_LARGE, Failed, HTTPError, Outcome, body_failed
from .rawjson import dumps
from .stream import failed_answer
from .upstream import Flight, release
from .usage import cached_tokens, with_cached_tokens

if TYPE_CHECKING:
    from .app import Call, Gateway, UpstreamBody

__all__ = ["PdForwarder", "bootstrap_host"]

log = logging.getLogger("kvroute.gateway")

#: What the vLLM prefill request asks for: compute the prompt, keep its KV for a remote decode.
VLLM_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
#: Fields only the gateway may set upstream (a client's are dropped).
HANDOVER_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


def bootstrap_host(url: str) -> str:
    """The host of a worker URL as SGLang's bootstrap fields name it (IPv6 in brackets)."""
    host = urlsplit(url).hostname or ""
    with contextlib.suppress(ValueError):
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    return host


class PrefillUsage:
    """A pair's prefill usage, once its reply has been read; called with the decode's usage, the
    usage the client is shown: the decode's, with the prefill's ``cached_tokens`` (none when the
    prefill reported none, or — SGLang — its reply was not read yet)."""

    __slots__ = ("usage",)

    def __init__(self) -> None:
        self.usage: Any = None

    def __call__(self, usage: dict[str, Any]) -> dict[str, Any]:
        return with_cached_tokens(usage, cached_tokens(self.usage))


class PdForwarder:
    """Serves requests as prefill/decode pairs for a ``Gateway`` (see the module docs)."""

    def __init__(self, gateway: Gateway) -> None:
        self.g = gateway
        pd = gateway.config.pd
        assert pd is not None
        self.protocol = pd.protocol
        self.bootstrap = {
            w.name: (
                w.bootstrap_host or bootstrap_host(w.url),
                w.bootstrap_port if w.bootstrap_port is not None else SGLANG_BOOTSTRAP_PORT,
            )
            for w in gateway.config.workers
        }
        self.pairs = gateway.metrics.registry.add(
            Counter(
                "kvroute_gateway_pd_pairs_total",
                "Requests routed as prefill/decode pairs, by why their first pair was (remote) or "
                "was not disaggregated (a retried pair is not counted again).",
                ("reason",),
            )
        )
        self.background: set[asyncio.Task[Any]] = set()

    async def stop(self) -> None:
        """Cancels the prefill replies still being drained."""
        for task in list(self.background):
            task.cancel()
        for task in list(self.background):
            with contextlib.suppress(BaseException):
                await task

    # ---- one request ---------------------------------------------------------------------

    def _choose(self, call: Call, tokens: np.ndarray, tried: list[str]) -> PdDecision | HTTPError:
        """The router's pair among the workers neither tried for this request nor full."""
        g = self.g
        assert call.target is not None
        full = g.upstreams.full
        exclude = [*tried, *full] if full else tried
        endpoint = call.target.endpoint
        pair = None
        with contextlib.suppress(NoWorkerError):
            pair = g.router.route_pd(tokens=tokens, endpoint=endpoint, exclude=exclude)
        if endpoint is not None and tried and (pair is None or pair.reason == "no_prefill"):
            # No untried member of the endpoint's pool (of a phase) is left: this request
            # spills over to the router's choice outside it (still salted upstream), as single
            # requests do — a failed prefill moves to another prefill worker.
            with contextlib.suppress(NoWorkerError):
                pair = g.router.route_pd(tokens=tokens, exclude=exclude)
        if pair is None:
            return g._none_left(tried)
        shed = g.admission.check_slo(pair.prefill, call.slo)
        if shed is None:
            return pair
        # Never sent: both halves' prompts leave the router's model.
        for half in (pair.prefill, pair.decode) if pair.disaggregate else (pair.decode,):
            g.router.withdraw(half)
        return g._shed(shed)

    async def _send(
        self, call: Call, pair: PdDecision, prompt: int, upstream: UpstreamBody, stream: bool
    ) -> tuple[Outcome, str]:
        """One attempt of ``Gateway._forward``'s loop for a pair: its outcome and the worker it
        is charged to (the prefill's when the prefill failed or refused, else the decode's)."""
        g = self.g
        if not call.paired:  # a request, not an attempt: counted by its first pair's reason
            call.paired = True
            self.pairs.inc(pair.reason)
        p, d = pair.prefill, pair.decode
        for half in (p, d) if pair.disaggregate else (d,):
            g.metrics.decisions.inc(half.policy, half.reason, half.worker)
        if not pair.disaggregate:
            body = upstream.get(g.workers[d.worker].kind)
            return await g._send_to(call, d, prompt, body, upstream, stream), d.worker
        if self.protocol == "vllm":
            return await self._vllm(call, p, d, prompt, upstream, stream)
        return await self._sglang(call, p, d, prompt, upstream, stream)

    @staticmethod
    def _mark(pair: PdDecision) -> list[tuple[str, str]]:
        """The routing headers of a pair's answer."""
        return [
            ("x-kvroute-worker", pair.decode.worker),
            ("x-kvroute-prefill-worker", pair.prefill.worker),
            ("x-kvroute-cached-tokens", str(pair.prefill.cached_tokens)),
        ]

    # ---- bodies and flights ----------------------------------------------------------------

    def _body(self, upstream: UpstreamBody, worker: str, **fields: Any) -> bytes:
        """The upstream body for ``worker`` with ``fields`` set (and the engine fields its kind
        gets: ``kvroute.server.config.engine_fields``); ``None`` values remove a field."""
        kind = self.g.workers[worker].kind
        body = {**upstream.body, **engine_fields(kind, upstream.salt, upstream.priority)}
        for k, v in fields.items():
            if v is None:
                body.pop(k, None)
            else:
                body[k] = v
        return dumps(body).encode()

    def _refused(self, call: Call, answer: Response) -> Response:
        """A prefill worker's 4xx answer, passed on: the request itself was refused."""
        assert call.target is not None
        answer.headers["x-request-id"] = call.rid
        self.g.metrics.done(call.route, call.target.name, answer.status_code, call.started)
        return answer

    async def _read_prefill(
        self, call: Call, flight: Flight, body: bytes
    ) -> dict[str, Any] | Response | Failed:
        """Sends a prefill request and reads its whole answer: the parsed reply (200), the
        upstream's 4xx answer for the client, or a failure. Marks the flight prefilled when the
        answer arrives and closes it on failure (the caller closes it otherwise)."""
        g = self.g
        resp = await flight.send(call.route, call.upstream_headers, body)
        if isinstance(resp, tuple):
            return resp
        ok = False
        try:
            status = resp.status_code
            try:
                data = await resp.read(g.server.max_response_bytes)
            except BodyTooLarge as e:
                return TOO_LARGE, e, None
            except UpstreamError as e:
                return body_failed(e)
            flight.prefilled()
            answer = failed_answer(status, data, resp.headers)
            if status >= 500 or not 200 <= status <= 599:
                return STATUS_5XX, f"prefill status {status}", answer
            if status != 200:
                return Response(data, status_code=status, headers=answer[2])
            reply = _json_object(data)
            if reply is None:
                return STATUS_5XX, "the prefill's reply is not a JSON object", None
            ok = True
            return reply
        finally:
            with contextlib.suppress(BaseException):
                await resp.aclose()
            if not ok:
                flight.close()

    # ---- vLLM ----------------------------------------------------------------------------------

    async def _vllm(
        self,
        call: Call,
        p: Decision,
        d: Decision,
        prompt: int,
        upstream: UpstreamBody,
        stream: bool,
    ) -> tuple[Outcome, str]:
        g = self.g
        body = self._body(
            upstream,
            p.worker,
            kv_transfer_params=VLLM_PREFILL_PARAMS,
            stream=False,
            max_tokens=1,
            max_completion_tokens=1 if "max_completion_tokens" in upstream.body else None,
            stream_options=None,
            min_tokens=None,
            min_completion_tokens=None,
        )
        prefill = g.upstreams.begin(p, prompt)
        got: dict[str, Any] | Response | Failed | None = None
        try:
            got = await self._read_prefill(call, prefill, body)
        finally:
            if not isinstance(got, dict):  # failed, refused, or the client left meanwhile
                g.router.withdraw(d)  # the decode half was never sent
        if isinstance(got, Response):
            return self._refused(call, got), p.worker
        if isinstance(got, tuple):
            return got, p.worker
        usage = PrefillUsage()
        usage.usage = got.get("usage")
        params = got.get("kv_transfer_params")
        try:
            if not isinstance(params, dict) or not params:
                # Connectors that hand the KV over out of band (vLLM's shared-storage
                # ExampleConnector, as `make e2e` runs it) return none: the decode engine looks
                # the prompt up in its connector itself. Without a connector it computes the
                # prompt; either way the answer is correct, so this is no failure.
                log.debug("prefill on %s returned no kv_transfer_params", p.worker)
                params = None
            body = self._body(upstream, d.worker, kv_transfer_params=params)
            outcome = await g._send_to(call, d, prompt, body, upstream, stream, usage)
        finally:
            prefill.close(usage.usage)
        return outcome, d.worker

    # ---- SGLang --------------------------------------------------------------------------------

    async def _sglang(
        self,
        call: Call,
        p: Decision,
        d: Decision,
        prompt: int,
        upstream: UpstreamBody,
        stream: bool,
    ) -> tuple[Outcome, str]:
        g = self.g
        host, port = self.bootstrap[p.worker]
        fields = {
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": secrets.randbits(63),
        }
        p_body = self._body(upstream, p.worker, **fields)
        d_body = self._body(upstream, d.worker, **fields)
        prefill = g.upstreams.begin(p, prompt)
        usage = PrefillUsage()
        p_task = asyncio.ensure_future(self._drain_prefill(call, prefill, p_body, usage))
        d_task = asyncio.ensure_future(g._send_to(call, d, prompt, d_body, upstream, stream, usage))
        answered = False
        try:
            await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if not d_task.done():
                got = p_task.result()
                if got is not None:
                    # The prefill failed (or refused) before the decode answered: the decode
                    # waits for KV that will not come. Abort it and answer / retry.
                    await _cancel(d_task)
                    if isinstance(got, Response):
                        return self._refused(call, got), p.worker
                    return got, p.worker
            outcome = await d_task
            if isinstance(outcome, Response):
                answered = True
                return outcome, d.worker
            await _cancel(p_task)
            return outcome, d.worker
        finally:
            if not p_task.done():
                if answered:
                    # The decode answered: the prefill's reply is drained in the background.
                    self.background.add(p_task)
                    p_task.add_done_callback(self.background.discard)
                else:
                    await _cancel(p_task)  # the client left: no decode will take its KV
            if not d_task.done():
                await _cancel(d_task)

    async def _drain_prefill(
        self, call: Call, flight: Flight, body: bytes, found: PrefillUsage
    ) -> Response | Failed | None:
        """An SGLang prefill request, read to its end and dropped: None when it succeeded,
        else its 4xx answer or failure. The flight is closed either way. Of a 200 reply only the
        last 64 KiB are kept, where its usage is looked for (``_last_usage``; kept in
        ``found``)."""
        g = self.g
        resp = await flight.send(call.route, call.upstream_headers, body)
        if isinstance(resp, tuple):
            return resp
        usage = None
        try:
            status = resp.status_code
            if status != 200:  # an answer to pass on or charge: read it, as far as it goes
                data = b""
                with contextlib.suppress(UpstreamError, BodyTooLarge):
                    data = await resp.read(g.server.max_response_bytes)
                answer = failed_answer(status, data, resp.headers)
                if status >= 500 or not 200 <= status <= 599:
                    return STATUS_5XX, f"prefill status {status}", answer
                return Response(data, status_code=status, headers=answer[2])
            first = True
            tail = b""
            try:
                async for chunk in resp:
                    if first:
                        first = False
                        flight.prefilled()
                    tail = (tail + chunk)[-65536:]
            except UpstreamError as e:
                return body_failed(e)
            usage = found.usage = _last_usage(tail)
            return None
        finally:
            await release(resp, flight, usage)


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        reply = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return reply if isinstance(reply, dict) else None


def _last_usage(tail: bytes) -> Any:
    """The ``usage`` of a reply's end: a JSON body's, or a stream's last usage chunk."""
    reply = _json_object(tail)
    if reply is not None:
        return reply.get("usage")
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            chunk = _json_object(line[5:])
            if chunk is not None and isinstance(chunk.get("usage"), dict):
                return chunk["usage"]
    return None


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancels ``task`` and waits for it to unwind (its flights close in their ``finally``)."""
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
