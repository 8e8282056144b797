"""Response bodies and SSE chunks shaped exactly like vLLM 0.32's or 0.33's OpenAI server.

Field sets and order follow vLLM's pydantic models as serialized by its server: non-streamed
responses dump every field (``None`` as ``null``); streamed chunks use ``exclude_unset`` (only
the fields vLLM sets); the trailing usage chunk uses ``exclude_none``. Captured real responses
are in ``tests/data/vllm-0.32.0``. ``weight_versions=True`` adds 0.33's ``weight_versions``
choice field where 0.33 sets it (``versions``); streamed ``kv_transfer_params`` are
added by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import MappingProxyType

_ERROR_TYPES: Mapping[int, str] = MappingProxyType({
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
})


def dumps(obj: object) -> str:
    """Compact JSON, non-ASCII kept as is (like pydantic's ``model_dump_json``)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse(obj: object) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_body(
    status: int, message: str | None = None, param: str | None = None
) -> dict[str, object]:
    """vLLM's ``ErrorResponse``; generation errors read "Internal server error"."""
    err_type = _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    if message is None:
        message = "Internal server error" if status >= 500 else HTTPStatus(status).phrase
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def usage(prompt_tokens: int, completion_tokens: int, *, full: bool) -> dict[str, object]:
    out: dict[str, object] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if full:
        out["prompt_tokens_details"] = None
        out["completion_tokens_details"] = None
    return out


@dataclass(frozen=True)
class Head:
    """What every body of one response starts with: its id, creation time and model."""

    request_id: str
    created: int
    model: str

    def body(self, obj: str, choices: list[dict[str, object]]) -> dict[str, object]:
        """``id``, ``object``, ``created``, ``model`` and ``choices``, in vLLM's order."""
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model, "choices": choices}


@dataclass(frozen=True)
class Answer:
    """A finished non-streamed generation (``token_ids``/``prompt_token_ids``: only with
    ``return_token_ids``)."""

    text: str
    token_ids: list[int] | None
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    num_output_tokens: int
    kv_transfer_params: dict[str, object] | None
    system_fingerprint: str
    weight_versions: bool = False


def _response(
    head: Head, obj: str, choice: dict[str, object], answer: Answer,
    extra: Mapping[str, object] = MappingProxyType({}),
) -> dict[str, object]:
    """A non-streamed body: ``choice`` (plus 0.33's ``weight_versions``), usage, ``extra``
    (chat's prompt fields) and the transfer params."""
    if answer.weight_versions:
        choice["weight_versions"] = None
    return {
        **head.body(obj, [choice]),
        "service_tier": None,
        "system_fingerprint": answer.system_fingerprint,
        "usage": usage(answer.num_prompt_tokens, answer.num_output_tokens, full=True),
        **extra,
        "kv_transfer_params": answer.kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(head: Head, answer: Answer) -> dict[str, object]:
    """A non-streamed ``chat.completion``."""
    message = {"role": "assistant", "content": answer.text, "refusal": None,
               "annotations": None, "audio": None, "function_call": None, "reasoning": None}
    choice: dict[str, object] = {
        "index": 0, "message": message, "logprobs": None, "finish_reason": "length",
        "stop_reason": None, "token_ids": answer.token_ids, "routed_experts": None,
    }
    return _response(head, "chat.completion", choice, answer, {
        "prompt_logprobs": None, "prompt_token_ids": answer.prompt_token_ids,
        "prompt_text": None,
    })


def completion_response(head: Head, answer: Answer) -> dict[str, object]:
    """A non-streamed ``text_completion``; token ids sit in the choice, as in vLLM."""
    choice: dict[str, object] = {
        "index": 0, "text": answer.text, "logprobs": None, "finish_reason": "length",
        "stop_reason": None, "token_ids": answer.token_ids, "prompt_logprobs": None,
        "prompt_token_ids": answer.prompt_token_ids, "routed_experts": None,
    }
    return _response(head, "text_completion", choice, answer)


def chat_role_chunk(head: Head, prompt_token_ids: list[int] | None) -> dict[str, object]:
    """The first chat chunk: the assistant role (and prompt ids with ``return_token_ids``)."""
    choice: dict[str, object] = {
        "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
        "finish_reason": None,
    }
    return {**head.body("chat.completion.chunk", [choice]),
            "prompt_token_ids": prompt_token_ids, "prompt_text": None}


def chat_token_chunk(
    head: Head, text: str, token_ids: list[int] | None, *, final: bool,
    weight_versions: bool = False,
) -> dict[str, object]:
    """One generated token; the final one carries ``finish_reason``/``stop_reason`` (and,
    with ``weight_versions``, 0.33's ``weight_versions``)."""
    choice: dict[str, object] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": None,
        "finish_reason": "length" if final else None,
    }
    if final:
        choice["stop_reason"] = None
    choice["token_ids"] = token_ids
    if final and weight_versions:
        choice["weight_versions"] = None
    return head.body("chat.completion.chunk", [choice])


def completion_chunk(
    head: Head, text: str, token_ids: list[int] | None, prompt_token_ids: list[int] | None,
    *, final: bool, weight_versions: bool = False,
) -> dict[str, object]:
    """One generated token of a streamed completion (prompt ids only on the first chunk;
    0.33's ``weight_versions`` on every chunk)."""
    choice: dict[str, object] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": "length" if final else None,
        "stop_reason": None,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids,
    }
    if weight_versions:
        choice["weight_versions"] = None
    return head.body("text_completion", [choice])


def usage_chunk(
    head: Head, obj: str, prompt_tokens: int, completion_tokens: int, system_fingerprint: str
) -> dict[str, object]:
    """The trailing chunk of ``stream_options.include_usage``: no choices, usage, fingerprint."""
    return {
        **head.body(obj, []),
        "usage": usage(prompt_tokens, completion_tokens, full=False),
        "system_fingerprint": system_fingerprint,
    }


def models_body(model: str, root: str, max_model_len: int, created: int) -> dict[str, object]:
    """``/v1/models`` with the one served model."""
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{model}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
