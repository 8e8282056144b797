"""KV bytes per token from config.json: GQA, head_dim absent or explicit, nested text
configs, MLA, GPT-2 style names, dtype fields and overrides, clear errors."""

from __future__ import annotations

import json

import pytest

from kvrelay.tune.kvbytes import ModelConfigError, kv_bytes_per_token, load_model_config

LLAMA3_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_gqa_with_head_dim_from_hidden_size():
    assert kv_bytes_per_token(LLAMA3_8B).bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072


def test_explicit_head_dim_wins():
    qwen3 = {**LLAMA3_8B, "num_hidden_layers": 36, "hidden_size": 2560, "head_dim": 128,
             "dtype": "bfloat16"}
    qwen3.pop("torch_dtype")
    assert kv_bytes_per_token(qwen3).bytes_per_token == 2 * 36 * 8 * 128 * 2


def test_kv_cache_dtype_overrides_the_model_dtype():
    assert kv_bytes_per_token(LLAMA3_8B, "fp8").bytes_per_token == 65536
    assert kv_bytes_per_token(LLAMA3_8B, "auto").bytes_per_token == 131072
    assert kv_bytes_per_token({**LLAMA3_8B, "torch_dtype": "float32"}).bytes_per_token == 262144


def test_no_kv_heads_means_multi_head_and_multi_query_means_one():
    mha = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    assert kv_bytes_per_token(mha).bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert kv_bytes_per_token({**mha, "multi_query": True}).bytes_per_token == 2 * 32 * 128 * 2


def test_text_config_of_a_multimodal_model():
    vlm = {"model_type": "llava", "text_config": LLAMA3_8B, "torch_dtype": "float16"}
    assert kv_bytes_per_token(vlm).bytes_per_token == 131072


def test_gpt2_style_names():
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "torch_dtype": "float32"}
    assert kv_bytes_per_token(gpt2).bytes_per_token == 2 * 12 * 12 * 64 * 4


def test_mla_caches_one_latent_per_layer():
    v3 = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
          "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16"}
    size = kv_bytes_per_token(v3)
    assert size.bytes_per_token == 61 * (512 + 64) * 2 and size.formula.startswith("MLA")


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
    ({**LLAMA3_8B, "torch_dtype": "int3"}, "unknown dtype"),
    ({**LLAMA3_8B, "num_hidden_layers": 0}, "positive"),
])
def test_bad_configs(config, message):
    with pytest.raises(ModelConfigError, match=message):
        kv_bytes_per_token(config)


def test_load_from_a_file_or_its_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    assert load_model_config(tmp_path) == LLAMA3_8B
    assert load_model_config(tmp_path / "config.json") == LLAMA3_8B
    with pytest.raises(ModelConfigError):
        load_model_config(tmp_path / "missing.json")
