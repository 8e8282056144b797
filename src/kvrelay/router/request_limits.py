"""How many messages, content parts, tools, tool calls and stop sequences one request may
carry: the things the router's parse (and P's chat template, and D's stop checks) costs
grow with, beyond what the body-size limit bounds.

A body under ``max_body_bytes`` can still hold 150 000 tiny messages or 80 000 tools, each
a Python object the router digests on its event loop (2.3 s and 1.1 s of router CPU, issue
#23) and P renders. The defaults are far above what real agents send (Claude Code ~12 tools,
Codex ~9; long agent sessions reach a few thousand messages), and beyond any of them the
request is refused with 400 before anything is digested, with OpenAI's wording for an array
that is too long.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.router.errors import ClientError


@dataclass(frozen=True)
class RequestLimits:
    """The per-request count limits (``RouterConfig``'s ``max_messages`` and friends)."""

    max_messages: int = 10_000
    max_content_parts: int = 1_000
    max_content_parts_total: int = 20_000
    max_tools: int = 1_000
    max_tool_calls: int = 10_000
    max_stop_sequences: int = 64

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1")


def check_counts(body: Mapping[str, Any], limits: RequestLimits) -> None:
    """``ClientError`` 400 when ``body`` carries more than ``limits`` allow: history items
    (chat and Messages ``messages``, Responses ``input``), content parts in one list or in
    all (an item's ``content``, a ``tool_result``'s nested ``content``, a Responses
    ``function_call_output``'s ``output`` and a reasoning item's ``summary``, Messages'
    ``system`` blocks), tool calls in the
    history, tools (a Responses ``namespace`` counts the tools it holds: vLLM renders each
    of them), stop sequences (chat and completions ``stop``, ``stop_token_ids``, Messages
    ``stop_sequences``). Only counts lists: their shape is judged later (by the router or
    by vLLM). Every API's lists, whatever the endpoint: a list another API would read costs
    the parse the same."""
    parts = _Parts(limits)
    for key in ("messages", "input"):
        history = body.get(key)
        if isinstance(history, list):
            _check_history(key, history, limits, parts)
    system = body.get("system")
    if isinstance(system, list):
        parts.add("system", system)
    parts.check_total()
    for name in ("tools", "functions"):
        value = body.get(name)
        if isinstance(value, list):
            _at_most(name, _num_tools(value), limits.max_tools)
    for name in ("stop", "stop_token_ids", "stop_sequences"):
        value = body.get(name)
        if isinstance(value, list):
            _at_most(name, len(value), limits.max_stop_sequences)


class _Parts:
    """Content parts counted across a request: each list at most ``max_content_parts``,
    all of them at most ``max_content_parts_total``."""

    def __init__(self, limits: RequestLimits) -> None:
        self._limits = limits
        self.total = 0
        self._param: str | None = None

    def add(self, what: str, parts: list[Any]) -> None:
        _at_most(what, len(parts), self._limits.max_content_parts)
        self.total += len(parts)
        if self._param is None:
            self._param = what.split("[", 1)[0]

    def check_total(self) -> None:
        if self._param is not None:
            _at_most(f"{self._param}[] content parts (all lists)", self.total,
                     self._limits.max_content_parts_total, param=self._param)


def _num_tools(tools: list[Any]) -> int:
    """Tools as vLLM renders them: every tool counts one, and a Responses ``namespace`` also
    the tools it holds, however deep. (Any other tool counts one whatever it carries: a
    ``tools`` list in a function tool is rendered with it, not as tools, and counting it
    as such let 60,000 tools carrying ``"tools": []`` count none; probe 13, H1.)"""
    count = 0
    stack = [tools]
    while stack:
        for tool in stack.pop():
            count += 1
            nested = tool.get("tools") if isinstance(tool, dict) \
                and tool.get("type") == "namespace" else None
            if isinstance(nested, list):
                stack.append(nested)
    return count


def _check_history(key: str, history: list[Any], limits: RequestLimits,
                   parts: _Parts) -> None:
    """The counts of one history list (``key``: its field)."""
    _at_most(key, len(history), limits.max_messages)
    calls = 0
    for item in history:
        if not isinstance(item, dict):
            continue
        content = item.get("content")
        if isinstance(content, list):
            parts.add(f"{key}[].content", content)
            for part in content:
                nested = part.get("content") if isinstance(part, dict) else None
                if isinstance(nested, list):  # a Messages tool_result's blocks
                    parts.add(f"{key}[].content[].content", nested)
        output = item.get("output")
        if isinstance(output, list):  # a Responses function_call_output's parts
            parts.add(f"{key}[].output", output)
        summary = item.get("summary")
        if isinstance(summary, list):  # a Responses reasoning item's summary parts
            parts.add(f"{key}[].summary", summary)
        tool_calls = item.get("tool_calls")
        if isinstance(tool_calls, list):
            calls += len(tool_calls)
    _at_most(f"{key}[].tool_calls (all items)", calls, limits.max_tool_calls, param=key)


def _at_most(what: str, count: int, limit: int, param: str | None = None) -> None:
    if count > limit:
        raise ClientError(
            f"Invalid '{what}': array too long. Expected an array with maximum length "
            f"{limit}, but got an array with length {count} instead.",
            param or what.split("[", 1)[0],
        )
