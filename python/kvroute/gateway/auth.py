"""Who may call what: the targets a request's ``model`` can name, and their API keys.

A target is an endpoint (``[[endpoints]] id``: a sticky worker pool, its own keys, its salt) or a
directly served model (``gateway.models``, behind ``gateway.api_keys``). A caller's bearer key is
compared as a SHA-256 digest with ``hmac.compare_digest`` against every key of the target, so
neither timing nor length tells which byte differed; the caller's key is never sent upstream.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .config import GatewayConfig, key_digest
from .errors import HTTPError

__all__ = ["Auth", "Target", "bearer"]


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: an endpoint (with its pool) or a directly served model."""

    name: str
    upstream_model: str
    endpoint: str | None
    key_digests: tuple[bytes, ...]
    salted: bool


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class Auth:
    """The configured targets and the check of a caller's key against them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.targets: dict[str, Target] = {}
        for ep in config.endpoints:
            self.targets[ep.id] = Target(ep.id, ep.model, ep.id, ep.key_digests, ep.cache_salt)
        for model in config.server.models:
            self.targets[model] = Target(model, model, None, config.server.key_digests, False)

    def target(self, model: object) -> Target:
        """The target a request's ``model`` names (404 when none)."""
        target = self.targets.get(model) if isinstance(model, str) else None
        if target is None:
            raise HTTPError(
                404,
                f"the model {model!r} does not exist",
                "invalid_request_error",
                "model_not_found",
            )
        return target

    @staticmethod
    def key_matches(key: str, target: Target) -> bool:
        digest = key_digest(key)
        ok = False
        for expected in target.key_digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, expected)
        return ok

    def authorize(self, key: str | None, target: Target) -> None:
        """Raises 401 (no key) or 403 (a key the target does not accept)."""
        if not target.key_digests:
            return
        if key is None:
            raise HTTPError(
                401,
                "missing API key (Authorization: Bearer ...)",
                "invalid_request_error",
                "missing_api_key",
            )
        if not self.key_matches(key, target):
            raise HTTPError(
                403,
                f"the API key is not valid for model {target.name!r}",
                "invalid_request_error",
                "invalid_api_key",
            )

    def visible(self, key: str | None) -> Iterable[Target]:
        """The targets a caller with ``key`` may use (``GET /v1/models``)."""
        return (
            t
            for t in self.targets.values()
            if not t.key_digests or (key is not None and self.key_matches(key, t))
        )

    def endpoints(self) -> Mapping[str, Target]:
        return {n: t for n, t in self.targets.items() if t.endpoint is not None}
