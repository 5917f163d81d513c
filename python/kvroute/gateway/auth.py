"""Who may call what: the targets a request's ``model`` can name, and their API keys.

A target is an endpoint (``[[endpoints]] id``: a sticky worker pool, its own keys, its salt) or a
directly served model (``gateway.models``, behind ``gateway.api_keys``). The caller's bearer key is
checked **from the headers, before the body is read**: the key's SHA-256 digest selects the
targets it opens (``Access``), together with the open targets (those without keys). A caller that
can open nothing is answered 401 at once, so an unauthenticated client never makes the gateway
buffer a body.

Answers never reveal which endpoints exist beyond the caller's own: a model the caller may not
use is answered exactly like a model that does not exist — 404 for a caller with a valid key, 401
for one without. Keys are looked up by their SHA-256 digest (a dict of digests: the time taken
depends on the digest of the caller's key, never on a stored key's bytes, and digests cannot be
steered toward a stored one). An ``Authorization`` header already found valid is remembered (at
most ``SEEN_HEADERS`` of them, each of at most ``SEEN_HEADER_CHARS`` characters — a key holder
padding its token differs in every request, and the listener allows 64 KiB headers —; the oldest
half forgotten past that; the keys are fixed for the process's life) so that a caller's next
request skips the digest: a dict keyed by the header, whose hash is Python's keyed SipHash, so
the lookup's time cannot be steered toward a stored header either; an invalid header is never
remembered. The caller's key is never sent upstream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .config import GatewayConfig, key_digest
from .errors import HTTPError

__all__ = ["SEEN_HEADERS", "SEEN_HEADER_CHARS", "Access", "Auth", "Target", "bearer"]

#: Valid ``Authorization`` headers remembered (see the module docs).
SEEN_HEADERS = 4096
#: The longest ``Authorization`` header remembered (longer ones are checked every time).
SEEN_HEADER_CHARS = 1024


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: an endpoint (with its pool) or a directly served model."""

    name: str
    upstream_model: str
    endpoint: str | None
    key_digests: tuple[bytes, ...]
    salted: bool


@dataclass(frozen=True)
class Access:
    """What one caller may use: its key's digest (None without a valid key) and its targets."""

    digest: bytes | None
    targets: dict[str, Target]

    def target(self, model: object) -> Target:
        """The target ``model`` names, or the one answer for unknown and forbidden models."""
        target = self.targets.get(model) if isinstance(model, str) else None
        if target is not None:
            return target
        shown = model if isinstance(model, str) and len(model) <= 256 else "(invalid)"
        if self.digest is None:
            raise HTTPError(
                401,
                f"missing or invalid API key for model {shown!r} (Authorization: Bearer ...)",
                "invalid_request_error",
                "invalid_api_key",
            )
        raise HTTPError(
            404,
            f"the model {shown!r} does not exist or you do not have access to it",
            "invalid_request_error",
            "model_not_found",
        )


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Auth:
    """The configured targets, and what each key opens."""

    def __init__(self, config: GatewayConfig) -> None:
        self.targets: dict[str, Target] = {}
        for ep in config.endpoints:
            self.targets[ep.id] = Target(ep.id, ep.model, ep.id, ep.key_digests, ep.cache_salt)
        for model in config.server.models:
            self.targets[model] = Target(model, model, None, config.server.key_digests, False)
        self.open = {n: t for n, t in self.targets.items() if not t.key_digests}
        self._anonymous = Access(None, self.open)
        by_digest: dict[bytes, dict[str, Target]] = {}
        for name, t in self.targets.items():
            for digest in t.key_digests:
                by_digest.setdefault(digest, dict(self.open))[name] = t
        self._by_digest = {d: Access(d, targets) for d, targets in by_digest.items()}
        self._seen: dict[str, Access] = {}  # valid Authorization headers (see the module docs)
        self.admin = frozenset(config.server.admin_key_digests)

    def access(self, authorization: str | None) -> Access:
        """What the caller with this ``Authorization`` header may use; 401 when nothing."""
        if authorization:
            seen = self._seen.get(authorization)
            if seen is not None:
                return seen
        key = bearer(authorization)
        access = self._by_digest.get(key_digest(key)) if key is not None else None
        if access is not None:
            if len(authorization) > SEEN_HEADER_CHARS:  # type: ignore[arg-type]
                return access
            seen_headers = self._seen
            if len(seen_headers) >= SEEN_HEADERS:
                for old in list(seen_headers)[: SEEN_HEADERS // 2]:
                    del seen_headers[old]
            seen_headers[authorization] = access  # type: ignore[index]
            return access
        if not self.open:
            raise HTTPError(
                401,
                "missing or invalid API key (Authorization: Bearer ...)",
                "invalid_request_error",
                "invalid_api_key",
            )
        return self._anonymous

    def is_admin(self, authorization: str | None) -> bool:
        key = bearer(authorization)
        return key is not None and key_digest(key) in self.admin

    def visible(self, authorization: str | None) -> Iterable[Target]:
        """The targets a caller may use (``GET /v1/models``)."""
        key = bearer(authorization)
        access = self._by_digest.get(key_digest(key)) if key is not None else None
        return (access or self._anonymous).targets.values()
