"""Counting a chat prompt's tokens, injected into the workload generators.

A ``CountTokens`` maps a list of ``{"role", "content"}`` messages to the number of prompt
tokens the served model sees for them, *including* the chat template and the generation
prompt (``add_generation_prompt=True``): exactly ``usage.prompt_tokens`` of a chat request
with those messages. Two implementations:

* ``chat_template_counter(model_dir)``: the model's own tokenizer and chat template
  (transformers, imported on first use). This is the default, for any model, kvrelay's
  generated ``tiny``/``bench`` (BPE) included.
* ``byte_template_counter``: pure Python, one token per UTF-8 byte in a Qwen-style template:
  the stand-in the generators' unit tests inject (no model, no transformers). No served model
  counts this way (the generated models' tokenizer was byte-level before it was BPE).
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
    """Prompt tokens of ``messages`` for a byte-level tokenizer with a Qwen-style template.

    Contract: ``<|im_start|>``, role, ``\n``, content bytes, ``<|im_end|>``, ``\n`` per
    message, then ``<|im_start|>assistant\n``; a special token counts 1, any other byte 1.
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
    """The counter for ``--model`` (a generated default size, built on first use, or a model
    directory): that model's tokenizer and chat template."""
    from kvrelay.cluster.launcher import resolve_model

    return chat_template_counter(resolve_model(model))


def filler_words(model: str) -> list[str]:
    """The texts of ``model``'s answer tokens (``kvrelay.models.answer_token_ids``: a space
    and letters, e.g. ``" cache"``), for prompts of a known length: ``n`` of them joined are
    exactly ``n`` tokens after a newline or a space (in a message's content, say).

    ``model`` is a generated default size or a model directory. Raises ``ValueError`` for a
    tokenizer without such tokens (e.g. SentencePiece, whose words start with ``"▁"``).
    """
    from transformers import AutoTokenizer

    from kvrelay.cluster.launcher import resolve_model
    from kvrelay.models import answer_token_ids

    tokenizer: Any = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    words = [str(tokenizer.decode([i])) for i in answer_token_ids(tokenizer)]
    if not words:
        raise ValueError(f"{model}: its tokenizer has no one-token words (a space and letters) "
                         "to size prompts with")
    return words
