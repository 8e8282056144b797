"""Field stripping and token-id collection on the captured vLLM 0.32 responses."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kvrelay.router.streaming import SSE_DONE, Collected, collect, relay_chunk, sse_data, strip

from kvrelay.core.params import parse_remote_blocks
from kvrelay.router.blocks import LayoutError, infer_block_size, retained_layout

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def test_completions_response_ids_collected_and_stripped() -> None:
    body = load("completions.json")["d"]
    got = Collected()
    collect(body, got)
    assert got.prompt_token_ids == body["choices"][0]["prompt_token_ids"]
    assert got.generated_token_ids == [49, 42, 91, 113, 90, 42, 41, 95]
    assert got.kv_transfer_params == body["kv_transfer_params"]
    stripped = copy.deepcopy(body)
    strip(stripped, keep_token_ids=False)
    assert set(body) - set(stripped) == {"kv_transfer_params"}
    assert set(body["choices"][0]) - set(stripped["choices"][0]) == {
        "token_ids", "prompt_token_ids"}
    kept = copy.deepcopy(body)
    strip(kept, keep_token_ids=True)
    assert kept["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]
    assert "kv_transfer_params" not in kept


def test_chat_stream_chunks_pass_through_untouched_without_internal_fields() -> None:
    for line in load("chat_stream.json")["d_stream"]:
        data = line.removeprefix("data: ")
        out = relay_chunk(data, None, keep_token_ids=False)
        if data == "[DONE]":
            assert out is SSE_DONE
        else:
            assert out == f"data: {data}\n\n".encode()  # byte for byte


def test_chat_stream_with_ids_collects_and_strips() -> None:
    got = Collected()
    first = {"id": "x", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
             "prompt_token_ids": [1, 2, 3]}
    token = {"id": "x", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [97]}]}
    final = {"id": "x", "choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [98],
                                     "finish_reason": "length"}],
             "kv_transfer_params": {"do_remote_decode": True}}
    outs = [relay_chunk(json.dumps(c), got, keep_token_ids=False) for c in (first, token, final)]
    assert got.prompt_token_ids == [1, 2, 3] and got.generated_token_ids == [97, 98]
    assert got.kv_transfer_params == {"do_remote_decode": True}
    parsed = [json.loads(o.decode()[6:]) for o in outs]
    assert "prompt_token_ids" not in parsed[0]
    assert "token_ids" not in parsed[1]["choices"][0]
    assert "kv_transfer_params" not in parsed[2]
    assert relay_chunk("[DONE]", got, keep_token_ids=False) is SSE_DONE and got.saw_done


async def test_sse_data_framing() -> None:
    async def lines() -> AsyncIterator[str]:
        for line in ["data: {\"a\":1}", "", ": comment", "data:{\"b\":2}", "", "data: [DONE]"]:
            yield line

    assert [d async for d in sse_data(lines())] == ['{"a":1}', '{"b":2}', "[DONE]"]


def test_block_layout_of_captured_params() -> None:
    d1 = parse_remote_blocks(load("chat_turn1.json")["d1"]["kv_transfer_params"])
    assert (d1.num_tokens, len(d1.block_ids[0])) == (2056, 17)
    assert infer_block_size(d1) == 128
    blocks, bs = retained_layout(d1, None)
    assert (blocks, bs) == (d1, 128)
    trimmed, bs = retained_layout(d1, 256)  # 2056 tokens fit in 9 blocks of 256
    assert bs == 256 and len(trimmed.block_ids[0]) == 9
    try:
        retained_layout(d1, 64)  # would need 33 blocks
    except LayoutError:
        pass
    else:
        raise AssertionError("a too short block list was accepted")
    odd = parse_remote_blocks({**load("chat_turn1.json")["d1"]["kv_transfer_params"],
                               "remote_block_ids": [list(range(20))]})
    assert infer_block_size(odd) is None
