"""The fake engine's "model": a real tokenizer and chat template, and a deterministic sampler.

Prompt token ids come from the model directory's own tokenizer and chat template, so they
equal what a real vLLM engine computes for the same request (the default model is kvrelay's
generated ``tiny``, BPE, see ``kvrelay.models``). Tools are normalized the way vLLM dumps its
``ChatCompletionToolsParam`` before rendering, so tool prompts match too.

Generated tokens are a pure function of the *effective context* (the token ids whose KV the
engine actually used: prefix-cache contents, pulled KV, computed tokens) and a seed, and are
always the model's answer tokens (``kvrelay.models.answer_token_ids``: a space and letters,
each its own tokenization, what the generated models answer in too), so a re-sent answer
tokenizes back into the generated ids. Correct KV reuse therefore produces exactly the output
of a full recompute, and wrong reuse almost surely produces a different one.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The ids a model without answer tokens is answered in (printable ASCII in a byte-level
#: tokenizer): ``answer_token_ids`` finds none in, e.g., a SentencePiece tokenizer.
FALLBACK_ANSWER_IDS: tuple[int, ...] = tuple(range(32, 127))
_MASK64 = (1 << 64) - 1


def context_digest(context: Sequence[int], seed: int) -> int:
    """64-bit digest of a token sequence and a seed (stable across processes and runs)."""
    h = hashlib.blake2b(digest_size=8, key=(seed & _MASK64).to_bytes(8, "little"))
    h.update(array("I", context).tobytes())
    return int.from_bytes(h.digest(), "little")


def generate_tokens(
    context: Sequence[int], count: int, seed: int, alphabet: Sequence[int]
) -> list[int]:
    """The ``count`` tokens (each from ``alphabet``) the fake model emits after ``context``.

    Token ``i`` depends on the whole context and on tokens ``0..i-1`` (a splitmix64 chain
    seeded by the context digest), like an autoregressive model's greedy output.
    """
    state = context_digest(context, seed)
    out: list[int] = []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        out.append(alphabet[z % len(alphabet)])
    return out


def normalize_tools(tools: object) -> list[dict[str, Any]] | None:
    """Tools as vLLM renders them: ``{"type", "function": {"name", "description",
    "parameters"[, "strict"]}}`` in that key order; ``None`` stays ``None``."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    out: list[dict[str, Any]] = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise ValueError("each tool must be an object with a 'function' object")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise ValueError("a tool function needs a string 'name'")
        function: dict[str, Any] = {
            "name": fn["name"],
            "description": fn.get("description"),
            "parameters": fn.get("parameters"),
        }
        if fn.get("strict") is not None:
            function["strict"] = fn["strict"]
        out.append({"type": tool.get("type", "function"), "function": function})
    return out


class FakeModel:
    """Tokenizer plus chat template of one model directory; immutable once built."""

    def __init__(self, tokenizer: Any, path: str) -> None:
        from kvrelay.models import answer_token_ids

        self.tokenizer = tokenizer
        self.path = path
        #: The ids the fake answers in (see the module docstring).
        self.answer_ids: tuple[int, ...] = tuple(answer_token_ids(tokenizer)) or (
            FALLBACK_ANSWER_IDS
        )
        # Answer tokens decode one by one (a byte-level decoder, whole ASCII words).
        self._answer_text = {i: str(tokenizer.decode([i])) for i in self.answer_ids}

    @classmethod
    def load(cls, model_dir: str | Path | None = None) -> FakeModel:
        """Load a local HF model directory's tokenizer (default: kvrelay's generated ``tiny``).

        Takes a few seconds (transformers import); load once and share it between engines.
        """
        from transformers import AutoTokenizer

        if model_dir is None:
            from kvrelay.models import ensure_model

            model_dir = ensure_model("tiny")
        return cls(AutoTokenizer.from_pretrained(str(model_dir)), str(model_dir))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt (vLLM: tokenizer(prompt, add_special_tokens))."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: object = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a chat prompt: the chat template applied and tokenized."""
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            tools=normalize_tools(tools),
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **dict(chat_template_kwargs or {}),
        )
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens (a fast path for answer tokens)."""
        table = self._answer_text
        if all(t in table for t in token_ids):
            return "".join(table[t] for t in token_ids)
        return str(self.tokenizer.decode(list(token_ids)))
