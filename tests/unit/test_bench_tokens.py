"""Token counting for workloads: the pure byte counter reproduces the generated models'
tokenizer + chat template exactly; the transformers counter reads a model directory."""

from __future__ import annotations

import pytest

from kvrelay.bench.tokens import byte_template_counter, chat_template_counter, default_counter
from kvrelay.models import ensure_model

CASES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": ""}],
    [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "naïve café — 日本語 🙂"},
        {"role": "assistant", "content": "ok.\nline two"},
        {"role": "user", "content": "Tool result:\n{\"a\": [1, 2]}"},
    ],
]


@pytest.fixture(scope="module")
def real_counter():
    return chat_template_counter(ensure_model("tiny"))


@pytest.mark.parametrize("messages", CASES)
def test_the_tiny_counter_counts_what_the_tokenizer_renders(messages, real_counter):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_model("tiny"))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert real_counter(messages) == len(tok.encode(text, add_special_tokens=False))
    # BPE: fewer tokens than bytes on text, never more than one per byte.
    assert real_counter(messages) < byte_template_counter(messages)


def test_byte_counter_counts_utf8_bytes_plus_template():
    # <|im_start|> user \n content <|im_end|> \n  +  <|im_start|> assistant \n
    assert byte_template_counter([{"role": "user", "content": "é"}]) == 1 + 4 + 1 + 2 + 2 + 11


def test_default_counter_rejects_a_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a default size"):
        default_counter(str(tmp_path / "missing-model"))


def test_default_counter_counts_with_the_model_s_own_tokenizer(real_counter):
    by_size, by_dir = default_counter("tiny"), default_counter(str(ensure_model("tiny")))
    for messages in CASES:
        assert by_size(messages) == by_dir(messages) == real_counter(messages)


def test_filler_words_are_one_token_each(real_counter):
    from kvrelay.bench.tokens import filler_words

    words = filler_words("tiny")
    empty = real_counter([{"role": "user", "content": ""}])
    text = "".join(words[:50]) + "".join(reversed(words[-50:]))
    assert real_counter([{"role": "user", "content": text}]) == empty + 100


def test_filler_words_refuse_a_tokenizer_without_such_words(monkeypatch):
    from kvrelay.bench import tokens

    monkeypatch.setattr("kvrelay.models.answer_token_ids", lambda tokenizer: [])
    with pytest.raises(ValueError, match="no one-token words"):
        tokens.filler_words("tiny")
