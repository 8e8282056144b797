"""A direct P/D client: one turn = a prefill request on P, then the decode request on D.

This is the protocol with no router in between, used to check the local cluster itself (e2e
tests, ``scripts/bench_pull.py``). Reuse is explicit: pass D's retained params of the
previous turn as ``reuse`` to make P pull them instead of recomputing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

from kvrelay.client.prometheus import parse_prometheus
from kvrelay.client.sse import chunk_content, line_chunks, usage_of
from kvrelay.core.params import (
    RemoteBlocks,
    parse_optional_remote_blocks,
    parse_remote_blocks,
    request_remote_decode,
)

Message = Mapping[str, object]


@dataclass(frozen=True)
class PrefillResult:
    blocks: RemoteBlocks
    prompt_tokens: int
    seconds: float


@dataclass(frozen=True)
class TurnResult:
    """One P->D turn: what P did, what D generated, and what D retained for the next turn."""

    prefill: PrefillResult
    text: str
    completion_tokens: int
    ttft_s: float
    e2e_s: float
    retained: RemoteBlocks | None


class PDClient:
    """Synchronous client for one P and one D vLLM server (OpenAI chat API)."""

    def __init__(self, prefill_url: str, decode_url: str, model: str, timeout_s: float = 900):
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.model = model
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PDClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prefill(self, messages: Sequence[Message], reuse: RemoteBlocks | None) -> PrefillResult:
        """P computes (or pulls, given ``reuse``) the prompt's KV and returns P's params."""
        params = reuse.to_json() if reuse is not None else request_remote_decode()
        body = self._body(messages, max_tokens=1, kv_transfer_params=params)
        started = time.perf_counter()
        resp = self._http.post(f"{self.prefill_url}/v1/chat/completions", json=body)
        seconds = time.perf_counter() - started
        _raise_for_status(resp)
        data = resp.json()
        return PrefillResult(
            blocks=parse_remote_blocks(data["kv_transfer_params"]),
            prompt_tokens=int(data["usage"]["prompt_tokens"]),
            seconds=seconds,
        )

    def turn(
        self,
        messages: Sequence[Message],
        max_tokens: int,
        reuse: RemoteBlocks | None = None,
        stream: bool = False,
        decode_params: Mapping[str, object] | None = None,
    ) -> TurnResult:
        """Prefill on P (pulling ``reuse`` if given), then decode on D.

        ``stream=True`` measures TTFT as the time to D's first content chunk. vLLM 0.32 does
        not put D's retained params on streamed chunks (0.33 does: then they are read from
        the final chunk), so a turn whose params the next turn needs is run non-streamed;
        its ``ttft_s`` is then P's time plus the mean decode step. ``decode_params`` are
        extra keys for D's ``kv_transfer_params`` (kvrelay's ``kvrelay_*`` keys).
        """
        started = time.perf_counter()
        pre = self.prefill(messages, reuse)
        body = self._body(messages, max_tokens=max_tokens,
                          kv_transfer_params={**pre.blocks.to_json(), **(decode_params or {})})
        if stream:
            return self._streamed_decode(body, pre, started)
        resp = self._http.post(f"{self.decode_url}/v1/chat/completions", json=body)
        e2e = time.perf_counter() - started
        _raise_for_status(resp)
        data = resp.json()
        completion_tokens = int(data["usage"]["completion_tokens"])
        return TurnResult(
            prefill=pre,
            text=str(data["choices"][0]["message"]["content"] or ""),
            completion_tokens=completion_tokens,
            ttft_s=pre.seconds + (e2e - pre.seconds) / max(1, completion_tokens),
            e2e_s=e2e,
            retained=parse_optional_remote_blocks(data.get("kv_transfer_params")),
        )

    def _streamed_decode(
        self, body: dict[str, object], pre: PrefillResult, started: float
    ) -> TurnResult:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        text: list[str] = []
        ttft: float | None = None
        completion_tokens = 0
        retained: RemoteBlocks | None = None
        url = f"{self.decode_url}/v1/chat/completions"
        with self._http.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for_status(resp)
            for chunk in line_chunks(resp.iter_lines()):
                delta = chunk_content(chunk)
                if delta:
                    ttft = ttft if ttft is not None else time.perf_counter() - started
                    text.append(delta)
                usage = usage_of(chunk)
                if usage is not None and usage.completion_tokens is not None:
                    completion_tokens = usage.completion_tokens
                if chunk.get("kv_transfer_params"):
                    retained = parse_optional_remote_blocks(chunk["kv_transfer_params"])
        e2e = time.perf_counter() - started
        return TurnResult(
            prefill=pre,
            text="".join(text),
            completion_tokens=completion_tokens,
            ttft_s=ttft if ttft is not None else e2e,
            e2e_s=e2e,
            retained=retained,
        )

    def metrics(self, url: str) -> dict[str, float]:
        """A vLLM server's Prometheus counters, keyed ``name{labels}`` (for assertions)."""
        resp = self._http.get(f"{url.rstrip('/')}/metrics")
        _raise_for_status(resp)
        return parse_prometheus(resp.text)

    def _body(self, messages: Sequence[Message], **extra: object) -> dict[str, object]:
        return {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "temperature": 0.0,
            **extra,
        }


def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code >= 400:
        try:
            detail = json.dumps(resp.json())[:2000]
        except ValueError:
            detail = resp.text[:2000]
        raise RuntimeError(f"{resp.request.url} -> HTTP {resp.status_code}: {detail}")
