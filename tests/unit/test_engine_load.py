"""D's room read from vLLM's own gauges, and its ``max_model_len`` from its ``/v1/models``
(``core.engine_load``)."""

from __future__ import annotations

import json

import pytest

from kvrelay.core.engine_load import EngineRoom, max_model_len_from_models, room_from_metrics

INFO = ('vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="%s",'
        'kv_cache_size_tokens="%s",num_gpu_blocks="%s",prefix_caching_hash_algo="sha256",'
        'sliding_window="None",swap_space="4.0"} 1.0')


def text(*lines: str) -> str:
    return "\n".join(["# HELP vllm:kv_cache_usage_perc KV-cache usage.",
                      "# TYPE vllm:kv_cache_usage_perc gauge", *lines, ""])


def test_free_tokens_are_the_free_share_of_the_cache() -> None:
    room = room_from_metrics(text(
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
        INFO % ("0", "4096", "256")))
    assert room == EngineRoom(free_tokens=1024, num_waiting=0) and room.tokens == 1024


def test_requests_waiting_leave_no_room_whatever_the_usage() -> None:
    room = room_from_metrics(text(
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0',
        INFO % ("0", "4096", "256")))
    assert room is not None and room.num_waiting == 2 and room.tokens == 0


def test_blocks_times_block_size_without_a_token_capacity() -> None:
    """vLLM before ``kv_cache_size_tokens`` (or ``None`` there): ``num_gpu_blocks`` x
    ``block_size``."""
    room = room_from_metrics(text(
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
        INFO % ("0", "None", "100")))
    assert room == EngineRoom(free_tokens=800, num_waiting=0)


def test_the_engine_a_new_request_would_get_counts() -> None:
    """Data parallel: a request lands on one engine, and vLLM's balancer avoids one with a
    queue: the fewest waiting, then the most free. One rank's queue made the whole D read
    as full (probe 16)."""
    lines = ['vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75',
             'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
             INFO % ("0", "1000", "10"), INFO % ("1", "1000", "10")]
    assert room_from_metrics(text(*lines)) == EngineRoom(free_tokens=750, num_waiting=0)

    def waiting(rank0: float, rank1: float) -> list[str]:
        return [f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {rank0}',
                f'vllm:num_requests_waiting{{engine="1",model_name="m"}} {rank1}']

    assert room_from_metrics(text(*lines, *waiting(1, 1))) == EngineRoom(750, 1)
    assert room_from_metrics(text(*lines, *waiting(2, 0))) == EngineRoom(750, 0)
    assert room_from_metrics(text(*lines, *waiting(0, 2))) == EngineRoom(250, 0)
    assert room_from_metrics(text(*lines, *waiting(3, 2))).tokens == 0  # type: ignore[union-attr]
    room = room_from_metrics(text(*lines, *waiting(3, 0)))
    assert room is not None and (room.waiting_on("0"), room.waiting_on("1")) == (3, 0)
    assert room.waiting_on("2") is None


def test_no_room_is_known_without_the_gauges() -> None:
    assert room_from_metrics("") is None
    assert room_from_metrics(text('vllm:kv_cache_usage_perc{engine="0"} 0.5')) is None
    assert room_from_metrics(INFO % ("0", "4096", "256")) is None
    assert room_from_metrics(text('vllm:kv_cache_usage_perc{engine="0"} nope',
                                  INFO % ("0", "4096", "256"))) is None


def test_only_requests_waiting_for_capacity_leave_no_room() -> None:
    """vLLM's ``num_requests_waiting`` also counts the ``deferred`` requests, among them every
    D request still pulling its KV from P: with the split exported, only ``capacity`` counts
    (probe 11, finding 8)."""
    lines = ['vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
             'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
             INFO % ("0", "4096", "256")]
    by_reason = 'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="%s"} %s'
    pulling = [by_reason % ("capacity", "0.0"), by_reason % ("deferred", "3.0")]
    assert room_from_metrics(text(*lines, *pulling)) == EngineRoom(2048, 0)
    queued = [by_reason % ("capacity", "1.0"), by_reason % ("deferred", "2.0")]
    room = room_from_metrics(text(*lines, *queued))
    assert room == EngineRoom(2048, 1) and room.tokens == 0
    assert room_from_metrics(text(*lines)) == EngineRoom(2048, 3)  # no split: all of them


def test_gauges_that_are_not_numbers_are_not_read() -> None:
    for value in ("NaN", "+Inf", "-Inf"):
        assert room_from_metrics(text(
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {value}',
            INFO % ("0", "4096", "256"))) is None
        room = room_from_metrics(text(
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {value}',
            INFO % ("0", "4096", "256")))
        assert room == EngineRoom(2048, 0)


def card(model_id: str, max_model_len: object) -> dict[str, object]:
    return {"id": model_id, "object": "model", "owned_by": "vllm", "root": "/models/m",
            "parent": None, "max_model_len": max_model_len, "permission": []}


def test_max_model_len_is_the_smallest_a_served_model_card_says() -> None:
    body = {"object": "list", "data": [card("m", 4096), card("m-lora", 2048)]}
    assert max_model_len_from_models(json.dumps(body).encode()) == 2048


@pytest.mark.parametrize("body", [
    b'{"object": "list", "data": []}',
    json.dumps({"data": [card("m", None)]}).encode(),
    json.dumps({"data": [card("m", 0)]}).encode(),
    json.dumps({"data": [card("m", "4096")]}).encode(),
    b'{"data": "nope"}',
    b"<html>not found</html>",
    b"",
])
def test_no_max_model_len_when_no_card_says_one(body: bytes) -> None:
    assert max_model_len_from_models(body) is None
