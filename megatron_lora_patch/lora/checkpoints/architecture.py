"""The model architecture a checkpoint description records, beside the adapter shapes.

`export` needs to know whether a Hugging Face family can hold the model the adapters were
trained on (lora/exchange/families.py): a Llama cannot represent learned absolute positions,
LayerNorm or a non-gated GeLU MLP (Megatron's defaults), a Qwen3 has per-head q / k norms a
Llama lacks. These fields are read from the built model's `TransformerConfig` and the
`GPTModel` itself (`position_embedding_type` is a model argument, not a config field before
Megatron-Core 0.16), so they say what Megatron really built. Descriptions written before these
fields existed lack them; `families.check` then says what it assumes.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

#: Description fields this module adds (each may be missing from older checkpoints).
FIELDS = ("position_embedding_type", "normalization", "activation", "qk_layernorm", "add_bias_linear", "add_qkv_bias")


def _activation_name(function: Any) -> str:
    """`silu`, `gelu`, `squared_relu`, ...: the function's own name (Megatron passes plain functions)."""
    return getattr(function, "__name__", type(function).__name__)


def fields(model: torch.nn.Module) -> Dict[str, Any]:
    """Plain-data architecture fields of an (unwrapped) `GPTModel` / `HybridModel`."""
    config = model.config
    position = getattr(model, "position_embedding_type", None) or getattr(config, "position_embedding_type", None)
    return {
        "position_embedding_type": str(position) if position is not None else "none",
        "normalization": str(config.normalization),
        "activation": _activation_name(config.activation_func),
        "qk_layernorm": bool(getattr(config, "qk_layernorm", False)),
        "add_bias_linear": bool(config.add_bias_linear),
        "add_qkv_bias": bool(getattr(config, "add_qkv_bias", False)),
    }
