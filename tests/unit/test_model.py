"""The generated default model: deterministic, real architecture, a BPE tokenizer (bytes at
ids 0..255) with a chat template for system/user/assistant/tool turns and a 128k context, and
answers in re-tokenizable words by construction."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvrelay.models import (
    MAX_MODEL_LEN,
    MODEL_SPECS,
    VOCAB_SIZE,
    answer_text_ok,
    answer_token_ids,
    build_tokenizer,
    ensure_model,
    model_dir,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = ensure_model("tiny", tmp_path_factory.mktemp("cache"))
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def test_generation_is_deterministic_and_cached(tmp_path, tiny):
    path, _, _ = tiny
    again = ensure_model("tiny", tmp_path)
    assert again.name == path.name
    a = (path / "model.safetensors").read_bytes()
    b = (again / "model.safetensors").read_bytes()
    assert a == b
    assert ensure_model("tiny", tmp_path) == again  # second call finds the cache
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]


def test_unknown_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown model size"):
        model_dir("huge", tmp_path)


def test_bench_is_bigger_than_tiny():
    tiny, bench = MODEL_SPECS["tiny"], MODEL_SPECS["bench"]
    assert bench.hidden_size >= 4 * tiny.hidden_size
    assert bench.num_hidden_layers > tiny.num_hidden_layers


def test_bpe_round_trip_with_bytes_at_their_own_ids(tiny):
    path, tok, _ = tiny
    text = "héllo wörld\n\ttabs & <tags> 123"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.encode("\x07", add_special_tokens=False) == [7]  # byte b -> id b
    assert len(tok) == VOCAB_SIZE
    config = json.loads((path / "config.json").read_text())
    assert config["max_position_embeddings"] == MAX_MODEL_LEN == tok.model_max_length


def test_agent_prompts_fit_with_room_for_a_session(tiny):
    """A harness's first request (Claude Code's captured body: tools, system, messages) is a
    fraction of the context: ~3 bytes per token on English and JSON."""
    from pathlib import Path

    _, tok, _ = tiny
    capture = Path(__file__).parents[1] / "data" / "harness" / "claude_code_session.json"
    body = json.dumps(json.loads(capture.read_text())["turns"][-1]["body"])
    num_tokens = len(tok.encode(body, add_special_tokens=False))
    assert len(body.encode()) / num_tokens > 3.0
    assert num_tokens < MAX_MODEL_LEN / 4


def test_tokenizer_training_is_deterministic():
    first, second = build_tokenizer(), build_tokenizer()
    assert first.get_vocab() == second.get_vocab()
    text = "The router pulls D's blocks back to P when the span is long enough."
    assert first.encode(text) == second.encode(text)


def test_answer_tokens_tokenize_back_into_the_same_ids(tiny):
    """Why the model answers in these tokens: a re-sent answer is tokenized into exactly the
    ids D generated, so the next turn can reuse the whole previous turn (prompt + answer)."""
    _, tok, _ = tiny
    answer = answer_token_ids(tok)
    assert len(answer) > 1000
    rng = random.Random(3)
    for _ in range(100):
        ids = [rng.choice(answer) for _ in range(rng.randrange(1, 48))]
        text = tok.decode(ids)
        assert answer_text_ok(text) and tok.encode(text, add_special_tokens=False) == ids
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True,
                                         add_generation_prompt=True)["input_ids"]
        history = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text},
             {"role": "user", "content": "more"}], tokenize=True)["input_ids"]
        assert history[: len(prompt) + len(ids)] == prompt + ids
    as_bytes = list(b" the tokens")  # what a byte-level answer would be: not its tokenization
    assert tok.encode(tok.decode(as_bytes), add_special_tokens=False) != as_bytes


def test_chat_template_renders_every_role(tiny):
    _, tok, _ = tiny
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}]},
        {"role": "assistant", "content": "sure"},
        {"role": "user", "content": "more"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The format (and so the token ids) of conversations without tools is the one kvrelay
    # had before tools were supported: cached entries and benchmark prompts stay valid.
    assert text == (
        "<|im_start|>system\nsys<|im_end|>\n"
        "<|im_start|>user\npart one<|im_end|>\n"
        "<|im_start|>assistant\nsure<|im_end|>\n"
        "<|im_start|>user\nmore<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List a directory",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]

TOOL_CONVERSATION = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "list /"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "ls", "arguments": "{\"path\": \"/\"}"}},
                    {"id": "c2", "type": "function",
                     "function": {"name": "ls", "arguments": {"path": "/tmp"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "b.txt"}]},
    {"role": "assistant", "content": "done"},
]


def test_chat_template_renders_tools_as_qwen3_does(tiny):
    """Tools in the system prompt, ``<tool_call>`` JSON per call, consecutive tool results as
    one user turn of ``<tool_response>`` blocks: Qwen3's format, which vLLM's ``hermes``
    parser reads."""
    _, tok, _ = tiny
    text = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nsys\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nlist /<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"path": "/"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n"
        "<tool_response>\nb.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\ndone<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_system = tok.apply_chat_template(TOOL_CONVERSATION[1:2], tools=TOOLS, tokenize=False)
    assert no_system.startswith("<|im_start|>system\n# Tools\n\n")


def test_tool_tags_are_single_tokens_that_survive_decoding(tiny):
    _, tok, _ = tiny
    ids = tok.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and len(ids) == 7
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [257, 258]


def test_hermes_parser_reads_back_the_tool_calls_the_template_writes(tiny):
    """What the template renders for an assistant's tool calls is what a model trained on it
    emits; vLLM's ``hermes`` parser (the one ``kvrelay up`` enables) must recover the calls."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    _, tok, _ = tiny
    prompt = tok.apply_chat_template(TOOL_CONVERSATION[:2], tools=TOOLS, tokenize=False,
                                     add_generation_prompt=True)
    full = tok.apply_chat_template(TOOL_CONVERSATION[:3], tools=TOOLS, tokenize=False)
    completion = full[len(prompt):].removesuffix("<|im_end|>\n")
    request = ChatCompletionRequest(model="tiny", messages=TOOL_CONVERSATION[:2], tools=TOOLS)
    parsed = Hermes2ProToolParser(tok).extract_tool_calls(completion, request)
    assert parsed.tools_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.tool_calls] == [
        ("ls", {"path": "/"}), ("ls", {"path": "/tmp"})]


def test_cache_key_changes_with_anything_that_shapes_the_files(monkeypatch):
    from kvrelay import models

    spec = MODEL_SPECS["tiny"]
    before = spec.fingerprint()
    monkeypatch.setattr(models, "CHAT_TEMPLATE", models.CHAT_TEMPLATE + " ")
    assert spec.fingerprint() != before
    monkeypatch.undo()
    monkeypatch.setattr(models, "TAG_TOKENS", (*models.TAG_TOKENS, "<extra>"))
    assert spec.fingerprint() != before
    monkeypatch.undo()
    assert spec.fingerprint() == before


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    out = []
    for n in (1, 5, 40, 300):
        text = "".join(chr(rng.randrange(32, 127)) for _ in range(n))
        out.append([257, *text.encode(), 258, 10, 257, 97, 10])
    out.append([rng.randrange(0, 265) for _ in range(200)])  # arbitrary ids, specials too
    out.append([rng.randrange(0, VOCAB_SIZE) for _ in range(300)])  # merges too
    return out


def test_printable_margin_holds_on_varied_prompts(tiny):
    """The construction's guarantee: S / a^2 < margin^2 - 1 after the final norm, for every
    position, so an answer token always has the highest logit."""
    _, tok, model = tiny
    spec = MODEL_SPECS["tiny"]
    with torch.no_grad():
        for ids in _prompts():
            out = model(torch.tensor([ids]), output_hidden_states=True)
            h = out.hidden_states[-1][0]
            ratio = (h[:, 1:] ** 2).sum(-1) / h[:, 0] ** 2
            assert (h[:, 0] > 0).all()
            assert float(ratio.max()) < spec.margin**2 - 1
            top = out.logits[0].argmax(-1).tolist()
            assert set(top) <= set(answer_token_ids(tok))


def test_greedy_output_is_printable_and_depends_on_the_prompt(tiny):
    _, tok, model = tiny
    texts = []
    for content in ("What is 2+2?", "Write a haiku about rivers."):
        ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                      add_generation_prompt=True, tokenize=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        text = tok.decode(out[0][len(ids):])
        assert answer_text_ok(text)
        texts.append(text)
    assert texts[0] != texts[1]
