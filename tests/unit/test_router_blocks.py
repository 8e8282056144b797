"""D's block layout on captured vLLM 0.32 params: the block size inferred from a block list,
lists trimmed to what the tokens need, too-short lists refused (``kvrelay.router.blocks``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvrelay.core.params import parse_remote_blocks
from kvrelay.router.blocks import LayoutError, infer_block_size, retained_layout

DATA = Path(__file__).parents[1] / "data" / "vllm-0.32.0"


def load(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def test_block_layout_of_captured_params() -> None:
    d1 = parse_remote_blocks(load("chat_turn1.json")["d1"]["kv_transfer_params"])
    assert (d1.num_tokens, len(d1.block_ids[0])) == (2056, 17)
    assert infer_block_size(d1) == 128
    blocks, bs = retained_layout(d1, None)
    assert (blocks, bs) == (d1, 128)
    trimmed, bs = retained_layout(d1, 256)  # 2056 tokens fit in 9 blocks of 256
    assert bs == 256 and len(trimmed.block_ids[0]) == 9
    with pytest.raises(LayoutError):
        retained_layout(d1, 64)  # would need 33 blocks
    odd = parse_remote_blocks({**load("chat_turn1.json")["d1"]["kv_transfer_params"],
                               "remote_block_ids": [list(range(20))]})
    assert infer_block_size(odd) is None
