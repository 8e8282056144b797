"""KV cache bytes per token of a model, from its Hugging Face ``config.json``.

Standard attention: ``2 (K and V) * layers * kv_heads * head_dim * dtype_bytes``, with

* layers: ``num_hidden_layers`` (or ``n_layer`` / ``num_layers``);
* kv heads: ``num_key_value_heads`` (or ``num_kv_heads`` / ``n_head_kv`` / ``multi_query``
  = 1), else the attention heads (no GQA);
* head_dim: ``head_dim`` when present, else ``hidden_size / num_attention_heads``
  (``n_embd`` / ``n_head`` for GPT-2 style configs);
* dtype: the KV cache dtype when given (vLLM's ``--kv-cache-dtype``, e.g. ``fp8``), else the
  model's ``torch_dtype`` / ``dtype`` (``float32``, ``bfloat16``, ``float16``, ...).

Multimodal configs keep the language model under ``text_config``, which is read first.
MLA models (``kv_lora_rank``, e.g. DeepSeek-V3) cache one compressed latent per layer:
``layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes``. Sliding-window and hybrid
(Mamba) layers are not modelled: the result is an upper bound for them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES: Mapping[str, float] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "float8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "int8": 1,
}


class ModelConfigError(ValueError):
    """A ``config.json`` from which the KV size cannot be computed."""


@dataclass(frozen=True)
class KvSize:
    """KV bytes per token and how they were computed (for the report)."""

    bytes_per_token: float
    formula: str


def kv_bytes_per_token(config: Mapping[str, Any], kv_cache_dtype: str | None = None) -> KvSize:
    """KV bytes per token of the model ``config`` describes (see the module docstring)."""
    text = config.get("text_config")
    cfg: dict[str, Any] = {**config, **text} if isinstance(text, Mapping) else dict(config)
    layers = _first_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    dtype_name = (kv_cache_dtype if kv_cache_dtype not in (None, "auto")
                  else cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    dtype_bytes = DTYPE_BYTES.get(str(dtype_name).lower().replace("torch.", ""))
    if dtype_bytes is None:
        raise ModelConfigError(f"unknown dtype {dtype_name!r}; known: {sorted(DTYPE_BYTES)}")
    if cfg.get("kv_lora_rank"):
        latent = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return KvSize(layers * latent * dtype_bytes, f"MLA: {layers} layers x {latent} latent "
                                                     f"x {dtype_bytes:g} B ({dtype_name})")
    heads = _first_int(cfg, "num_attention_heads", "n_head", "num_heads")
    if cfg.get("num_key_value_heads") is not None:
        kv_heads = int(cfg["num_key_value_heads"])
    elif cfg.get("num_kv_heads") is not None:
        kv_heads = int(cfg["num_kv_heads"])
    elif cfg.get("n_head_kv") is not None:
        kv_heads = int(cfg["n_head_kv"])
    elif cfg.get("multi_query"):
        kv_heads = 1
    else:
        kv_heads = heads
    if cfg.get("head_dim"):
        head_dim = float(cfg["head_dim"])
    else:
        hidden = _first_int(cfg, "hidden_size", "n_embd", "d_model")
        head_dim = hidden / heads
    total = 2 * layers * kv_heads * head_dim * dtype_bytes
    return KvSize(total, f"2 x {layers} layers x {kv_heads} KV heads x {head_dim:g} head dim x "
                         f"{dtype_bytes:g} B ({dtype_name})")


def load_model_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` (or a model directory holding one) as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{p}: cannot read a JSON config: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{p}: not a JSON object")
    return data


def _first_int(cfg: Mapping[str, Any], *names: str) -> int:
    for name in names:
        value = cfg.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ModelConfigError(f"{name} must be a positive number, got {value!r}")
            return int(value)
    raise ModelConfigError(f"config.json has none of {', '.join(names)}")
