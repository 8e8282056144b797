"""kvrelay's connector on D with vLLM's real NIXL scheduler side (config and engine faked):
a turn's own deadline, a release under pressure asked of the router and made through
vLLM's TTL path (the worker's own expiry sweep frees it), and what P's read check can and
cannot see."""

from __future__ import annotations

import collections
import queue
import time
import types
from collections.abc import Iterator

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvrelay.core.retention_sync import RetentionOrders
from kvrelay.core.return_curve import ReturnCurve
from kvrelay.vllm_plugin.connector import NixlConnector
from kvrelay.vllm_plugin.retention import TurnState
from tests.retention_router import StandInRouter

ns = types.SimpleNamespace
TTL_S = 120
BLOCK_SIZE = 128
NUM_BLOCKS = 24


def d_connector(*, kv_cache_groups: int = 0, **extra: object) -> NixlConnector:
    settings = {"bidirectional_kv_xfer": True, "decoder_kv_blocks_ttl": TTL_S, **extra}
    transfer = ns(get_from_extra_config=lambda key, default: settings.get(key, default),
                  kv_buffer_device="cpu", engine_id="d-engine", kv_role="kv_consumer")
    config = ns(
        parallel_config=ns(tensor_parallel_size=1, decode_context_parallel_size=1,
                           data_parallel_index=0, pipeline_parallel_size=1,
                           prefill_context_parallel_size=1),
        cache_config=ns(block_size=BLOCK_SIZE), kv_transfer_config=transfer,
        scheduler_config=ns(disable_hybrid_kv_cache_manager=True),
        num_prefill_lookahead_tokens=0)
    groups = [ns(kv_cache_spec=ns(block_size=BLOCK_SIZE, prefix_replay_tokens=0),
                 layer_names=[])] * kv_cache_groups
    kv_cache_config = ns(transfer_groups=[], has_mamba_layers=False, kv_cache_groups=groups,
                         select_transfer_block_ids=lambda block_ids: block_ids,
                         num_blocks=NUM_BLOCKS, kv_cache_tensors=[ns(size=NUM_BLOCKS * 4096)])
    return NixlConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


class Pool:
    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def finished(request_id: str, params: dict[str, object], num_tokens: int = 1500) -> object:
    prompt = list(range(num_tokens - 10))
    return ns(request_id=request_id, status=RequestStatus.FINISHED_STOPPED,
              kv_transfer_params=params, num_computed_tokens=num_tokens,
              prompt_token_ids=prompt, output_token_ids=list(range(10)),
              num_prompt_tokens=len(prompt), num_output_tokens=10)


def waiting(request_id: str, num_tokens: int = 1500) -> types.SimpleNamespace:
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "p-engine", "remote_request_id": "p1",
              "remote_host": "127.0.0.1", "remote_port": 5600, "remote_num_tokens": num_tokens}
    return ns(request_id=request_id, kv_transfer_params=params, num_tokens=num_tokens,
              num_prompt_tokens=num_tokens, prompt_token_ids=list(range(num_tokens)),
              block_hashes=[f"h{i}".encode() for i in range(num_tokens // BLOCK_SIZE)])


class Worker:
    """The state vLLM's pull worker keeps for D's retained requests, driven by vLLM's own
    ``start_load_kv`` and ``_reap_expired_send_leases``."""

    def __init__(self) -> None:
        self._ready_requests: queue.Queue[object] = queue.Queue()
        self.pcp_rank = 0
        self.pcp_dcp_sharded = False
        self._reqs_to_process: set[str] = set()
        self._reqs_to_send: dict[str, float] = {}
        self.consumer_notification_counts_by_req: dict[str, int] = collections.defaultdict(int)
        self.expected_consumer_notifications_by_req: dict[str, int] = {}
        self.xfer_stats = ns(record_kv_expired_req=lambda: None)

    def _send_heartbeats(self, metadata: object) -> None:
        pass

    def step(self, metadata: object) -> set[str]:
        NixlPullConnectorWorker.start_load_kv(self, metadata)  # type: ignore[arg-type]
        done: set[str] = set()
        NixlBaseConnectorWorker._reap_expired_send_leases(self, done)  # type: ignore[arg-type]
        return done


@pytest.fixture
def router() -> Iterator[StandInRouter]:
    stand_in = StandInRouter()
    yield stand_in
    stand_in.close()


def retained_params(url: str, **keys: object) -> dict[str, object]:
    return {"do_remote_prefill": False, "_remote_blocks_processed": True,
            "kvrelay_retention_url": url, **keys}


def retain(conn: NixlConnector, request_id: str, params: dict[str, object],
           block_ids: list[int] | None = None) -> dict:
    conn.connector_scheduler._reqs_in_batch.add(request_id)  # admitted as vLLM does
    ids = list(range(12)) if block_ids is None else block_ids
    delay, out = conn.request_finished(finished(request_id, params), ids)
    assert delay
    return out


def test_retain_s_becomes_the_turns_own_vllm_deadline_clamped_to_the_ttl(router):
    conn = d_connector()
    conn.bind_kv_cache_manager(ns(block_pool=Pool(12), watermark_blocks=0))
    before = time.perf_counter()
    short = retain(conn, "short", retained_params(router.url, kvrelay_retain_s=30))
    long = retain(conn, "long", retained_params(router.url, kvrelay_retain_s=10_000))
    pending = conn.connector_scheduler._reqs_need_send
    assert before + 30 <= short["remote_blocks_expiry_time"] == pending["short"]
    assert pending["short"] < before + 31
    assert pending["long"] == long["remote_blocks_expiry_time"] >= before + TTL_S
    ledger = conn._retention.ledger
    assert ledger.retained_blocks == 24 and ledger.retained_tokens == 3000


def test_the_return_curve_reaches_the_ledger_and_a_bad_one_is_ignored(router):
    conn = d_connector()
    conn.bind_kv_cache_manager(ns(block_pool=Pool(12), watermark_blocks=0))
    retain(conn, "curve", retained_params(router.url, kvrelay_retain_s=30,
                                          kvrelay_return_curve=[0.7, 1.5, 0.5]))
    retain(conn, "bad", retained_params(router.url, kvrelay_retain_s=30,
                                        kvrelay_return_curve=[7, 1.5, 0.5]))
    retain(conn, "none", retained_params(router.url, kvrelay_retain_s=30))
    turns = {t.request_id: t for t in conn._retention.ledger.turns()}
    assert turns["curve"].curve == ReturnCurve(0.7, 1.5, 0.5)
    assert turns["bad"].curve is None and turns["none"].curve is None


def test_pressure_waits_for_the_routers_answer_then_vllms_sweep_frees_the_turn(router):
    conn = d_connector()
    pool = Pool(free=0)
    conn.bind_kv_cache_manager(ns(block_pool=pool, watermark_blocks=0))
    worker = Worker()
    retain(conn, "old", retained_params(router.url, kvrelay_retain_s=60))
    assert worker.step(conn.build_connector_meta(ns())) == set()
    assert worker._reqs_to_send["old"] > time.perf_counter() + 50, "vLLM holds it ~60 s"

    router.answer = RetentionOrders(dropped=("old",))
    assert conn.get_num_new_matched_tokens(waiting("new"), 0) == (None, False), \
        "the waiting request is skipped while its blocks are freed"
    assert conn.has_pending_block_frees(), "and running requests wait instead of preempting"
    assert router.got.wait(10)
    assert router.syncs[-1]["releasing"] == ["old"]
    assert router.syncs[-1]["engine_id"] == "d-engine"
    assert (router.syncs[-1]["num_blocks_total"], router.syncs[-1]["bytes_per_block"]) == (
        NUM_BLOCKS, 4096), "D's numbers come from its own KV cache config"

    done: set[str] = set()
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:  # the sync thread hands the answer over
        done = worker.step(conn.build_connector_meta(ns()))
        time.sleep(0.01)
    assert done == {"old"}, "vLLM's own expiry sweep frees the released turn"

    router.got.clear()
    pool.free = 12
    conn.update_connector_output(KVConnectorOutput(finished_sending={"old"}))
    assert "old" not in conn._retention.ledger and not conn.has_pending_block_frees()
    assert conn._retention.ledger.releases_total["pressure"] == 1
    conn.build_connector_meta(ns())
    assert router.got.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(s["released"] for s in router.syncs):
        time.sleep(0.01)
    told = [s for s in router.syncs if s["released"]]
    assert told and told[0]["released"] == [{"request_id": "old", "cause": "pressure"}]


def test_a_turn_the_router_leaves_out_stays_and_the_request_fits_once_blocks_free(router):
    conn = d_connector()
    pool = Pool(free=0)
    conn.bind_kv_cache_manager(ns(block_pool=pool, watermark_blocks=0))
    retain(conn, "being-read", retained_params(router.url))
    conn.build_connector_meta(ns())  # the step it finished in: vLLM's TTL deadline goes out
    router.answer = RetentionOrders()  # a P leg reads it: not dropped
    assert conn.get_num_new_matched_tokens(waiting("new"), 0) == (None, False)
    assert router.got.wait(10)
    for _ in range(20):
        assert "being-read" not in conn.build_connector_meta(ns()).reqs_to_send
    assert conn._retention.ledger.state("being-read") is TurnState.RELEASING
    pool.free = 13  # P's read completed elsewhere and freed enough
    count, load_async = conn.get_num_new_matched_tokens(waiting("new"), 0)
    assert (count, load_async) == (1500, True), "then the request goes to vLLM as usual"


def test_turns_without_a_router_and_stock_mode_leave_pressure_to_vllm(router):
    for conn, params in ((d_connector(), {"do_remote_prefill": False}),
                         (d_connector(kvrelay_retention="stock"), retained_params(router.url))):
        conn.bind_kv_cache_manager(ns(block_pool=Pool(0), watermark_blocks=0))
        retain(conn, "old", params)
        assert conn.get_num_new_matched_tokens(waiting("new"), 0) == (1500, True)
        assert not conn.has_pending_block_frees()
    stock = d_connector(kvrelay_retention="stock")
    kept = retain(stock, "kept", retained_params(router.url, kvrelay_retain_s=5))
    assert kept["remote_blocks_expiry_time"] >= time.perf_counter() + TTL_S - 5, \
        "stock keeps vLLM's global TTL"
    assert kept["kvrelay_retention"] == "stock", "and says so, so the router's entry does too"
    managed = d_connector()
    managed.bind_kv_cache_manager(ns(block_pool=Pool(12), watermark_blocks=0))
    told = retain(managed, "told", retained_params(router.url, kvrelay_retain_s=5))
    assert told["kvrelay_retention"] == "managed"
    with pytest.raises(ValueError):
        d_connector(kvrelay_retention="sometimes")
    with pytest.raises(ValueError):
        d_connector(kvrelay_retention_headroom=1.5)


def test_p_declines_a_read_near_the_stamped_deadline_but_cannot_see_an_early_release(router):
    """Why D asks the router before it frees a turn under pressure: vLLM's only decline of
    a stale D->P read is P's check against the deadline stamped in the params."""
    conn = d_connector()
    conn.bind_kv_cache_manager(ns(block_pool=Pool(12), watermark_blocks=0))
    near = retain(conn, "near", retained_params(router.url, kvrelay_retain_s=2))
    far = retain(conn, "far", retained_params(router.url, kvrelay_retain_s=60))
    p_worker = ns(_engine_clock_offset={"d-engine": 0.0})

    def p_declines(params: dict) -> bool:
        read = ns(remote=ns(blocks_expiry_time=params["remote_blocks_expiry_time"],
                            engine_id="d-engine"), local_physical_block_ids=[[1]])
        return NixlPullConnectorWorker._is_turn2_read_expired(p_worker, read)  # type: ignore

    assert p_declines(near), "a short kvrelay_retain_s is declined by P like vLLM's TTL"
    assert not p_declines(far), "P would read a turn D freed early: only the router can stop it"


class CachedPool(Pool):
    """A block pool whose prefix cache holds blocks by hash, each with a reference count
    (``BlockPool.get_cached_block``; ``KVCacheBlock.ref_cnt``: 0 in the free queue)."""

    def __init__(self, free: int, ref_cnt: dict[bytes, int],
                 holders: dict[int, int] | None = None) -> None:
        super().__init__(free)
        self.ref_cnt = ref_cnt
        self.lookups: list[tuple[bytes, list[int]]] = []
        counts = holders or {}
        self.blocks = [ns(ref_cnt=counts.get(i, 0), is_null=i == 0) for i in range(NUM_BLOCKS)]

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[object] | None:
        self.lookups.append((block_hash, group_ids))
        if block_hash not in self.ref_cnt:
            return None
        return [ns(ref_cnt=self.ref_cnt[block_hash])]


def test_a_prompt_shared_with_a_held_turn_needs_only_its_own_blocks(router):
    """A new conversation whose first 9 blocks (an agent's system prompt and tools) D holds
    for another conversation's retained turn needs 3 more blocks for its 1,500 tokens, not
    12: with 4 free it is admitted at once, and the retained turn that shares its prefix is
    not asked for."""
    conn = d_connector(kv_cache_groups=1)
    shared = {f"h{i}".encode(): 1 for i in range(9)}  # held by "other"'s retained turn
    pool = CachedPool(free=4, ref_cnt=shared)
    conn.bind_kv_cache_manager(ns(block_pool=pool, watermark_blocks=0))
    retain(conn, "other", retained_params(router.url, kvrelay_retain_s=60))
    count, load_async = conn.get_num_new_matched_tokens(waiting("new"), 9 * BLOCK_SIZE)
    assert (count, load_async) == (1500 - 9 * BLOCK_SIZE, True)
    assert conn._retention.ledger.state("other") is TurnState.HELD
    assert not conn._retention.ledger.has_pending()
    assert [h for h, _ in pool.lookups] == list(shared) and \
        {tuple(g) for _, g in pool.lookups} == {(0,)}


def test_hit_blocks_in_the_free_queue_count_as_blocks_to_take(router):
    """The same hit, its blocks free (reference count 0, as after the turn holding them
    was read): admitting the request takes them off the free queue as vLLM counts it, so
    with 4 free D asks for the retained turn."""
    conn = d_connector(kv_cache_groups=1)
    pool = CachedPool(free=4, ref_cnt={f"h{i}".encode(): 0 for i in range(9)})
    conn.bind_kv_cache_manager(ns(block_pool=pool, watermark_blocks=0))
    retain(conn, "other", retained_params(router.url, kvrelay_retain_s=60))
    assert conn.get_num_new_matched_tokens(waiting("new"), 9 * BLOCK_SIZE) == (None, False)
    assert conn._retention.ledger.state("other") is TurnState.RELEASING


def test_with_several_kv_cache_groups_every_hit_block_counts_as_free(router):
    """Hits are looked up in one KV cache group only; with more (hybrid models) every hit
    block counts as one to take, as before the lookup (errs towards asking more)."""
    conn = d_connector(kv_cache_groups=2)
    pool = CachedPool(free=4, ref_cnt={f"h{i}".encode(): 1 for i in range(9)})
    conn.bind_kv_cache_manager(ns(block_pool=pool, watermark_blocks=0))
    retain(conn, "other", retained_params(router.url, kvrelay_retain_s=60))
    assert conn.get_num_new_matched_tokens(waiting("new"), 9 * BLOCK_SIZE) == (None, False)
    assert pool.lookups == []


@pytest.mark.parametrize(("num_tokens", "newer"), [(300, TurnState.RELEASING),
                                                    (200, TurnState.HELD)])
def test_a_release_under_pressure_counts_only_blocks_no_other_request_holds(
        router, num_tokens: int, newer: TurnState):
    """Two retained turns of one conversation share its history (blocks 1-10, two holders
    each); the older holds blocks 11-12 of its own, the newer 13-14. With none free, a
    request needing 3 blocks (300 tokens): releasing the older frees 2, not 12, so D asks
    for both (14); one needing 2 (200 tokens): the older alone."""
    conn = d_connector(kv_cache_groups=1)
    holders = {**dict.fromkeys(range(1, 11), 2), 11: 1, 12: 1, 13: 1, 14: 1}
    conn.bind_kv_cache_manager(ns(block_pool=CachedPool(0, {}, holders), watermark_blocks=0))
    retain(conn, "older", retained_params(router.url, kvrelay_retain_s=60), list(range(1, 13)))
    retain(conn, "newer", retained_params(router.url, kvrelay_retain_s=60),
           [*range(1, 11), 13, 14])
    turns = {t.request_id: t for t in conn._retention.ledger.turns()}
    assert turns["newer"].block_ids == (*range(1, 11), 13, 14)
    request = waiting("new", num_tokens=num_tokens)
    assert conn.get_num_new_matched_tokens(request, 0) == (None, False)
    ledger = conn._retention.ledger
    assert ledger.state("older") is TurnState.RELEASING and ledger.state("newer") is newer
