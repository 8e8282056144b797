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
def test_byte_counter_matches_the_tiny_tokenizer(messages, real_counter):
    assert byte_template_counter(messages) == real_counter(messages)


def test_byte_counter_counts_utf8_bytes_plus_template():
    # <|im_start|> user \n content <|im_end|> \n  +  <|im_start|> assistant \n
    assert byte_template_counter([{"role": "user", "content": "é"}]) == 1 + 4 + 1 + 2 + 2 + 11


def test_default_counter_uses_the_byte_counter_for_default_sizes(tmp_path):
    assert default_counter("tiny") is byte_template_counter
    assert default_counter("bench") is byte_template_counter
    with pytest.raises(FileNotFoundError, match="not a default size"):
        default_counter(str(tmp_path / "missing-model"))


def test_default_counter_for_a_model_dir_uses_its_chat_template():
    count = default_counter(str(ensure_model("tiny")))
    assert count is not byte_template_counter
    assert count(CASES[2]) == byte_template_counter(CASES[2])
