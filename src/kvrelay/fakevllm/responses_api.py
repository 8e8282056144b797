"""vLLM's Responses API as the fake speaks it: the request read into chat messages, the
response body and the SSE events, shaped like vLLM 0.32's ``/v1/responses``.

Reading (``chat_messages``): ``instructions`` becomes a system message; message items keep
their role (``developer`` as ``system``) and text; ``function_call`` items become the
assistant's tool calls, ``function_call_output`` items tool messages; reasoning items are not
rendered. Tools render as vLLM's (``chat_tools``: function, namespace and custom tools;
others dropped); tool-server tools are refused (the fake has no tool server), as is
``previous_response_id`` (the fake keeps no store: vLLM's default).

Shapes (captured from vLLM's own pydantic models): the non-streamed body dumps every field
(``kv_transfer_params`` among them); a stream is ``event: <type>`` / ``data: <json>``:
``response.created``, ``response.in_progress`` (snapshots with ``"kv_transfer_params":null``),
one output message's added / delta / done events, then ``response.completed`` whose
response carries D's params. No ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ResponsesInputError(ValueError):
    """A body vLLM's Responses server refuses (400), with the offending parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages the request renders as (module docstring)."""
    if body.get("previous_response_id") is not None:
        raise ResponsesInputError(
            f"Response with id '{body['previous_response_id']}' not found.",
            "previous_response_id")
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesInputError("input must be a string or a list of items", "input")
    for item in items:
        if not isinstance(item, Mapping):
            raise ResponsesInputError("every input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesInputError("a message item needs a valid role", "input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"))})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name", "")
            if kind == "custom_tool_call":
                arguments = json.dumps({"input": item.get("input") or ""}, ensure_ascii=False)
            else:
                arguments = item.get("arguments", "")
                if item.get("namespace"):
                    name = f"{item['namespace']}__{name}"
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind != "reasoning":
            raise ResponsesInputError(f"unsupported input item type {kind!r}", "input")
    return out


#: The tool types vLLM's tool server runs (the fake has none; kvrelay's router refuses them).
TOOL_SERVER_TOOLS = frozenset({
    "web_search_preview", "web_search_preview_2025_03_11", "code_interpreter", "container",
    "mcp",
})

#: The single-string schema vLLM shows a custom tool as (``custom_tool_parameters``).
CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string",
                             "description": "The freeform text payload for this tool."}},
    "required": ["input"], "additionalProperties": False,
}


def chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The tools as vLLM 0.32 renders them (``get_function_tools``): function tools as chat
    tools; a namespace's function tools flattened to ``<namespace>__<name>``; a custom tool
    as a function of one string ``input`` (refused with a grammar format, as vLLM does);
    other types (``web_search``, ...) not rendered. A tool-server tool is refused."""
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise ResponsesInputError("tools must be a list", "tools")
    out: list[dict[str, Any]] = []
    for tool in tools:
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or not isinstance(kind, str):
            raise ResponsesInputError("every tool must be an object with a type", "tools")
        if kind in TOOL_SERVER_TOOLS:
            raise ResponsesInputError(f"the fake engine has no tool server for {kind!r}",
                                      "tools")
        if kind == "function":
            out.append(_function(tool.get("name", ""), tool))
        elif kind == "namespace":
            for inner in tool.get("tools") or ():
                if isinstance(inner, Mapping) and inner.get("type") == "function":
                    out.append(_function(f"{tool.get('name', '')}__{inner.get('name', '')}",
                                         inner))
        elif kind == "custom":
            fmt = tool.get("format")
            if isinstance(fmt, Mapping) and fmt.get("type") == "grammar":
                raise ResponsesInputError(
                    "Custom tools with a grammar format are not supported; only free-form "
                    "text custom tools are accepted.", "tools")
            out.append(_function(tool.get("name", ""), {
                "description": tool.get("description"), "parameters": CUSTOM_TOOL_PARAMETERS}))
    return out or None


def _function(name: object, tool: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": tool.get("description"),
        "parameters": tool.get("parameters") or {}}}


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


@dataclass(frozen=True)
class ResponseHead:
    """What every snapshot of one response echoes from its request."""

    response_id: str
    message_id: str
    created: int
    model: str
    body: Mapping[str, Any]
    max_output_tokens: int

    def snapshot(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
        kv_transfer_params: Mapping[str, object] | None,
    ) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.response_id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": b.get("instructions"), "metadata": b.get("metadata"),
            "model": self.model, "object": "response", "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "temperature": b.get("temperature", 1.0),
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0), "background": False,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": b.get("max_tool_calls"), "previous_response_id": None,
            "prompt": None, "reasoning": b.get("reasoning"),
            "service_tier": b.get("service_tier", "auto"), "status": status,
            "text": b.get("text"), "top_logprobs": None,
            "truncation": b.get("truncation", "disabled"), "usage": usage,
            "user": b.get("user"), "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "kv_transfer_params": dict(kv_transfer_params) if kv_transfer_params else None,
            "ec_transfer_params": None, "input_messages": None, "output_messages": None,
        }

    def message(self, text: str, status: str) -> dict[str, Any]:
        content = [_part(text, None)] if status == "completed" else []
        return {"id": self.message_id, "content": content, "role": "assistant",
                "status": status, "type": "message", "phase": None}


def _part(text: str, logprobs: list[object] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, Any]:
    """vLLM's ``ResponseUsage``: the fake's engine reports no prefix-cache hits here."""
    return {
        "input_tokens": num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [],
                                  "tool_output_tokens_per_turn": []},
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def response_body(
    head: ResponseHead, text: str, num_prompt_tokens: int, num_output_tokens: int,
    kv_transfer_params: Mapping[str, object] | None, *, complete: bool,
) -> dict[str, Any]:
    """The non-streamed response (``complete``: EOS, else it stopped at its budget)."""
    return head.snapshot("completed" if complete else "incomplete",
                         [head.message(text, "completed")],
                         usage(num_prompt_tokens, num_output_tokens), kv_transfer_params)


def event(kind: str, payload: Mapping[str, Any], sequence_number: int) -> str:
    """One SSE event (the openai package's event models list their fields alphabetically)."""
    data = dict(sorted({**payload, "sequence_number": sequence_number, "type": kind}.items()))
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"


def opening_events(head: ResponseHead) -> list[tuple[str, dict[str, Any]]]:
    """``response.created``, ``response.in_progress``, the message's added events."""
    snap = head.snapshot("in_progress", [], None, None)
    return [
        ("response.created", {"response": snap}),
        ("response.in_progress", {"response": snap}),
        ("response.output_item.added", {"item": head.message("", "in_progress"),
                                        "output_index": 0}),
        ("response.content_part.added", {"content_index": 0, "item_id": head.message_id,
                                         "output_index": 0, "part": _part("", [])}),
    ]


def delta_event(head: ResponseHead, delta: str) -> tuple[str, dict[str, Any]]:
    return ("response.output_text.delta", {"content_index": 0, "delta": delta,
                                           "item_id": head.message_id, "logprobs": [],
                                           "output_index": 0})


def closing_events(head: ResponseHead, final: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The text's done events and ``response.completed`` with the final response."""
    text = "".join(p["text"] for p in final["output"][0]["content"])
    return [
        ("response.output_text.done", {"content_index": 0, "item_id": head.message_id,
                                       "logprobs": [], "output_index": 0, "text": text}),
        ("response.content_part.done", {"content_index": 0, "item_id": head.message_id,
                                        "output_index": 0, "part": _part(text, None)}),
        ("response.output_item.done", {"item": head.message(text, "completed"),
                                       "output_index": 0}),
        ("response.completed", {"response": final}),
    ]
