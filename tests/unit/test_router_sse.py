"""``router.sse.StreamScan`` takes D's ``kv_transfer_params`` out of a relayed stream: none on
vLLM 0.32 streams; on 0.33 the final chunk's value, ``null`` included (D retained nothing),
told apart from a stream that never carried the key."""

from __future__ import annotations

import json
from typing import Any

from kvrelay.router.sse import SSE_DONE, Rewrite, StreamScan

PARAMS = {"do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[3, 4]],
          "remote_registration_generation": 1}


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chunk(text: str, *, final: bool = False, **top: Any) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None,
              "finish_reason": "length" if final else None}
    return event({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice],
                  **top})


def relay(*events: bytes) -> tuple[StreamScan, bytes]:
    scan = StreamScan(Rewrite())
    out = b"".join(scan.feed(e) for e in (*events, SSE_DONE))
    assert scan.done
    return scan, out


def test_a_032_stream_carries_no_params() -> None:
    scan, out = relay(chunk("a"), chunk("b", final=True))
    assert (scan.params_seen, scan.params) == (False, None)
    assert out == chunk("a") + chunk("b", final=True) + SSE_DONE  # passed through as is
    assert scan.answer()[0] == "ab"


def test_a_033_stream_gives_the_final_chunks_params_and_hides_every_one() -> None:
    scan, out = relay(chunk("a", kv_transfer_params=None),
                      chunk("b", final=True, kv_transfer_params=PARAMS))
    assert (scan.params_seen, scan.params) == (True, PARAMS)
    assert b"kv_transfer_params" not in out and b"registration" not in out
    assert scan.answer()[0] == "ab"


def test_a_033_final_chunk_with_null_params_means_nothing_retained() -> None:
    scan, out = relay(chunk("a", kv_transfer_params=None),
                      chunk("b", final=True, kv_transfer_params=None))
    assert (scan.params_seen, scan.params) == (True, None)
    assert b"kv_transfer_params" not in out
