"""Default models, generated locally: real Qwen3 architecture, random weights, BPE tokenizer.

This machine has no model hub, so the cluster's default model is built here, deterministically
from a fixed seed, and cached under ``~/.cache/kvrelay/models/<size>-<hash>``. A real model
directory (any local HF checkout) can always be given instead with ``--model PATH``.

The tokenizer and the context fit real agent prompts
----------------------------------------------------
Agent harnesses send tens of kilobytes on their first request (Claude Code: ~77 KB of tools
and system prompt; Codex CLI: ~40 KB). The tokenizer is a byte-level BPE of ``VOCAB_SIZE``
tokens trained when the model is generated, on a committed corpus (``model_corpus.txt``,
written by ``scripts/make_model_corpus.py``: English docs, Markdown, JSON tool schemas and
the harnesses' own prompts): ~3.3 bytes per token on those prompts, and the context is
``MAX_MODEL_LEN`` = 131,072 tokens, so a harness's first request (~23k tokens) leaves room for
a long session. Ids are laid out as the byte-level tokenizer had them: 0..255 are the bytes,
256.. the special and tag tokens, then the merges in the order they were learned, so special
ids (EOS 258) stay where they were. Random text still costs ~1 token per byte.

Why the weights are shaped, not only random
-------------------------------------------
Clients treat a streamed answer with no content as a failure, and a random model happily
emits control bytes, EOS or special tokens. And a turn's KV on D is reusable by the next turn
only as far as the history's tokens (the answer *re-tokenized*) equal the tokens D generated:
an answer of merged-away pieces (``"c"``, ``"at"`` for ``"cat"``) would be re-tokenized into
other ids and end reuse at the answer's first token. So the model answers in *answer tokens*
(``answer_token_ids``): a space and ASCII letters (``" the"``), each its own tokenization, so
any sequence of them tokenizes back into the same ids (the pre-tokenizer splits before every
space). They win *by construction*:

* every token embedding carries a constant ``anchor`` on hidden dim 0, and no layer writes to
  dim 0 (row 0 of every ``o_proj`` and ``down_proj`` is zero), so after the final RMSNorm dim 0
  holds a strictly positive value for every position and every prompt;
* column 0 of ``lm_head`` is ``+margin`` for answer tokens and ``-margin`` for all others,
  while the other columns are scaled so their contribution stays far below that margin.

Among answer tokens the random part decides, so the output depends on the prompt, which is
what makes a wrongly reused KV cache visible in the generated text.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The tokenizer's size: 256 byte tokens, the special and tag tokens, then learned merges.
VOCAB_SIZE = 4096
#: The generated models' context, in tokens.
MAX_MODEL_LEN = 131072
#: The committed text the BPE merges are learned from (``scripts/make_model_corpus.py``).
CORPUS_PATH = Path(__file__).with_name("model_corpus.txt")

#: Tokens after the 256 byte tokens, in id order (256, 257, ...), as Qwen3 has them: the
#: chat markers are special (skipped when decoding), the tool and thinking tags are not, so
#: they survive in generated text where vLLM's ``hermes`` tool parser looks for them.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

#: Qwen3's chat template for system, user and assistant turns, tools and tool calls, minus
#: thinking. As in Qwen3: ``tools`` go into the system prompt (merged with a leading system
#: message), an assistant's ``tool_calls`` render as ``<tool_call>\n{"name": ..., "arguments":
#: ...}\n</tool_call>`` (what the ``hermes`` parser reads back), and consecutive ``tool``
#: messages form one user turn of ``<tool_response>`` blocks. Conversations without tools,
#: tool calls or tool messages render exactly as before tools were supported (same token ids).
#: Message content may be a string or a list of OpenAI content parts. A newline right after a
#: block tag is written as ``{{ '\\n' }}``: chat templates render with ``trim_blocks``.
CHAT_TEMPLATE = (
    "{% macro text(content) %}"
    "{% if content is string %}{{ content }}"
    "{% elif content is iterable %}"
    "{% for part in content %}{% if part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}"
    "{{ text(messages[0].content) }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first and tools %}"
    "{% elif message.role == 'assistant' %}"
    "{% set content = text(message.content) %}"
    "<|im_start|>assistant\n{{ content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if (loop.first and content) or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set fn = call.function if call.function is defined else call %}"
    '<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{% if fn.arguments is string %}{{ fn.arguments }}"
    "{% else %}{{ fn.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ text(message.content) }}\n</tool_response>"
    "{% if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ text(message.content) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Bump when the way files are generated changes in a way ``ModelSpec`` does not capture.
GENERATOR_VERSION = 3


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and construction constants of one generated model size."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = MAX_MODEL_LEN
    vocab_size: int = VOCAB_SIZE
    seed: int = 1234
    #: Layer weights are N(0, gain^2 / fan_in): activations stay O(1) through the layers.
    gain: float = 1.0
    #: Sharpens attention (Qwen3's per-head q RMSNorm weight) so outputs depend on context.
    q_norm_scale: float = 4.0
    #: Dim-0 anchor in units of sqrt(hidden_size).
    anchor: float = 1.0
    #: lm_head column-0 weight: +margin for printable tokens, -margin for the rest.
    margin: float = 16.0

    def fingerprint(self) -> str:
        """Stable short hash of everything that determines the generated files: the spec, the
        tokenizer's added tokens and training corpus, the chat template and the generator's
        version. It names the cache directory, so changing any of them builds a new model
        instead of reusing a stale one."""
        payload = json.dumps(
            {
                "spec": asdict(self),
                "special_tokens": SPECIAL_TOKENS,
                "tag_tokens": TAG_TOKENS,
                "corpus": hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest(),
                "template": CHAT_TEMPLATE,
                "v": GENERATOR_VERSION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


MODEL_SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    ),
    # ~12M parameters: prefill of 16k tokens takes seconds on one CPU core, so what reuse
    # saves is visible, while a full 2k-24k sweep still fits in minutes.
    "bench": ModelSpec(
        name="bench",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


def default_cache_dir() -> Path:
    root = os.environ.get("KVRELAY_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvrelay"


def model_dir(size: str, cache_dir: Path | None = None) -> Path:
    spec = _spec(size)
    return (cache_dir or default_cache_dir()) / "models" / f"{spec.name}-{spec.fingerprint()}"


def ensure_model(size: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Return the directory of the generated model ``size``, building it on first use.

    Idempotent and safe against a crash mid-write: the model is written to a temporary
    directory and renamed into place, so a directory that exists is complete.
    """
    target = model_dir(size, cache_dir)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    build_model(_spec(size), tmp)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    return target


def _spec(size: str) -> ModelSpec:
    try:
        return MODEL_SPECS[size]
    except KeyError:
        choices = sorted(MODEL_SPECS)
        raise ValueError(f"unknown model size {size!r}; choose from {choices}") from None


def build_tokenizer(vocab_size: int = VOCAB_SIZE, max_model_len: int = MAX_MODEL_LEN) -> Any:
    """The default models' tokenizer: byte-level BPE trained on ``CORPUS_PATH`` (deterministic:
    the same corpus gives the same merges), ids laid out as described in the module docstring.

    Contract: ids 0..255 are the 256 bytes (GPT-2's byte-to-unicode alphabet), 256..264
    ``SPECIAL_TOKENS`` then ``TAG_TOKENS``, the rest merges in learned order; ``vocab_size``
    ids in all.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    added = (*SPECIAL_TOKENS, *TAG_TOKENS)
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    learner.train_from_iterator([CORPUS_PATH.read_text()], trainer)
    learned = json.loads(learner.to_str())["model"]["merges"]

    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    for i, token in enumerate(added):
        vocab[token] = 256 + i  # in the model's vocab, so the added tokens keep these ids
    merges: list[tuple[str, str]] = []
    for merge in learned:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        if left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=max_model_len,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def answer_token_ids(tokenizer: Any) -> list[int]:
    """The ids a generated model answers in: tokens that are a space and 2+ ASCII letters and
    are their own tokenization (``encode(decode([t])) == [t]``). Any sequence of them
    tokenizes back into the same ids (a byte-level pre-tokenizer splits before each space),
    so a re-sent answer's tokens equal what D generated and the whole turn stays reusable.

    Works for any Hugging Face tokenizer; empty when it has no such tokens (a tokenizer
    without a byte-level pre-tokenizer, for example).
    """
    special = set(tokenizer.all_special_ids)
    out = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        text = tokenizer.decode([token_id])
        word = text[1:]
        if not (text.startswith(" ") and len(word) >= 2 and word.isascii() and word.isalpha()):
            continue
        if list(tokenizer.encode(text, add_special_tokens=False)) == [token_id]:
            out.append(token_id)
    return out


def answer_text_ok(text: str) -> bool:
    """What a generated model's answer looks like: words of ASCII letters, each after a space."""
    first, *words = text.split(" ")
    return first == "" and bool(words) and all(w.isascii() and w.isalpha() for w in words)


def build_model(spec: ModelSpec, out_dir: Path) -> None:
    """Write config, safetensors weights, tokenizer and chat template for ``spec``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tokenizer(spec.vocab_size, spec.max_position_embeddings)
    eos_id = 256 + SPECIAL_TOKENS.index("<|im_end|>")
    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=256,
        torch_dtype="float32",
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    shape_weights(model, spec, answer_token_ids(tokenizer))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)  # type: ignore[attr-defined]
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": 256}) + "\n"
    )
    (out_dir / "kvrelay_model.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")


def shape_weights(model: object, spec: ModelSpec, answer_ids: Sequence[int]) -> None:
    """Apply the answer-tokens-by-construction shaping described in the module docstring.

    Guarantee: after the final RMSNorm let ``a`` be dim 0 and ``S`` the squared norm of the
    other dims. An answer token beats every other token when ``margin * a > sqrt(a^2 + S)``
    (the other lm_head columns have unit norm per row), i.e. when ``S / a^2 < margin^2 - 1``.
    ``tests/unit/test_model.py`` measures that ratio on varied prompts.
    """
    import math

    import torch

    m = model.model  # type: ignore[attr-defined]
    d = spec.hidden_size
    generator = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for param in m.layers.parameters():
            if param.dim() == 2:
                std = spec.gain / math.sqrt(param.shape[1])
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        m.embed_tokens.weight.copy_(torch.randn(m.embed_tokens.weight.shape, generator=generator))
        m.embed_tokens.weight[:, 0] = spec.anchor * math.sqrt(d)
        for layer in m.layers:
            layer.self_attn.q_norm.weight.fill_(spec.q_norm_scale)
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        lm_head = model.lm_head.weight  # type: ignore[attr-defined]
        rest = torch.randn(lm_head.shape[0], lm_head.shape[1] - 1, generator=generator)
        lm_head[:, 1:] = rest / rest.norm(dim=1, keepdim=True)
        lm_head[:, 0] = -spec.margin
        lm_head[list(answer_ids), 0] = spec.margin


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
