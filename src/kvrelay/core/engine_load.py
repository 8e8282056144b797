"""A D's room for new work, read from vLLM's own gauges (``GET /metrics``).

D's retention syncs tell the router D's free and retained blocks, but only while D holds
retained turns, and only to the routers whose decode requests carried their URL. A D full
of live work with nothing retained, or one that other replicas or router-less traffic
filled, looked roomy to a replica, which then sent it new turns that waited 8.5 s while
another D sat idle (probe 10, finding R2). vLLM's ``/metrics`` says it to anyone:

* ``vllm:kv_cache_usage_perc{engine}``: the share of the KV cache in use (retained blocks
  included: they are allocated until D frees them);
* ``vllm:cache_config_info{engine,...}``: the cache's capacity, ``kv_cache_size_tokens``
  (group-aware, vLLM >= 0.32), else ``num_gpu_blocks`` x ``block_size``;
* ``vllm:num_requests_waiting_by_reason{engine,reason="capacity"}``: requests already
  waiting for the scheduler's capacity (blocks, a slot). Not ``num_requests_waiting``,
  which also counts the ``deferred`` ones, among them every D request still pulling its
  prompt's KV from P (``WAITING_FOR_REMOTE_KVS``): a busy D would always read as full
  (probe 11, finding 8). Where the split is not exported, ``num_requests_waiting``.

``room_from_metrics`` reads them as an ``EngineRoom``: the free tokens and the requests
waiting of the engine a new request would get (of a data-parallel D's engines, one label
each, the one with the fewest waiting, then the most free). Retained blocks are not room,
here as in D's own sync (``router.retention``): a turn goes to a D with free room rather
than make another D release a retained turn.

``max_model_len_from_models`` reads the other limit of what D takes, a request's length,
from ``GET /v1/models``: a follow-up D must refuse is not worth its conversation's KV
(``core.policy``, ``too_long``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import msgspec

USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
CACHE_INFO = "vllm:cache_config_info"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class EngineRoom:
    """What D's gauges said: ``free_tokens`` of its KV cache and ``num_waiting`` requests
    already waiting for capacity, on the engine a new request would get (one of a
    data-parallel D's: ``room_from_metrics``)."""

    free_tokens: int
    num_waiting: int
    waiting_by_engine: tuple[tuple[str, int], ...] = field(default=(), compare=False)
    """Each engine's requests waiting for capacity, by its ``engine`` label (a
    data-parallel D's rank index), where the gauges said (not compared: the room is the
    same room whatever the other engines hold)."""

    def waiting_on(self, engine: str) -> int | None:
        """The requests waiting for capacity on the engine labelled ``engine`` (``None``:
        not in the gauges)."""
        return dict(self.waiting_by_engine).get(engine)

    @property
    def tokens(self) -> int:
        """What a new request can get at once: nothing while requests wait (it would queue
        behind them), else the free tokens."""
        return 0 if self.num_waiting > 0 else self.free_tokens


def room_from_metrics(text: str) -> EngineRoom | None:
    """D's room from its ``/metrics`` text; ``None`` when the gauges needed are not there
    (not vLLM, or one too old). Of a D with several engines (data parallel behind one URL,
    one ``engine`` label per rank), the engine a new request would get: the fewest waiting
    for capacity, then the most free (vLLM's balancer avoids a rank with a queue; before,
    one rank's queue made the whole D read as full, probe 16)."""
    usage: dict[str, float] = {}
    capacity: dict[str, int] = {}
    waiting: dict[str, float] = {}
    waiting_for_capacity: dict[str, float] | None = None
    for line in text.splitlines():
        if not line.startswith(("vllm:kv_cache_usage_perc", "vllm:num_requests_waiting",
                                "vllm:cache_config_info")):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        name, raw_labels, raw_value = match.groups()
        labels = dict(_LABEL.findall(raw_labels or ""))
        engine = labels.get("engine", "")
        try:
            value = float(raw_value)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue  # a gauge no engine sets that way; never a number to act on
        if name == USAGE:
            usage[engine] = min(1.0, max(0.0, value))
        elif name == WAITING:
            waiting[engine] = waiting.get(engine, 0.0) + max(0.0, value)
        elif name == WAITING_BY_REASON and labels.get("reason") == "capacity":
            waiting_for_capacity = waiting_for_capacity or {}
            waiting_for_capacity[engine] = waiting_for_capacity.get(engine, 0.0) \
                + max(0.0, value)
        elif name == CACHE_INFO:
            tokens = _capacity_tokens(labels)
            if tokens is not None:
                capacity[engine] = tokens
    queued = waiting if waiting_for_capacity is None else waiting_for_capacity
    rooms = [(queued.get(e, 0.0), -(1.0 - usage[e]) * capacity[e])
             for e in usage if e in capacity]
    if not rooms:
        return None
    num_waiting, minus_free = min(rooms)
    by_engine = tuple(sorted((e, int(queued.get(e, 0.0))) for e in usage if e in capacity))
    return EngineRoom(free_tokens=int(-minus_free), num_waiting=int(num_waiting),
                      waiting_by_engine=by_engine)


def _capacity_tokens(labels: dict[str, str]) -> int | None:
    """An engine's KV cache in tokens, from its ``cache_config_info`` labels."""
    tokens = _positive_int(labels.get("kv_cache_size_tokens"))
    if tokens is not None:
        return tokens
    blocks = _positive_int(labels.get("num_gpu_blocks"))
    block_size = _positive_int(labels.get("block_size"))
    return blocks * block_size if blocks is not None and block_size is not None else None


def _positive_int(raw: str | None) -> int | None:
    if raw is None or not raw.isdigit():
        return None
    value = int(raw)
    return value if value > 0 else None


class _ModelCard(msgspec.Struct):
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard] = []


_MODELS = msgspec.json.Decoder(_ModelList)


def max_model_len_from_models(body: bytes) -> int | None:
    """The most tokens (prompt and output) D accepts for one request, from its
    ``GET /v1/models`` (vLLM's model cards carry ``max_model_len``): the smallest of its
    served models' (a LoRA adapter is a card of its own, with the base model's length);
    ``None`` when no card says it, or the body is not such a list."""
    try:
        cards = _MODELS.decode(body).data
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    lengths = [c.max_model_len for c in cards if c.max_model_len is not None
               and c.max_model_len > 0]
    return min(lengths) if lengths else None
