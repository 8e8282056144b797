"""API keys, tenants and the admin key.

With no API key configured the router is open and every request belongs to
``config.tenant`` ("default"). With keys configured, every client request (generation,
``/v1/models``, ``/stats``) needs ``Authorization: Bearer <key>`` (or Anthropic's
``x-api-key: <key>``); the key's tenant scopes the
conversation ids of that request (``ConversationKey(tenant, id)``), so one tenant can never
address, probe or consume another tenant's entries.

Keys are given as ``TENANT:SECRET`` (split at the first ``:``) or a bare ``SECRET``, which
belongs to ``config.tenant``; in TOML also as a ``[tenants]`` table (``name = "secret"`` or
``name = ["secret", ...]``). Secrets are compared in constant time (``hmac.compare_digest`` on
SHA-256 digests, every configured key checked), never logged and hidden from ``repr``.

The admin key (``admin_key``) unlocks the ``/admin/*`` endpoints and an unfiltered ``/stats``;
without one the admin endpoints do not exist (404). The metrics key (``metrics_key``), or the
admin key, is what a Prometheus scrape of the public listener's ``/metrics`` needs once one is
configured (and what its size series need at all, docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrelay.router.errors import ClientError

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class ApiKey:
    """One client key; ``tenant=None`` means the router's default tenant."""

    tenant: str | None
    secret: str = field(repr=False)


def parse_api_keys(settings: Iterable[tuple[str, object]]) -> tuple[ApiKey, ...]:
    """Keys from ``("api_keys", value)`` / ``("tenants", value)`` settings; ``ValueError``
    if invalid (``config.build_config`` makes it a ``ConfigError``)."""
    return tuple(k for name, value in settings for k in _parse(value, name == "tenants"))


def _parse(value: object, tenants_table: bool) -> list[ApiKey]:
    """A ``[tenant:]secret`` string (comma-separated for env vars), a list of them, or
    (``tenants_table``) a ``{tenant: secret | [secrets]}`` table."""
    out: list[ApiKey] = []
    if tenants_table:
        if not isinstance(value, Mapping):
            raise ValueError("tenants must be a table of tenant = key or [keys]")
        for tenant, secrets in value.items():
            items = [secrets] if isinstance(secrets, str) else secrets
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ValueError("tenants: each tenant needs a key or a list of keys")
            out.extend(_key(str(tenant), s) for s in items)
        return out
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) for s in items):
        raise ValueError("api_keys must be a list of 'TENANT:KEY' or 'KEY' strings")
    for item in items:
        item = item.strip()
        if not item:
            continue
        tenant, sep, secret = item.partition(":")
        out.append(_key(tenant, secret) if sep else _key(None, item))
    if not out:  # e.g. --api-key "$KEY" with KEY unset: it served everyone (probe 14, K4)
        raise ValueError("API keys given, but none is non-empty (an unset variable?): leave "
                         "the setting out to run without keys")
    return out


def _key(tenant: str | None, secret: str) -> ApiKey:
    secret = secret.strip()
    if tenant is not None and not tenant.strip():
        raise ValueError("an API key's tenant must be non-empty")
    if not secret:
        raise ValueError("API keys must be non-empty")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in secret):
        raise ValueError("API keys cannot contain spaces or control characters")
    return ApiKey(tenant.strip() if tenant is not None else None, secret)


class SecuritySettings(Protocol):
    """The settings ``check_security`` reads (``RouterConfig`` has them; ``config`` imports
    this module, so it is named by shape here)."""

    @property
    def api_keys(self) -> Sequence[ApiKey]: ...
    @property
    def admin_key(self) -> str | None: ...
    @property
    def metrics_key(self) -> str | None: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def header_timeout_s(self) -> float: ...
    @property
    def body_timeout_s(self) -> float: ...
    @property
    def drain_timeout_s(self) -> float: ...


def check_security(config: SecuritySettings) -> None:
    """``ValueError`` for invalid security or limit settings of a ``RouterConfig``: a key
    configured twice or equal to the admin key, non-positive limits or timeouts."""
    if config.max_body_bytes < 1 or config.max_in_flight < 1:
        raise ValueError("max_body_bytes and max_in_flight must be >= 1")
    timeouts = {"header_timeout_s": config.header_timeout_s,
                "body_timeout_s": config.body_timeout_s,
                "drain_timeout_s": config.drain_timeout_s}
    for name, seconds in timeouts.items():
        if seconds <= 0:
            raise ValueError(f"{name} must be positive")
    admin_key = config.admin_key
    secrets = [k.secret for k in config.api_keys]
    if len(set(secrets)) != len(secrets):
        raise ValueError("an API key is configured more than once")
    if admin_key is not None:
        if not admin_key or any(ord(c) < 0x21 or ord(c) == 0x7F for c in admin_key):
            raise ValueError("admin_key must be non-empty, without spaces or control chars")
        if admin_key in secrets:
            raise ValueError("admin_key must differ from every API key")
    metrics_key = config.metrics_key
    if metrics_key is not None:
        if not metrics_key or any(ord(c) < 0x21 or ord(c) == 0x7F for c in metrics_key):
            raise ValueError("metrics_key must be non-empty, without spaces or control chars")
        if metrics_key in secrets:
            raise ValueError("metrics_key must differ from every API key")


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, if any."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def client_key(headers: Mapping[str, str]) -> str | None:
    """A client's key: ``Authorization: Bearer <key>``, else Anthropic's ``x-api-key: <key>``
    (what Claude Code and Anthropic's SDKs send with ``ANTHROPIC_API_KEY``)."""
    token = bearer(headers)
    if token is not None:
        return token
    value = headers.get("x-api-key", "").strip()
    return value or None


class Authenticator:
    """Maps a request's client key (``client_key``) to its tenant (see the module
    docstring)."""

    def __init__(
        self, keys: tuple[ApiKey, ...], admin_key: str | None, default_tenant: str,
        metrics_key: str | None = None,
    ) -> None:
        self._keys = [(_digest(k.secret), k.tenant or default_tenant) for k in keys]
        self._admin = _digest(admin_key) if admin_key is not None else None
        self._metrics = _digest(metrics_key) if metrics_key is not None else None
        self.default_tenant = default_tenant

    @property
    def metrics_locked(self) -> bool:
        """Whether the public ``/metrics`` needs a key (``metrics_key`` is configured)."""
        return self._metrics is not None

    def reads_metrics(self, headers: Mapping[str, str]) -> bool:
        """Whether the request carries the metrics key or the admin key (``client_key``)."""
        token = client_key(headers)
        if token is None:
            return False
        given = _digest(token)
        metrics = self._metrics is not None and hmac.compare_digest(given, self._metrics)
        return metrics or self.is_admin(headers)

    @property
    def admin_enabled(self) -> bool:
        return self._admin is not None

    def _match(self, token: str | None) -> str | None:
        """The tenant of ``token`` (every key compared, in constant time), else ``None``."""
        given = _digest(token or "")
        found: str | None = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(given, digest) and token is not None:
                found = tenant
        return found

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        """Whether the request's key (``client_key``: Bearer, else ``x-api-key``) is the
        admin key."""
        token = client_key(headers)
        if self._admin is None:
            return False
        return hmac.compare_digest(_digest(token or ""), self._admin) and token is not None

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The request's tenant; ``ClientError`` 401 if keys are configured and the request
        carries none of them."""
        if not self._keys:
            return self.default_tenant
        tenant = self._match(client_key(headers))
        if tenant is None:
            raise ClientError(
                "Missing or invalid API key: send 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>')",
                status=401, headers=_CHALLENGE,
            )
        return tenant

    def viewer(self, headers: Mapping[str, str]) -> str | None:
        """Who may read diagnostics: ``None`` for everything (admin, or no keys configured),
        else the caller's tenant; ``ClientError`` 401 for a caller without a valid key."""
        if self.is_admin(headers) or not self._keys:
            return None
        return self.tenant(headers)

    def require_admin(self, headers: Mapping[str, str]) -> None:
        """``ClientError`` 401 without a valid key, 403 for a tenant's key (however it is
        sent: ``client_key``)."""
        if self.is_admin(headers):
            return
        if self._match(client_key(headers)) is not None:
            raise ClientError("This endpoint needs the admin key", status=403)
        raise ClientError(
            "Missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
            status=401, headers=_CHALLENGE,
        )
