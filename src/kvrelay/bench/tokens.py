"""Counting a chat prompt's tokens, injected into the workload generators.

A ``CountTokens`` maps a list of ``{"role", "content"}`` messages to the number of prompt
tokens the served model sees for them, *including* the chat template and the generation
prompt (``add_generation_prompt=True``): exactly ``usage.prompt_tokens`` of a chat request
with those messages. Two implementations:

* ``chat_template_counter(model_dir)``: the model's own tokenizer and chat template
  (transformers, imported on first use). This is the default, for any model.
* ``byte_template_counter``: pure Python, exact for kvrelay's generated default models
  (one token per UTF-8 byte, Qwen-style template, string contents, no tools); used by tests
  and as a fast path for ``tiny``/``bench``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ChatMessage = Mapping[str, str]
CountTokens = Callable[[Sequence[ChatMessage]], int]

#: ``<|im_start|>`` + ``\n`` + ``<|im_end|>`` + ``\n`` around every message's role and content.
_BYTE_MESSAGE_OVERHEAD = 4
#: ``<|im_start|>assistant\n``.
_BYTE_GENERATION_PROMPT = 1 + len(b"assistant") + 1


def byte_template_counter(messages: Sequence[ChatMessage]) -> int:
    """Prompt tokens of ``messages`` for kvrelay's byte-level default models.

    Contract: equals ``len(tokenizer.apply_chat_template(messages, tokenize=True,
    add_generation_prompt=True))`` for ``kvrelay.models``'s tokenizer when every
    content is a string without special-token text (``tests/unit/test_bench_tokens.py``
    checks it against the real tokenizer).
    """
    total = _BYTE_GENERATION_PROMPT
    for m in messages:
        total += _BYTE_MESSAGE_OVERHEAD + len(m["role"].encode()) + len(m["content"].encode())
    return total


def chat_template_counter(model_dir: str | Path) -> CountTokens:
    """A counter using the tokenizer and chat template found in ``model_dir``.

    Loads the tokenizer once (transformers is imported here, not at module import).
    """
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model_dir))

    def count(messages: Sequence[ChatMessage]) -> int:
        ids = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=True, add_generation_prompt=True
        )
        if isinstance(ids, Mapping):  # transformers >= 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return len(ids)

    return count


def default_counter(model: str) -> CountTokens:
    """The counter for ``--model``: the byte counter for the generated default sizes (whose
    tokenizer it reproduces exactly), else the model directory's chat template."""
    from kvrelay.models import MODEL_SPECS

    if model in MODEL_SPECS:
        return byte_template_counter
    from kvrelay.cluster.launcher import resolve_model

    return chat_template_counter(resolve_model(model))
