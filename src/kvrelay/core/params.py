"""vLLM's ``kv_transfer_params``, parsed once at the edge into typed values.

NixlConnector (pull mode) exchanges one JSON object per request in both directions. Real
examples from vLLM 0.32 on this machine are in ``tests/data/vllm-0.32.0``.

* **Prefill request** (router -> P, turn without reuse): ``{"do_remote_decode": true}``.
* **Prefill response** (P -> router -> D): P holds the prompt's blocks under a lease until a D
  reads them; ``do_remote_prefill`` is true, ``remote_num_tokens`` is the prompt length.
* **Decode response** (D -> router), bidirectional mode only: D retains the blocks of
  prompt + generated tokens for ``decoder_kv_blocks_ttl`` seconds; ``do_remote_decode`` is
  true and ``remote_num_tokens`` counts the tokens that have KV (prompt + generated - 1).
  Sent back to P unchanged on the next turn, it makes P pull those blocks from D.

``remote_blocks_expiry_time`` is D's ``time.perf_counter()`` deadline: another process's
clock, so it is kept for diagnostics only, never compared with the router's clock.

kvrelay's own keys inside ``kv_transfer_params`` (this module is their only home; vLLM passes
unknown keys through untouched):

* ``kvrelay_guard`` (int, on any params kvrelay's connector returns): the node runs kvrelay's
  connector at that version, so P verifies pulls and D fingerprints what it retains.
* ``kvrelay_fingerprint`` (D's retained params, and a pull request to P): the
  ``TokenFingerprint`` (``to_str``) of the tokens D retains, computed by D from its own ids.
* ``kvrelay_block_size`` (D's retained params): D's KV block size, needed to cut the block
  list of a partial pull.
* ``kvrelay_verified_tokens`` (P's answer to a pull): how many prompt tokens P's connector
  proved equal to D's held tokens before loading.
* ``kvrelay_retention`` (D's retained params): how D's connector keeps the turn:
  ``managed`` (it reads ``kvrelay_retain_s`` and releases on the router's orders) or
  ``stock`` (``kvrelay up --retention stock``: one global TTL, orders ignored), so the
  router never expires an entry early that D keeps (``RetentionMode``). Another value reads
  as absent.
* ``kvrelay_report_url`` / ``kvrelay_turn_id`` (a D request): where kvrelay's connector posts
  D's report when the request finishes (see ``core.report``).

vLLM keys this module does not model (e.g. 0.33's ``remote_registration_generation``) are
kept verbatim in ``RemoteBlocks.vllm_extra`` and sent back unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

import msgspec
from msgspec.structs import replace

from kvrelay.core.fingerprint import FingerprintError, TokenFingerprint

GUARD_KEY = "kvrelay_guard"
FINGERPRINT_KEY = "kvrelay_fingerprint"
BLOCK_SIZE_KEY = "kvrelay_block_size"
VERIFIED_TOKENS_KEY = "kvrelay_verified_tokens"
RETENTION_MODE_KEY = "kvrelay_retention"
REPORT_URL_KEY = "kvrelay_report_url"
REPORT_TURN_KEY = "kvrelay_turn_id"
GUARD_VERSION = 1
"""Version of kvrelay's connector protocol (``kvrelay_guard``)."""

_KVRELAY_ANSWER_KEYS = (GUARD_KEY, FINGERPRINT_KEY, BLOCK_SIZE_KEY, VERIFIED_TOKENS_KEY,
                        RETENTION_MODE_KEY)

_VLLM_KEYS = frozenset({
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
    "remote_prefill_cached_tokens",
})

Direction = Literal["prefill_to_decode", "decode_to_prefill"]
RetentionMode = Literal["managed", "stock"]
"""How D's connector keeps a retained turn (``kvrelay_retention``)."""


class KVParamsError(ValueError):
    """A ``kv_transfer_params`` object that does not follow vLLM's NixlConnector protocol."""


class RemoteBlocks(msgspec.Struct, frozen=True):
    """Where a node holds KV blocks another node may read over NIXL.

    ``direction`` says who reads: ``prefill_to_decode`` blocks sit on P and are read by D;
    ``decode_to_prefill`` blocks sit on D (retained after decode) and are read by P.
    """

    direction: Direction
    block_ids: tuple[tuple[int, ...], ...]
    engine_id: str
    request_id: str
    host: str
    port: int
    num_tokens: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    transfer_mode: str = "pull"
    remote_expiry_perf_counter_s: float | None = None
    prefill_cached_tokens: int | None = None
    fingerprint: TokenFingerprint | None = None
    block_size: int | None = None
    guard_version: int | None = None
    verified_tokens: int | None = None
    retention: RetentionMode | None = None
    vllm_extra: tuple[tuple[str, str], ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.block_ids)

    def to_json(self) -> dict[str, object]:
        """The exact object vLLM expects in a request's ``kv_transfer_params``."""
        out: dict[str, object] = {
            "do_remote_prefill": self.direction == "prefill_to_decode",
            "do_remote_decode": self.direction == "decode_to_prefill",
            "remote_block_ids": [list(group) for group in self.block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": self.tp_size,
            "dcp_size": self.dcp_size,
            "pp_size": self.pp_size,
            "remote_num_tokens": self.num_tokens,
            "remote_blocks_expiry_time": self.remote_expiry_perf_counter_s,
            "transfer_mode": self.transfer_mode,
        }
        if self.prefill_cached_tokens is not None:
            out["remote_prefill_cached_tokens"] = self.prefill_cached_tokens
        for key, text in self.vllm_extra:
            out[key] = json.loads(text)
        out.update(kvrelay_keys(
            guard_version=self.guard_version, fingerprint=self.fingerprint,
            block_size=self.block_size, verified_tokens=self.verified_tokens,
            retention=self.retention,
        ))
        return out

    def to_vllm_json(self) -> dict[str, object]:
        """``to_json`` without kvrelay's keys: what a node that is not the reader needs."""
        out = self.to_json()
        for key in _KVRELAY_ANSWER_KEYS:
            out.pop(key, None)
        return out

    def for_release(self) -> RemoteBlocks:
        """What a P request that only makes D free the turn needs (``router.stock_release``):
        D frees the whole request on P's notification, whatever the params list, so one
        token of the first block per group (P reads at most that, with
        ``kv_recompute_threshold`` 0; below it nothing) and no fingerprint: kept for each
        queued release order, it stays small however long the turn."""
        return replace(self, block_ids=tuple(group[:1] for group in self.block_ids),
                       num_tokens=min(self.num_tokens, 1), fingerprint=None)

    def with_host(self, host: str, port: int | None = None) -> RemoteBlocks:
        """Same blocks, reached through another address (router-side NAT/host rewrite)."""
        return replace(self, host=host, port=self.port if port is None else port)

    def capped(self, num_tokens: int, block_size: int | None) -> RemoteBlocks:
        """Same blocks, limited to the first ``num_tokens`` tokens (never raised).

        vLLM's P pulls ``min(remote_num_tokens, prompt) - local hits`` tokens into
        ``cdiv(count, block_size)`` local blocks, and pairs them with the *last* blocks of
        ``remote_block_ids`` (it end-trims the remote list, assuming a shorter local list
        means a local prefix-cache hit). So lowering ``remote_num_tokens`` alone would pair
        local blocks with the wrong remote blocks: each group is also cut to its first
        ``cdiv(num_tokens, block_size)`` block ids. With ``block_size=None`` (unknown) only a
        cap that keeps every block is allowed.

        Raises ``ValueError`` if a group holds fewer blocks than the tokens need, or if the
        block size is unknown and the cap would drop blocks.
        """
        n = min(self.num_tokens, max(0, num_tokens))
        if block_size is None:
            if n < self.num_tokens:
                raise ValueError("cannot cap below the held tokens without the block size")
            return self
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        keep = -(-n // block_size)
        if any(len(group) < keep for group in self.block_ids):
            raise ValueError(f"{n} tokens need {keep} blocks of {block_size}; fewer are held")
        groups = tuple(group[:keep] for group in self.block_ids)
        return replace(self, num_tokens=n, block_ids=groups)


def kvrelay_keys(
    *,
    guard_version: int | None = None,
    fingerprint: TokenFingerprint | None = None,
    block_size: int | None = None,
    verified_tokens: int | None = None,
    retention: RetentionMode | None = None,
) -> dict[str, object]:
    """kvrelay's keys of a node's answer params as they travel (``None``: key absent), in
    the order ``to_json`` writes them. kvrelay's connector adds them to the params vLLM
    returns; the fake engine's come from ``RemoteBlocks.to_json``."""
    out: dict[str, object] = {}
    if guard_version is not None:
        out[GUARD_KEY] = guard_version
    if fingerprint is not None:
        out[FINGERPRINT_KEY] = fingerprint.to_str()
    if block_size is not None:
        out[BLOCK_SIZE_KEY] = block_size
    if verified_tokens is not None:
        out[VERIFIED_TOKENS_KEY] = verified_tokens
    if retention is not None:
        out[RETENTION_MODE_KEY] = retention
    return out


DIRECT_PARAMS: Mapping[str, object] = MappingProxyType(
    {"do_remote_prefill": False, "do_remote_decode": False})
"""``kv_transfer_params`` of a decode request D serves whole, from its own prefix cache (a
``direct`` turn, an engine check): no P's blocks to read; D retains the turn like any other
in bidirectional mode and answers its retained params."""


def request_remote_decode() -> dict[str, object]:
    """``kv_transfer_params`` of a prefill request whose KV a decode node will read."""
    return {"do_remote_decode": True}


def parse_remote_blocks(raw: object) -> RemoteBlocks:
    """Parse a P or D response's ``kv_transfer_params``; raise ``KVParamsError`` if invalid."""
    if not isinstance(raw, Mapping):
        raise KVParamsError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
    prefill = raw.get("do_remote_prefill") is True
    decode = raw.get("do_remote_decode") is True
    if prefill == decode:
        raise KVParamsError(
            "exactly one of do_remote_prefill / do_remote_decode must be true in a response"
        )
    direction: Direction = "prefill_to_decode" if prefill else "decode_to_prefill"
    return RemoteBlocks(
        direction=direction,
        block_ids=_block_ids(raw.get("remote_block_ids")),
        engine_id=_str(raw, "remote_engine_id"),
        request_id=_str(raw, "remote_request_id"),
        host=_str(raw, "remote_host"),
        port=_int(raw, "remote_port"),
        num_tokens=_int(raw, "remote_num_tokens"),
        tp_size=_int(raw, "tp_size", 1),
        dcp_size=_int(raw, "dcp_size", 1),
        pp_size=_int(raw, "pp_size", 1),
        transfer_mode=str(raw.get("transfer_mode") or "pull"),
        remote_expiry_perf_counter_s=_opt_float(raw, "remote_blocks_expiry_time"),
        prefill_cached_tokens=_opt_int(raw, "remote_prefill_cached_tokens"),
        fingerprint=_fingerprint(raw.get(FINGERPRINT_KEY)),
        block_size=_opt_positive(raw, BLOCK_SIZE_KEY),
        guard_version=_opt_positive(raw, GUARD_KEY),
        verified_tokens=_opt_int(raw, VERIFIED_TOKENS_KEY),
        retention=_retention_mode(raw.get(RETENTION_MODE_KEY)),
        vllm_extra=_extra(raw),
    )


def parse_optional_remote_blocks(raw: object) -> RemoteBlocks | None:
    """Like ``parse_remote_blocks`` but ``None`` for absent/empty params (no KV retained)."""
    if raw is None or (isinstance(raw, Mapping) and not raw.get("remote_block_ids")):
        return None
    return parse_remote_blocks(raw)


def _fingerprint(raw: object) -> TokenFingerprint | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise KVParamsError(f"{FINGERPRINT_KEY} must be a string")
    try:
        return TokenFingerprint.from_str(raw)
    except FingerprintError as exc:
        raise KVParamsError(f"{FINGERPRINT_KEY}: {exc}") from None


def _extra(raw: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    """vLLM keys this module does not model, kept as JSON text (``_``-prefixed keys are
    vLLM's scheduler-internal marks and never travel)."""
    extra = [k for k in raw.keys() - _VLLM_KEYS if not k.startswith(("kvrelay_", "_"))]
    if not extra:
        return ()
    out: list[tuple[str, str]] = []
    for key in sorted(extra):
        try:
            out.append((key, json.dumps(raw[key], allow_nan=False)))
        except (TypeError, ValueError):
            raise KVParamsError(f"{key} is not JSON") from None
    return tuple(out)


def _opt_positive(raw: Mapping[str, object], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KVParamsError(f"{key} must be a positive integer")
    return value


def _block_ids(raw: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(raw, list) or not raw:
        raise KVParamsError("remote_block_ids must be a non-empty list")
    groups = raw if isinstance(raw[0], list) else [raw]
    out: list[tuple[int, ...]] = []
    for group in groups:
        if not isinstance(group, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in group
        ):
            raise KVParamsError("remote_block_ids must hold lists of integers")
        out.append(tuple(group))
    return tuple(out)


def _str(raw: Mapping[str, object], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise KVParamsError(f"{key} must be a non-empty string")
    return value


def _int(raw: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None and default is not None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVParamsError(f"{key} must be an integer")
    return value


def _opt_int(raw: Mapping[str, object], key: str) -> int | None:
    value = raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _retention_mode(value: object) -> RetentionMode | None:
    if value == "managed":
        return "managed"
    if value == "stock":
        return "stock"
    return None


def _opt_float(raw: Mapping[str, object], key: str) -> float | None:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
