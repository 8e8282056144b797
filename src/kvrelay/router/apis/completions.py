"""``POST /v1/completions``: a prompt's text (or token ids) is the history.

The canonical history is the prompt's UTF-8 bytes, or ``pack_token_ids`` of a token-id
prompt (its context marked ``ids``), which core cuts into blocks (``text_identity``); the
answer the next turn carries is D's text (or output ids) appended to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.core.identity import History, pack_token_ids
from kvrelay.router.apis.base import ApiRequest
from kvrelay.router.apis.chat import openai_user, output_budget, sampling_fields
from kvrelay.router.apis.chunks import OpenAIChunks
from kvrelay.router.apis.fields import JsonObject, context_bytes
from kvrelay.router.errors import ClientError

CONTEXT_FIELDS = ("model", "add_special_tokens")


class CompletionsAdapter(OpenAIChunks):
    """The completions API (module docstring)."""

    __slots__ = ()
    endpoint = "completions"
    tokenizable = True
    path = "/v1/completions"

    def conversation_hint(self, body: JsonObject, headers: Mapping[str, str]) -> str | None:
        return None

    def end_user(self, body: JsonObject) -> str | None:
        return openai_user(body)

    def parse(self, body: JsonObject) -> ApiRequest:
        stream, options = sampling_fields(body)
        max_tokens = output_budget(body)
        prompt = _prompt(body)
        context = context_bytes(body, CONTEXT_FIELDS)
        ids: tuple[int, ...] | None = None
        if isinstance(prompt, str):
            history = History("completions", context, text=prompt.encode("utf-8"))
        else:
            ids = tuple(prompt)
            history = History("completions", b"ids" + context, text=pack_token_ids(ids))
        return ApiRequest(
            history=history,
            stream=stream,
            include_usage=stream and bool(options and options.get("include_usage")),
            wants_token_ids=bool(body.get("return_token_ids")),
            max_output_tokens=max_tokens,
            prompt_token_ids=ids,
        )

    def tokenize_body(self, body: JsonObject, req: ApiRequest) -> JsonObject | None:
        if req.prompt_token_ids is not None:
            return None
        prompt = body["prompt"]
        out = {"prompt": prompt[0] if isinstance(prompt, list) else prompt}
        for k in CONTEXT_FIELDS:
            if k in body:
                out[k] = body[k]
        return out


def _prompt(body: Mapping[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise ClientError("batched prompts are not supported by the P/D router", "prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ClientError("prompt must not be empty", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt
        )
    ):
        return prompt
    raise ClientError("prompt must be a string or a list of token ids", "prompt")
