"""Parsing of the fake engine's request bodies (the subset of vLLM's OpenAI API it serves).

Supported: Responses ``input`` (+ ``instructions``, function ``tools``) and Anthropic
Messages (+ ``system``, ``tools``, a ``tool_choice`` forcing a ``tool_use``), read into chat
messages (``responses_api``, ``messages_api``); chat ``messages`` (+ ``tools``,
``add_generation_prompt``, ``chat_template_kwargs``), completion ``prompt`` as a string or
token ids (one prompt), ``max_tokens`` / ``max_completion_tokens``, ``stream`` + ``stream_options``
(``include_usage``, ``continuous_usage_stats``), ``return_token_ids``,
``kv_transfer_params``, ``seed``, ``request_id`` (or the ``X-Request-Id`` header), ``n == 1``.
Sampling knobs (temperature, top_p, stop, ...) are accepted and ignored: the fake's output is
a pure function of its context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.fakevllm import messages_api, responses_api
from kvrelay.fakevllm.engine import FakeEngine
from kvrelay.fakevllm.generation import GenerationInput

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request vLLM would reject; becomes an ``ErrorResponse`` with ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass(frozen=True)
class ParsedRequest:
    """A generation request plus how to shape its response."""

    inp: GenerationInput
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    body: Mapping[str, Any]


def _output_budget(max_model_len: int, num_prompt_tokens: int, max_tokens: int | None,
                   param: str, default: int | None) -> int:
    """The tokens a request may generate, as vLLM 0.32 / 0.33 decide it: a budget over the
    context itself is refused (``TokenizeParams``), so is a prompt over it; otherwise the
    budget (else the default, else the whole context) is clamped to what the prompt leaves
    (``get_max_tokens``: a budget that does not fit with the prompt is *not* refused), and
    a prompt that leaves no token is refused (``SamplingParams``)."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise BadRequest(
            f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.", param=param)
    if num_prompt_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt_tokens} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens")
    left = max_model_len - num_prompt_tokens
    budget = max_tokens if max_tokens is not None else default
    budget = left if budget is None else min(budget, left)
    if budget < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {budget}.", param="max_tokens")
    return budget


def parse_generation(
    engine: FakeEngine, body: Mapping[str, Any], endpoint: str, header_request_id: str | None
) -> ParsedRequest:
    """Validate a generation body (``endpoint``: chat, completions, responses, messages);
    ``BadRequest`` if bad."""
    cfg = engine.config
    model = body.get("model")
    if model is not None and model != cfg.served_model_name and model not in cfg.lora_modules:
        raise BadRequest(f"The model `{model}` does not exist.", 404, "model")
    if body.get("n", 1) not in (1, None):
        raise BadRequest("the fake engine only supports n=1", param="n")
    if endpoint in ("responses", "messages"):
        prompt = agent_prompt(engine, body, endpoint)
        param = "max_output_tokens" if endpoint == "responses" else "max_tokens"
        max_tokens = body.get(param)
        if max_tokens is None and endpoint == "messages":
            raise BadRequest("max_tokens: Field required", param="max_tokens")
    elif endpoint == "chat":
        prompt = _chat_prompt(engine, body)
        param = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
                 else "max_tokens")
        max_tokens = body.get(param)
    else:
        prompt = _completion_prompt(engine, body)
        param = "max_tokens"
        max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise BadRequest("max_tokens must be an integer >= 1", param="max_tokens")
    if not prompt:
        raise BadRequest("The prompt cannot be empty.", param="prompt")
    max_tokens = _output_budget(cfg.max_model_len, len(prompt), max_tokens, param,
                                cfg.default_max_tokens if endpoint != "completions" else None)
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, Mapping):
        raise BadRequest("kv_transfer_params must be an object", param="kv_transfer_params")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed must be an integer", param="seed")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise BadRequest("stream_options must be an object", param="stream_options")
    body_id = body.get("request_id")
    if body_id is not None and not isinstance(body_id, str):
        raise BadRequest("request_id must be a string", param="request_id")
    # vLLM: the X-Request-Id header, else the body's request_id, else a random id.
    base = header_request_id or body_id or f"{engine.rng.getrandbits(64):016x}"
    suffix = f"{engine.rng.getrandbits(32):08x}"
    if endpoint == "responses":
        # vLLM's Responses API: the body's request_id is the response id as it is
        request_id = body_id if body_id else f"resp_{base}"
        internal = f"{request_id}-{suffix}"
    elif endpoint in ("chat", "messages"):
        request_id = f"chatcmpl-{base}"
        internal = f"{request_id}-{suffix}"
    else:
        request_id = f"cmpl-{base}"
        internal = f"{request_id}-0-{suffix}"
    stream = bool(body.get("stream", False))
    return ParsedRequest(
        inp=GenerationInput(
            endpoint=endpoint,
            request_id=request_id,
            internal_request_id=internal,
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            kv_transfer_params=dict(params) if params is not None else None,
            seed=seed,
        ),
        stream=stream,
        include_usage=stream and bool(options.get("include_usage", False)),
        continuous_usage=stream and bool(options.get("continuous_usage_stats", False)),
        body=body,
        return_token_ids=bool(body.get("return_token_ids", False)),
    )


def tokenize(engine: FakeEngine, body: Mapping[str, Any]) -> dict[str, object]:
    """The ``/tokenize`` response for a ``prompt`` or ``messages`` body."""
    if "messages" in body:
        tokens = _chat_prompt(engine, body)
    elif "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest("prompt must be a string", param="prompt")
        tokens = engine.model.encode_prompt(
            prompt, add_special_tokens=bool(body.get("add_special_tokens", True))
        )
    else:
        raise BadRequest("either 'prompt' or 'messages' is required")
    strs = None
    if body.get("return_token_strs"):
        strs = list(engine.model.tokenizer.convert_ids_to_tokens(tokens))
    return {
        "count": len(tokens),
        "max_model_len": engine.config.max_model_len,
        "tokens": tokens,
        "token_strs": strs,
    }


def agent_prompt(engine: FakeEngine, body: Mapping[str, Any], endpoint: str) -> list[int]:
    """The prompt of a Responses or Messages body: its chat messages rendered."""
    api = responses_api if endpoint == "responses" else messages_api
    try:
        messages = api.chat_messages(body)
        tools = api.chat_tools(body)
    except responses_api.ResponsesInputError as exc:
        raise BadRequest(str(exc), 404 if exc.param == "previous_response_id" else 400,
                         exc.param) from exc
    except messages_api.MessagesInputError as exc:
        raise BadRequest(str(exc)) from exc
    return _chat_prompt(engine, {"messages": messages, "tools": tools,
                                 "chat_template_kwargs": body.get("chat_template_kwargs")})


def _chat_prompt(engine: FakeEngine, body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("every message needs a string 'role'", param="messages")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise BadRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        return engine.model.encode_chat(
            messages,
            tools=body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            chat_template_kwargs=kwargs,
        )
    except ValueError as exc:
        raise BadRequest(str(exc), param="tools") from exc
    except Exception as exc:  # jinja errors from odd messages
        raise BadRequest(f"chat template failed: {exc}", param="messages") from exc


def _completion_prompt(engine: FakeEngine, body: Mapping[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.model.encode_prompt(prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    raise BadRequest("prompt must be a string or a list of token ids (one prompt)", param="prompt")
