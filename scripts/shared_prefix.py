#!/usr/bin/env python3
"""How many prompt tokens two agent conversations share: the first requests of two sessions of
an agent harness (Claude Code's Messages, Codex's Responses), rendered as vLLM's frontends
render them, through a model's chat template.

    .venv/bin/python scripts/shared_prefix.py MODEL_DIR FIRST.jsonl SECOND.jsonl

Why: D's prefix cache holds a block once for every conversation that starts with it (the
system prompt and tools an agent sends first), so how much retained KV fits on D depends on
how long the prefix two conversations share is (``kvrelay bench retention
--shared-system-tokens``). That length is not the agent's alone: it is where the first
per-conversation text lands in the *rendered* prompt, which the served model's chat template
decides (a template that renders the system text before the tools ends the shared prefix at
the first per-project line of the system text, before every tool).

Each file is a capture of one harness request (``scripts/harness_proxy.py``'s JSON lines;
the first Messages or Responses request is used) or a JSON object with its ``body``. A
Messages body is converted as vLLM 0.32's ``entrypoints/anthropic/serving.py`` does for the
template: the system blocks' text joined without a separator, Claude Code's
``x-anthropic-billing-header`` block left out (its per-request hash would end every shared
prefix at once), the tools as OpenAI functions, each message's text. A Responses body as
``entrypoints/openai/responses/utils.py`` does: ``instructions`` as the system message, each
input message with its role (``developer`` too) and text; its function tools as functions
(a namespace's flattened to ``namespace.name``; other kinds, e.g. ``web_search``, left out,
so its token counts are approximate; both requests' tools being the same, the common prefix
is not). Prints both token counts and the length of their common prefix.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header"


def first_body(path: Path) -> dict[str, Any]:
    """The body of the first Messages or Responses request in ``path`` (module
    docstring)."""
    text = path.read_text()
    try:
        doc = json.loads(text)
        rows = [doc]
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for row in rows:
        body = row.get("body")
        if isinstance(body, dict) and ("messages" in body or "input" in body):
            return body
    raise SystemExit(f"{path}: no Messages or Responses request in it")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or ()
                   if isinstance(part, dict) and part.get("type") == "text")


def chat_of(body: dict[str, Any]) -> tuple[list[dict[str, str]], list[dict[str, Any]]]:
    """The chat messages and tools vLLM hands the template for a Messages or Responses
    ``body``."""
    if "input" in body:
        return _responses_chat(body)
    system = body.get("system")
    if isinstance(system, list):
        system = "".join(block.get("text", "") for block in system
                         if not str(block.get("text", "")).startswith(BILLING_HEADER))
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": m["role"], "content": _text(m.get("content"))}
                 for m in body.get("messages", ())]
    tools = [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description", ""),
        "parameters": t.get("input_schema", {})}} for t in body.get("tools", ())]
    return messages, tools


def _responses_chat(body: dict[str, Any]) -> tuple[list[dict[str, str]],
                                                  list[dict[str, Any]]]:
    messages = [{"role": "system", "content": body["instructions"]}] \
        if body.get("instructions") else []
    items = body["input"]
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    messages += [{"role": item["role"], "content": _text_parts(item.get("content"))}
                 for item in items if item.get("type", "message") == "message"]
    tools: list[dict[str, Any]] = []
    for tool in body.get("tools", ()):
        inner = [(f"{tool['name']}.", t) for t in tool.get("tools", ())] \
            if tool.get("type") == "namespace" else [("", tool)]
        tools += [{"type": "function", "function": {
            "name": prefix + t["name"], "description": t.get("description", ""),
            "parameters": t.get("parameters", {})}}
            for prefix, t in inner if t.get("type") == "function"]
    return messages, tools


def _text_parts(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or ()
                   if isinstance(part, dict) and "text" in part)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a model directory with a chat template")
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompts = []
    for path in (args.first, args.second):
        messages, tools = chat_of(first_body(path))
        ids = tokenizer.apply_chat_template(messages, tools=tools or None,
                                            add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    a, b = prompts
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                  min(len(a), len(b)))
    print(f"{args.first}: {len(a)} tokens; {args.second}: {len(b)} tokens; "
          f"common prefix {shared} tokens ({100 * shared / max(1, min(len(a), len(b))):.1f}% "
          f"of the shorter)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
