"""Router configuration: immutable values, built from code, a TOML file, env vars or flags.

``RouterConfig.from_urls(prefill_urls, decode_urls, ...)`` is the programmatic entry point
(``kvrelay up`` uses it). ``build_config(layers...)`` merges plain settings mappings, later
layers winning; the CLI passes defaults <- TOML file <- ``KVRELAY_*`` env <- flags.

Node ids default to ``prefill-<i>`` / ``decode-<j>`` in the order given, like the local cluster.
A node's ``side_channel`` is the address (``host`` and optionally ``port``) by which the *other*
role reaches this node's NIXL side channel; when set, the router rewrites ``remote_host`` (and
``remote_port``) in params that point at this node before forwarding them.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import secrets
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from kvrelay.core.conversation import (
    DEFAULT_DECODER_KV_BLOCKS_TTL_S,
    DEFAULT_EXPIRY_SAFETY_MARGIN_S,
    TAG_KEY_BYTES,
)
from kvrelay.core.costs import CostLine, CostLines
from kvrelay.core.params import RemoteBlocks
from kvrelay.core.policy import PolicyConfig
from kvrelay.core.selection import AffinityConfig
from kvrelay.router.auth import ApiKey, check_security, parse_api_keys
from kvrelay.router.request import IdPrecedence, IdRules
from kvrelay.router.request_limits import RequestLimits

Role = Literal["prefill", "decode"]
GuardMode = Literal["auto", "connector", "tokenize"]
MetricsListener = Literal["public", "internal"]
ResponseStoreMode = Literal["off", "memory", "redis"]

DEFAULT_SESSION_HEADERS: tuple[str, ...] = (
    "x-conversation-id",
    "x-dynamo-session-id",
    "x-smg-routing-key",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-session-affinity",
    "x-session-id",
    "x-litellm-session-id",
    "helicone-session-id",
    "agent-session-id",
)
"""Request headers that carry a client's own conversation/session id (first found wins):
kvrelay's own, NVIDIA Dynamo's and the SGLang gateway's routing keys, Claude Code, Codex
(``session-id``/``thread-id``), opencode/AIPerf/Cloudflare (``x-session-affinity``), the
vLLM multi-turn benchmark/opencode/OpenRouter/vllm-project router (``x-session-id``),
LiteLLM, Helicone and goose (docs/router.md has the sources). Per-request ids
(``x-request-id``, ``x-correlation-id`` for most clients) are left out on purpose: an id
that changes every turn would split a conversation's scope. Without any, the router still
finds the entry a request continues from its messages."""

_NODE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class ConfigError(ValueError):
    """An invalid router setting (bad URL, unknown key, wrong type)."""


@dataclass(frozen=True)
class SideChannel:
    """Where the other role reaches a node's NIXL side channel; ``port=None`` keeps the
    port the node advertises."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: str) -> SideChannel:
        """``host``, ``host:port`` or ``[v6]:port``."""
        text = text.strip()
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        elif text.count(":") == 1:
            host, _, port_text = text.partition(":")
        else:
            host, port_text = text, ""
        if not host:
            raise ConfigError(f"side channel {text!r} has no host")
        if not port_text:
            return cls(host)
        try:
            port = int(port_text)
        except ValueError:
            raise ConfigError(f"side channel {text!r}: port is not a number") from None
        if not 0 < port < 65536:
            raise ConfigError(f"side channel {text!r}: port out of range")
        return cls(host, port)


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
"""``log_level``'s values (``kvrelay route --log-level``'s choices)."""


@dataclass(frozen=True)
class NodeConfig:
    """One vLLM server. ``ttl_s`` is D's ``decoder_kv_blocks_ttl`` (ignored for P);
    ``block_size`` its KV block size in tokens (``None``: inferred from its params, see
    ``router.blocks``)."""

    node_id: str
    role: Role
    url: str
    side_channel: SideChannel | None = None
    ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not _NODE_ID.fullmatch(self.node_id) or self.node_id in (".", ".."):
            # it is a path segment of /admin/nodes/{id}/drain: "d0/x" drained "d0" (probe 14,
            # K12)
            raise ConfigError(f"node id must be 1-64 letters, digits, '.', '_', '-' or ':' "
                              f"(not '.' or '..'), got {self.node_id!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname \
                or parts.path.strip("/") or parts.query or parts.fragment or "@" in parts.netloc:
            # a path (the usual OpenAI base URL ends in /v1) would make every node "down"
            raise ConfigError(f"node URL must be http(s)://host[:port] (no path: the router "
                              f"adds /v1/...), got {self.url!r}")
        try:
            parts.port  # noqa: B018 (a bad port raises)
        except ValueError:
            raise ConfigError(f"node URL has a bad port: {self.url!r}") from None
        if self.url.endswith("/"):
            object.__setattr__(self, "url", self.url.rstrip("/"))
        if not self.ttl_s > 0 or not math.isfinite(self.ttl_s):
            raise ConfigError(f"{self.node_id}: ttl_s must be a positive finite number")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"{self.node_id}: block_size must be >= 1")

    def reached(self, blocks: RemoteBlocks) -> RemoteBlocks:
        """This node's params as the other engine reaches it: at its configured side
        channel, when it has one (the params say where the node itself thinks it is)."""
        if self.side_channel is None:
            return blocks
        return blocks.with_host(self.side_channel.host, self.side_channel.port)


def derived_tag_key(secret: str) -> bytes:
    """The conversation tag key (and retention sync key, ``router.retention.sync_token``)
    derived from ``--tag-key``: replicas and restarts given the same secret agree on it."""
    return hashlib.blake2b(secret.encode("utf-8"), digest_size=TAG_KEY_BYTES,
                           person=b"kvrelay-tagkey").digest()


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router needs; see ``docs/router.md`` for each knob's meaning.

    Timeouts are wall-clock seconds. ``ttl_safety_margin_s`` is subtracted from each D's
    ``ttl_s`` to get an entry's expiry on the router clock. ``report_wait_s`` bounds how long a
    turn waits for the previous turn's pending D report; ``report_timeout_s`` how long after a
    response ends the router keeps waiting for that report before giving up on the entry.
    ``state`` is the shared conversation index (``redis://host:port/db``; ``None``: in this
    process), each of its calls bounded by ``state_timeout_ms``; ``deployment`` namespaces its
    keys (see ``router.index_redis``). ``response_store`` keeps ``store: true`` Responses
    (content: their input and output items) for ``previous_response_id`` and ``GET
    /v1/responses/{id}``: ``off``, ``memory`` (this process) or ``redis`` (in ``state``,
    shared by replicas), each response ``response_store_ttl_s``, at most
    ``response_store_max_mb`` in all and ``response_store_max_mb_per_tenant`` (default: the
    whole) of one tenant's (``router.response_store``).

    ``guard`` says where the exact prefix check runs: ``connector`` (kvrelay's connector on P
    proves every pulled token; the router never tokenizes), ``tokenize`` (stock vLLM on P: the
    router gets the prompt's ids from P's ``/tokenize`` and D's ids with
    ``return_token_ids``), ``auto`` (per node, ``connector`` once the node's answers show
    kvrelay's connector, else ``tokenize``). ``session_headers`` carry a client's own
    conversation id, which narrows the lookup; ``gateway_id_headers``, ``id_precedence`` and
    ``tenant_is_one_caller`` say which id wins and which ids are bound to one caller
    (``id_rules``, docs/security.md). D's reports go to the internal listener
    (``internal_host``:``internal_port``, default ``port + 1``; 0: any free port, bound when
    the server starts), which D reaches as ``internal_url``. ``learned_retention``: tell a D
    running kvrelay's connector how long to keep each turn (``kvrelay_retain_s``, the
    ``retain_quantile`` of the gaps between turns seen, per kind, ``core.retention_time``,
    never shorter than the router's margins + ``retain_min_window_s``); off, D keeps every
    turn its TTL.

    ``costs`` are the prefill and pull lines each P's cost estimates start from (``None``:
    ``core.costs``' priors); with ``learn_costs=False`` the router never updates them from
    the timings it sees, so every decision the cost model takes follows from the config
    alone (tests, and deployments that measured their costs: ``--fixed-costs``).
    """

    prefill: tuple[NodeConfig, ...]
    decode: tuple[NodeConfig, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    internal_host: str = "127.0.0.1"
    internal_port: int | None = None
    internal_url: str | None = None
    guard: GuardMode = "auto"
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS
    gateway_id_headers: tuple[str, ...] = ()
    id_precedence: IdPrecedence = "gateway"
    tenant_is_one_caller: bool = False
    tenant: str = "default"
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    costs: CostLines | None = None
    learn_costs: bool = True
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    ttl_safety_margin_s: float = DEFAULT_EXPIRY_SAFETY_MARGIN_S
    report_wait_s: float = 1.0
    report_timeout_s: float = 10.0
    health_interval_s: float = 5.0
    room_interval_s: float = 1.0
    """Seconds between reads of every D's room from its ``/metrics`` (0: never read)."""
    health_timeout_s: float = 2.0
    health_failures_to_down: int = 2
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    max_connections: int = 512
    max_entries: int = 100_000
    max_entries_per_tenant: int | None = None
    expired_retention_s: float = 300.0
    recent_decisions: int = 100
    learned_retention: bool = True
    retain_quantile: float = 0.997
    retain_min_window_s: float = 5.0
    log_level: str = "info"
    state: str | None = None
    state_timeout_ms: float = 50.0
    deployment: str = "default"
    api_keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    admin_key: str | None = field(default=None, repr=False)
    tag_key: str | None = field(default=None, repr=False)
    metrics_key: str | None = field(default=None, repr=False)
    metrics_listener: MetricsListener = "public"
    max_body_bytes: int = 8 * 1024 * 1024
    max_in_flight: int = 1024
    max_in_flight_per_tenant: int | None = None
    max_header_bytes: int = 64 * 1024
    max_header_line_bytes: int = 8 * 1024
    max_headers: int = 100
    max_messages: int = 10_000
    max_content_parts: int = 1_000
    max_content_parts_total: int = 20_000
    max_tools: int = 1_000
    max_tool_calls: int = 10_000
    max_stop_sequences: int = 64
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0
    turn_log: str | None = None
    turn_log_max_mb: int = 64
    turn_log_backups: int = 5
    response_store: ResponseStoreMode = "off"
    response_store_ttl_s: float = 3600.0
    response_store_max_mb: int = 256
    response_store_max_mb_per_tenant: int | None = None

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError("the router needs at least one prefill and one decode node")
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"node ids must be unique, got {ids}")
        if any(n.role != "prefill" for n in self.prefill):
            raise ConfigError("every prefill node needs role 'prefill'")
        if any(n.role != "decode" for n in self.decode):
            raise ConfigError("every decode node needs role 'decode'")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port out of range: {self.port}")
        if self.internal_port is None and self.port == 65535:
            raise ConfigError("port 65535 leaves no port + 1 for the internal listener: set "
                              "internal_port (0: any free one)")
        if not 0 <= self.listen_internal_port < 65536 or self.listen_internal_port == self.port:
            raise ConfigError("internal_port must be another port than port (0: any free one)")
        if self.guard not in ("auto", "connector", "tokenize"):
            raise ConfigError(f"guard must be auto, connector or tokenize, got {self.guard!r}")
        for name in ("session_headers", "gateway_id_headers"):
            if any(not h or h != h.strip().lower() for h in getattr(self, name)):
                raise ConfigError(f"{name} must be non-empty lower-case header names")
        if set(self.session_headers) & set(self.gateway_id_headers):
            raise ConfigError("a header cannot be both a session header (client-sent) and a "
                              "gateway id header (set by the gateway)")
        if self.id_precedence not in ("gateway", "client"):
            raise ConfigError(f"id_precedence must be gateway or client, got "
                              f"{self.id_precedence!r}")
        if self.tenant_is_one_caller and not self.api_keys:
            raise ConfigError("tenant_is_one_caller needs API keys: without them every "
                              "request is one open tenant")
        for name in ("max_entries_per_tenant", "max_in_flight_per_tenant",
                     "response_store_max_mb_per_tenant"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1")
        if min(self.max_header_bytes, self.max_header_line_bytes, self.max_headers) < 1:
            raise ConfigError("header limits must be >= 1")
        try:
            self.request_limits  # noqa: B018 (validates the per-request count limits)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.turn_log_max_mb < 1 or self.turn_log_backups < 0:
            raise ConfigError("turn_log_max_mb must be >= 1 and turn_log_backups >= 0")
        if self.report_timeout_s <= 0:
            raise ConfigError("report_timeout_s must be positive (0 would give up on every "
                              "streamed turn's D report at once)")
        if self.internal_url is not None:
            parts = urlsplit(self.internal_url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"internal_url must be http(s)://host[:port], got "
                                  f"{self.internal_url!r}")
        for name in ("report_wait_s", "report_timeout_s", "expired_retention_s",
                     "room_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} cannot be negative")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "read_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.health_failures_to_down < 1 or self.max_connections < 1:
            raise ConfigError("health_failures_to_down and max_connections must be >= 1")
        if not 0.0 < self.retain_quantile <= 1.0:
            raise ConfigError("retain_quantile must be in (0, 1]")
        if not self.retain_min_window_s > 0:
            raise ConfigError("retain_min_window_s must be positive")
        if self.max_entries < 1 or self.recent_decisions < 0:
            raise ConfigError("max_entries must be >= 1 and recent_decisions >= 0")
        for node in self.decode:
            if not 0 <= self.ttl_safety_margin_s < node.ttl_s:
                raise ConfigError(f"ttl_safety_margin_s must be in [0, {node.node_id}'s ttl_s)")
            if self.ttl_safety_margin_s + self.policy.near_expiry_s >= node.ttl_s:
                raise ConfigError(
                    f"near_expiry_s ({self.policy.near_expiry_s:g}) plus ttl_safety_margin_s "
                    f"({self.ttl_safety_margin_s:g}) must be below {node.node_id}'s ttl_s "
                    f"({node.ttl_s:g}): every entry would be too near expiry to pull")
        if self.log_level.lower() not in _LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, got "
                              f"{self.log_level!r}")
        if self.turn_log is not None and not Path(self.turn_log).parent.is_dir():
            raise ConfigError(f"turn_log: no directory {str(Path(self.turn_log).parent)!r}")
        if not self.tenant:
            raise ConfigError("tenant must be non-empty")
        check_security(self)  # keys and limits (ValueError)
        if self.state is not None and urlsplit(self.state).scheme not in (
            "redis", "rediss", "unix"
        ):
            raise ConfigError(f"state must be redis://host:port/db, got {self.state!r}")
        if self.state_timeout_ms <= 0:
            raise ConfigError("state_timeout_ms must be positive")
        if self.metrics_listener not in ("public", "internal"):
            raise ConfigError(f"metrics_listener must be public or internal, got "
                              f"{self.metrics_listener!r}")
        if self.tag_key is not None and len(self.tag_key.encode("utf-8")) < 16:
            raise ConfigError("tag_key must be at least 16 bytes (a random secret)")
        if not self.deployment or any(c.isspace() for c in self.deployment):
            raise ConfigError("deployment must be non-empty, without whitespace")
        if self.response_store not in ("off", "memory", "redis"):
            raise ConfigError(f"response_store must be off, memory or redis, got "
                              f"{self.response_store!r}")
        if self.response_store == "redis" and self.state is None:
            raise ConfigError("response_store redis keeps responses in the router's Redis "
                              "state backend: set state (--state redis://HOST:PORT/DB)")
        if self.response_store_ttl_s <= 0 or self.response_store_max_mb < 1:
            raise ConfigError("response_store_ttl_s must be positive and "
                              "response_store_max_mb >= 1")

    @property
    def nodes(self) -> tuple[NodeConfig, ...]:
        return (*self.prefill, *self.decode)

    @property
    def listen_internal_port(self) -> int:
        return self.internal_port if self.internal_port is not None else self.port + 1

    @property
    def internal_base_url(self) -> str:
        """How D reaches the internal listener: ``internal_url``, else its host and port."""
        base = self.internal_url
        if base is None:
            host = self.internal_host
            host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
            host = f"[{host}]" if ":" in host else host
            base = f"http://{host}:{self.listen_internal_port}"
        return base.rstrip("/")

    @property
    def report_url(self) -> str:
        """Where D's connector POSTs its report: ``internal_url`` or the internal listener."""
        return self.internal_base_url + "/internal/kv-report"

    @property
    def request_limits(self) -> RequestLimits:
        """How many messages, content parts, tools, tool calls and stop sequences one
        request may carry (``router.request_limits``)."""
        return RequestLimits(
            max_messages=self.max_messages,
            max_content_parts=self.max_content_parts,
            max_content_parts_total=self.max_content_parts_total,
            max_tools=self.max_tools,
            max_tool_calls=self.max_tool_calls,
            max_stop_sequences=self.max_stop_sequences,
        )

    def conversation_tag_key(self) -> bytes:
        """The key conversation tags are made with: derived from ``tag_key`` (replicas and
        restarts that share it agree on tags), else random for this process."""
        if self.tag_key is None:
            return secrets.token_bytes(TAG_KEY_BYTES)
        return derived_tag_key(self.tag_key)

    @property
    def id_rules(self) -> IdRules:
        """Where a request's conversation id comes from and whether it binds (``request``)."""
        return IdRules(self.session_headers, self.gateway_id_headers, self.id_precedence,
                       self.tenant_is_one_caller)

    @property
    def tenant_in_flight(self) -> int:
        """Generation requests one tenant may have in flight."""
        return self.max_in_flight_per_tenant or self.max_in_flight

    @property
    def tenant_entries(self) -> int:
        """Entries one tenant may hold in the index."""
        return min(self.max_entries_per_tenant or self.max_entries, self.max_entries)

    @classmethod
    def from_urls(
        cls,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        *,
        side_channels: Mapping[str, str] | None = None,
        ttl_s: float = DEFAULT_DECODER_KV_BLOCKS_TTL_S,
        block_size: int | None = None,
        **settings: Any,
    ) -> RouterConfig:
        """Config for nodes given by URL; ``side_channels`` maps a node URL (or id) to
        ``host[:port]``; other keyword arguments are ``RouterConfig`` fields."""
        return build_config(
            {"prefill": list(prefill_urls), "decode": list(decode_urls), "ttl_s": ttl_s,
             "block_size": block_size, "side_channels": dict(side_channels or {}),
             **settings}
        )


_POLICY_FIELDS = {f.name: f for f in fields(PolicyConfig)}
_AFFINITY_FIELDS = {f.name: f for f in fields(AffinityConfig)}
_SCALAR_KEYS = {
    f.name: f for f in fields(RouterConfig) if f.name not in ("prefill", "decode", "policy",
                                                             "affinity")
}
_NODE_KEYS = {"url", "id", "side_channel", "ttl_s", "block_size"}


def build_config(*layers: Mapping[str, Any]) -> RouterConfig:
    """Merge settings layers (later wins) into a ``RouterConfig``; ``ConfigError`` if invalid.

    Keys: ``RouterConfig`` scalar fields (``costs``: a table or a ``key=value,...`` string,
    see ``parse_cost_lines``), ``prefill``/``decode`` (lists of URLs or of
    ``{"url", "id", "side_channel", "ttl_s", "block_size"}`` tables), ``ttl_s`` (default D
    TTL), ``block_size`` (default block size, unset: inferred),
    ``side_channels`` (``{url_or_id: "host[:port]"}``), ``policy`` and ``affinity`` tables
    (or their fields at top level, e.g. ``kv_recompute_threshold``), ``api_keys``/``tenants``.
    """
    merged: dict[str, Any] = {}
    policy: dict[str, Any] = {}
    affinity: dict[str, Any] = {}
    side: dict[str, str] = {}
    keys: list[tuple[str, Any]] = []  # api_keys / tenants of the last layer that has any
    for layer in layers:
        if layer.get("api_keys") is not None or layer.get("tenants") is not None:
            keys = [(k, layer[k]) for k in ("tenants", "api_keys") if layer.get(k) is not None]
        for key, value in layer.items():
            if value is None or key in ("api_keys", "tenants"):
                continue
            if key == "policy" or key == "affinity":
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{key} must be a table")
                (policy if key == "policy" else affinity).update(value)
            elif key == "side_channels":
                if not isinstance(value, Mapping):
                    raise ConfigError("side_channels must be a table of node URL or id = "
                                      "\"host[:port]\"")
                side.update({str(k): str(v) for k, v in value.items()})
            elif key in _POLICY_FIELDS:
                policy[key] = value
            elif key in _AFFINITY_FIELDS:
                affinity[key] = value
            elif key in _SCALAR_KEYS or key in ("prefill", "decode", "ttl_s", "block_size"):
                merged[key] = value
            else:
                raise ConfigError(f"unknown router setting {key!r}")
    default_ttl = _typed("ttl_s", merged.pop("ttl_s", DEFAULT_DECODER_KV_BLOCKS_TTL_S), "float")
    default_bs = merged.pop("block_size", None)
    default_bs = _typed("block_size", default_bs, "int") if default_bs is not None else None
    prefill = _nodes("prefill", merged.pop("prefill", []), side, default_ttl, default_bs)
    decode = _nodes("decode", merged.pop("decode", []), side, default_ttl, default_bs)
    urls = [n.url for n in (*prefill, *decode)]
    twice = sorted({u for u in urls if urls.count(u) > 1})
    if twice:
        raise ConfigError(f"node URL(s) listed twice: {twice}")
    used = {n.url for n in (*prefill, *decode)} | {n.node_id for n in (*prefill, *decode)}
    unknown = sorted(set(side) - used)
    if unknown:
        raise ConfigError(f"side channel given for unknown node(s): {unknown}")
    for table, known, name in ((policy, _POLICY_FIELDS, "policy"),
                               (affinity, _AFFINITY_FIELDS, "affinity")):
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"unknown {name} setting(s) {unknown}")
        table.update({k: _typed(k, v, _kind_of(k)) for k, v in table.items()})
    try:
        scalars = {k: _coerce(k, v) for k, v in merged.items()}
        scalars["api_keys"] = parse_api_keys(keys)
        return RouterConfig(
            prefill=prefill,
            decode=decode,
            policy=replace(PolicyConfig(), **policy),
            affinity=replace(AffinityConfig(), **affinity),
            **scalars,
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(str(exc)) from exc


def _nodes(
    role: Role,
    raw: object,
    side: Mapping[str, str],
    default_ttl: float,
    default_block_size: int | None,
) -> tuple[NodeConfig, ...]:
    if isinstance(raw, str):
        raw = [u for u in raw.split(",") if u.strip()]
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{role} must be a list of URLs or node tables")
    out: list[NodeConfig] = []
    for i, item in enumerate(raw):
        table: Mapping[str, Any] = {"url": item} if isinstance(item, str) else item
        if not isinstance(table, Mapping) or not isinstance(table.get("url"), str):
            raise ConfigError(f"{role}[{i}] needs a 'url'")
        extra = set(table) - _NODE_KEYS
        if extra:
            raise ConfigError(f"{role}[{i}]: unknown key(s) {sorted(extra)}")
        url = str(table["url"]).strip().rstrip("/")
        node_id = str(table.get("id") or f"{role}-{i}")
        channel = table.get("side_channel") or side.get(url) or side.get(node_id)
        if channel is not None and not isinstance(channel, str):
            raise ConfigError(f"{role}[{i}].side_channel must be \"host[:port]\", got "
                              f"{channel!r}")
        ttl = _typed(f"{role}[{i}].ttl_s", table.get("ttl_s", default_ttl), "float")
        bs = table.get("block_size", default_block_size)
        bs = _typed(f"{role}[{i}].block_size", bs, "int") if bs is not None else None
        out.append(NodeConfig(
            node_id=node_id,
            role=role,
            url=url,
            side_channel=SideChannel.parse(str(channel)) if channel else None,
            ttl_s=ttl,
            block_size=bs,
        ))
    return tuple(out)


def _coerce(key: str, value: Any) -> Any:
    """A setting's value (an env or flag string, or a TOML value) as its field's type."""
    if key == "costs":
        return parse_cost_lines(value)
    if key in ("session_headers", "gateway_id_headers"):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not all(isinstance(h, str) for h in items):
            raise ConfigError(f"{key} must be a list of header names")
        if any(not h.strip() for h in items):
            raise ConfigError(f"{key}: an empty header name (an empty list, [], turns them "
                              "off)")
        return tuple(h.strip().lower() for h in items)
    return _typed(key, value, _kind_of(key))


_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")
"""An integer setting's text: ASCII digits (``int()`` would also take other scripts' digits
and ``_``), at most 18 of them."""


def _kind_of(key: str) -> str:
    """The annotation of setting ``key`` (a ``RouterConfig``, policy or affinity field, or
    the default ``ttl_s`` / ``block_size``); ``""`` for others (taken as they come)."""
    for table in (_SCALAR_KEYS, _POLICY_FIELDS, _AFFINITY_FIELDS):
        if key in table:
            return str(table[key].type)
    return {"ttl_s": "float", "block_size": "int"}.get(key, "")


def _typed(key: str, value: Any, kind: str) -> Any:
    """``value`` as a field of type ``kind`` (its annotation), from a string (env, flag) or a
    TOML value; ``ConfigError`` naming ``key`` otherwise. A quoted TOML boolean
    (``"false"``) is read as the word says, never as a truthy string; numbers are finite."""
    if kind == "bool":
        return _flag(key, value)
    if kind in ("int", "int | None"):
        if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if kind in ("float", "float | None"):
        try:
            if isinstance(value, bool) or not isinstance(value, int | float | str):
                raise ValueError
            number = float(value)
        except (ValueError, OverflowError):
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if kind in ("str", "str | None", "GuardMode", "IdPrecedence", "MetricsListener",
                "ResponseStoreMode") and not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value


COST_KEYS = {
    "prefill_s_per_token": ("prefill", "s_per_token"),
    "prefill_fixed_s": ("prefill", "fixed_s"),
    "pull_s_per_token": ("pull", "s_per_token"),
    "pull_fixed_s": ("pull", "fixed_s"),
}
"""The keys of a ``costs`` setting: each line's slope and fixed part (seconds)."""


def parse_cost_lines(value: object) -> CostLines:
    """``costs`` as a table (TOML) or ``"prefill_s_per_token=1e-4,pull_s_per_token=2e-5"``
    (flag, env); keys left out keep ``core.costs``' priors. ``ConfigError`` if invalid."""
    if isinstance(value, CostLines):
        return value
    if isinstance(value, str):
        table: dict[str, object] = {}
        for item in (i.strip() for i in value.split(",")):
            key, sep, number = item.partition("=")
            if not sep:
                raise ConfigError(f"costs: {item!r} is not KEY=SECONDS")
            table[key.strip()] = number.strip()
    elif isinstance(value, Mapping):
        table = {str(k): v for k, v in value.items()}
    else:
        raise ConfigError("costs must be a table or KEY=SECONDS,... text")
    unknown = sorted(set(table) - set(COST_KEYS))
    if unknown:
        raise ConfigError(f"costs: unknown key(s) {unknown}; known: {sorted(COST_KEYS)}")
    lines = {"prefill": CostLines().prefill, "pull": CostLines().pull}
    for key, raw in table.items():
        line, part = COST_KEYS[key]
        try:
            if not isinstance(raw, int | float | str) or isinstance(raw, bool):
                raise TypeError(f"must be a number, got {raw!r}")
            lines[line] = _with_part(lines[line], part, float(raw))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"costs: {key}: {exc}") from None
    return CostLines(prefill=lines["prefill"], pull=lines["pull"])


def _with_part(line: CostLine, part: str, seconds: float) -> CostLine:
    """``line`` with its ``fixed_s`` or ``s_per_token`` set (``ValueError`` if invalid)."""
    if part == "fixed_s":
        return CostLine(seconds, line.s_per_token)
    return CostLine(line.fixed_s, seconds)


def _flag(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key} must be true or false, got {value!r}")


ENV_PREFIX = "KVRELAY_"
#: Env var suffix -> settings key (list-valued ones are comma-separated).
ENV_KEYS = {
    "PREFILL": "prefill",
    "DECODE": "decode",
    "HOST": "host",
    "PORT": "port",
    "INTERNAL_HOST": "internal_host",
    "INTERNAL_PORT": "internal_port",
    "INTERNAL_URL": "internal_url",
    "GUARD": "guard",
    "SESSION_HEADERS": "session_headers",
    "GATEWAY_ID_HEADERS": "gateway_id_headers",
    "ID_PRECEDENCE": "id_precedence",
    "TENANT_IS_ONE_CALLER": "tenant_is_one_caller",
    "TTL_S": "ttl_s",
    "BLOCK_SIZE": "block_size",
    "REPORT_WAIT_S": "report_wait_s",
    "REPORT_TIMEOUT_S": "report_timeout_s",
    "HEALTH_INTERVAL_S": "health_interval_s",
    "ROOM_INTERVAL_S": "room_interval_s",
    "MAX_ENTRIES": "max_entries",
    "KV_RECOMPUTE_THRESHOLD": "kv_recompute_threshold",
    "NEAR_EXPIRY_S": "near_expiry_s",
    "PULL_COST_FACTOR": "pull_cost_factor",
    "FIXED_COSTS": "costs",
    "LEARN_COSTS": "learn_costs",
    "DIRECT": "direct_enabled",
    "LOG_LEVEL": "log_level",
    "API_KEYS": "api_keys",
    "ADMIN_KEY": "admin_key",
    "TAG_KEY": "tag_key",
    "METRICS_KEY": "metrics_key",
    "METRICS_LISTENER": "metrics_listener",
    "MAX_BODY_BYTES": "max_body_bytes",
    "MAX_IN_FLIGHT": "max_in_flight",
    "MAX_IN_FLIGHT_PER_TENANT": "max_in_flight_per_tenant",
    "MAX_ENTRIES_PER_TENANT": "max_entries_per_tenant",
    "DRAIN_TIMEOUT_S": "drain_timeout_s",
    "STATE": "state",
    "STATE_TIMEOUT_MS": "state_timeout_ms",
    "DEPLOYMENT": "deployment",
    "TURN_LOG": "turn_log",
    "LEARNED_RETENTION": "learned_retention",
    "RETAIN_QUANTILE": "retain_quantile",
    "RETAIN_MIN_WINDOW_S": "retain_min_window_s",
    "RESPONSE_STORE": "response_store",
    "RESPONSE_STORE_TTL_S": "response_store_ttl_s",
    "RESPONSE_STORE_MAX_MB": "response_store_max_mb",
    "RESPONSE_STORE_MAX_MB_PER_TENANT": "response_store_max_mb_per_tenant",
}


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``KVRELAY_*`` variables (see ``ENV_KEYS``) as a settings layer."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for suffix, key in ENV_KEYS.items():
        value = env.get(ENV_PREFIX + suffix)
        if value is None or value == "":
            continue
        if suffix == "FIXED_COSTS":  # fixed: given and never learned
            out["costs"] = value
            out.setdefault("learn_costs", "false")
        else:  # typed here so that an error names the variable
            out[key] = _typed(ENV_PREFIX + suffix, value, _kind_of(key))
    return out


def settings_from_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config file as a settings layer (keys as in ``build_config``)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
