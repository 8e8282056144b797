"""Configuration of a fake engine and the per-request record it keeps of what it reused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvrelay.core.report import DEFAULT_REPORT_HOSTS
from kvrelay.fakevllm.connector import KVRole, PlanReason
from kvrelay.fakevllm.latency import FAST, LatencyModel
from kvrelay.fakevllm.report import ReportOutcome
from kvrelay.fakevllm.versions import VllmVersion, WireProtocol, wire_protocol

FailurePolicy = Literal["recompute", "fail"]


@dataclass(frozen=True)
class FakeEngineConfig:
    """Knobs of one fake vLLM engine; names follow vLLM's options and kv-transfer extras.

    Defaults follow kvrelay's local CPU cluster (``kvrelay.cluster.config.ClusterConfig``):
    bidirectional transfer on, ``kv_load_failure_policy`` ``recompute`` (vLLM's own default is
    ``fail``). ``FakeCluster`` turns prefix caching off on P and on on D, like that cluster.

    ``default_max_tokens`` applies to chat requests without ``max_tokens`` /
    ``max_completion_tokens`` (vLLM would generate up to ``max_model_len``, and the fake never
    emits EOS); ``None`` restores vLLM's behaviour. Completions default to 16, as in vLLM.
    ``vllm_version``: the release whose wire protocol the engine speaks, ``0.32`` (default)
    or ``0.33``; ``protocol`` says what that changes (``versions``: 0.33 streams D's
    params on the final chunk and adds ``remote_registration_generation`` to every params).
    ``system_fingerprint`` defaults to ``vllm-<release>-fake``.
    ``lora_modules``: model names served as LoRA adapters of the base (vLLM's
    ``--lora-modules NAME=PATH``), accepted as a request's ``model``; the fake has no adapter
    weights, so they answer as the base does (the token ids are the base's either way).
    ``report_delay_s`` / ``report_hosts``: kvrelay's D-side report (see ``report``).
    ``kvrelay_connector``: the engine runs kvrelay's connector (as ``kvrelay up`` sets it up):
    D adds the fingerprint of what it retains to its params, P proves a pull against its
    prompt before loading (``kvrelay.core.guard``); False is stock vLLM. kvrelay's connector
    reports on every version (the router asks for a report on every streamed turn), so a
    0.33 D both streams its params and posts them.
    ``kvrelay_retention``: with ``kvrelay_connector`` (and bidirectional transfer), D manages
    its retained turns as kvrelay's connector does (``retention``: per-turn
    ``kvrelay_retain_s``, releases under pressure, over ``retention_headroom`` (a fraction
    of the cache kept free of retention), at the deadline and on the router's orders, and
    the sync with the router, ``sync``); False keeps stock vLLM's one global TTL (as
    ``kvrelay up --retention stock``: the retained params say ``kvrelay_retention: stock``).
    ``retention_sync``: whether a managed D syncs with the router itself; False: it never
    does (a test posts D's syncs by hand, as D).
    ``deterministic_ids``: engine and request ids derived from ``seed``, engine name and side
    channel instead of random ones (generated text depends only on ``seed`` either way).
    ``records_limit`` bounds the request records, freed-block reads and expired ids kept (a
    record holds its prompt, context and pulled token ids: ~50 KB for a 2k-token prompt).
    """

    served_model_name: str = "tiny"
    max_model_len: int = 131072  # the generated models' context (kvrelay.models.MAX_MODEL_LEN)
    block_size: int = 128
    num_gpu_blocks: int = 16384
    enable_prefix_caching: bool = True
    bidirectional_kv_xfer: bool = True
    kv_recompute_threshold: int = 64
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    kv_load_failure_policy: FailurePolicy = "recompute"
    vllm_version: VllmVersion = "0.32"
    default_max_tokens: int | None = 16
    latency: LatencyModel = FAST
    seed: int = 0
    kv_bytes_per_token: int = 1024
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    system_fingerprint: str | None = None
    lora_modules: tuple[str, ...] = ()
    records_limit: int = 1000
    deterministic_ids: bool = False
    report_delay_s: float = 0.1
    report_hosts: tuple[str, ...] = DEFAULT_REPORT_HOSTS
    kvrelay_connector: bool = True
    kvrelay_retention: bool = True
    retention_sync: bool = True
    retention_headroom: float = 0.0

    def __post_init__(self) -> None:
        wire_protocol(self.vllm_version)
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")
        if self.block_size < 1 or self.num_gpu_blocks < 2 or self.max_model_len < 2:
            raise ValueError("block_size >= 1, num_gpu_blocks >= 2 and max_model_len >= 2")
        if self.decoder_kv_blocks_ttl < 0 or self.kv_lease_duration < 0:
            raise ValueError("TTLs must be >= 0")
        if self.report_delay_s < 0 or self.records_limit < 1:
            raise ValueError("report_delay_s >= 0 and records_limit >= 1")
        if not 0.0 <= self.retention_headroom <= 1.0:
            raise ValueError("retention_headroom is a fraction in [0, 1]")

    @property
    def managed_retention(self) -> bool:
        """Whether D runs kvrelay's retention (else stock vLLM's global TTL)."""
        return self.kvrelay_connector and self.kvrelay_retention and self.bidirectional_kv_xfer

    @property
    def protocol(self) -> WireProtocol:
        """What ``vllm_version`` puts on the wire (``versions``)."""
        return wire_protocol(self.vllm_version)

    @property
    def effective_system_fingerprint(self) -> str:
        """The ``system_fingerprint`` the engine answers with."""
        if self.system_fingerprint is not None:
            return self.system_fingerprint
        return f"vllm-{self.protocol.release}-fake"


@dataclass
class RequestRecord:
    """What one request did with KV on one engine; read it with ``engine.record(id)``.

    ``context_token_ids`` is the *effective context*: the tokens whose KV the engine used
    (prefix-cache contents, then pulled KV, then computed prompt tokens). With correct reuse
    it equals ``prompt_token_ids``; ``wrong_reuse`` says it does not. ``pulled_source_token_ids``
    is what the pulled KV encodes, to compare with ``expected_pulled_token_ids``.

    ``plan`` is the connector's decision (``connector.PlanReason``): ``pull`` (read
    ``pulled_tokens`` from ``pulled_from_engine``), ``below_threshold`` / ``local_hit`` (no
    read; the holder was only notified, which frees its blocks), ``bidirectional_off``,
    ``invalid_params`` or ``none``. ``read_freed_blocks``: the holder no longer held the blocks
    (params used twice): the KV read is whatever those block ids held at that moment.
    ``load_failure`` (a ``kv.ReadFailure``) is set when the read failed; then
    ``recomputed_after_failure`` under policy ``recompute``, or the request failed.
    ``report`` is kvrelay's D-side report, when the request asked for one. ``guard`` is the
    reason of kvrelay's prefix guard on P (``core.guard``; ``None``: not run) and
    ``verified_tokens`` the prefix it proved. ``request_kv_transfer_params`` is the
    ``kv_transfer_params`` the request carried (what a router asked this engine to do: read
    which blocks, report where), as received.
    """

    request_id: str
    internal_request_id: str
    engine_id: str
    endpoint: str
    kv_role: KVRole
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    plan: PlanReason = "none"
    local_cache_hit_tokens: int = 0
    pulled_tokens: int = 0
    pulled_from_engine: str | None = None
    pulled_from_request: str | None = None
    pulled_block_ids: tuple[int, ...] = ()
    pulled_source_token_ids: tuple[int, ...] = ()
    read_freed_blocks: bool = False
    notified_engine: str | None = None
    load_failure: str | None = None
    recomputed_after_failure: bool = False
    computed_tokens: int = 0
    num_preemptions: int = 0
    context_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    kv_transfer_params: dict[str, object] | None = None
    report: ReportOutcome | None = None
    guard: str | None = None
    verified_tokens: int | None = None
    request_kv_transfer_params: dict[str, object] | None = None

    @property
    def expected_pulled_token_ids(self) -> tuple[int, ...]:
        """The prompt tokens the pulled KV should have encoded."""
        start = self.local_cache_hit_tokens
        return self.prompt_token_ids[start : start + self.pulled_tokens]

    @property
    def pulled_matches_prompt(self) -> bool:
        return self.pulled_source_token_ids == self.expected_pulled_token_ids

    @property
    def wrong_reuse(self) -> bool:
        """True when the KV used differs from the prompt (pulled or prefix-cached garbage)."""
        return bool(self.context_token_ids) and self.context_token_ids != self.prompt_token_ids
