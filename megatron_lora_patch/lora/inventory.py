"""What a live model holds: its one chunk on this rank, its adapters, and its plain-data description.

Shared by the adapter checkpoints (`lora/checkpoints/`: the description goes into an adapter-only checkpoint's
common state), the PEFT exchange (`lora/exchange/transfer.py`) and the hand-off (`handoff/`), which all walk the
same model. The description records the adapter settings and shapes, and the architecture a Hugging Face family
must represent (`lora/exchange/families.py`): a Llama cannot represent learned absolute positions, LayerNorm or
a non-gated GeLU MLP (Megatron's defaults), a Qwen3 has per-head q / k norms a Llama lacks. Those fields are read
from the built model's `TransformerConfig` and the `GPTModel` itself (`position_embedding_type` is a model
argument, not a config field before Megatron-Core 0.16), so they say what Megatron really built. Descriptions
written before these fields existed lack them; `families.resolve` then says what it assumes.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.runtime.errors import UsageError

#: Version of the description layout; bumped when its fields change meaning.
DESCRIPTION_FORMAT = 1
#: How the saved factors are laid out: fused qkv B rows per query group `[q heads, k, v]`,
#: SwiGLU fc1 B rows `[gate; up]`, stacked over layers (axis 0) and experts (axis 1).
LAYOUT = "megatron"
#: Architecture fields of the description (each may be missing from older checkpoints).
FIELDS = ("position_embedding_type", "normalization", "activation", "qk_layernorm", "add_bias_linear", "add_qkv_bias",
          "multi_latent_attention")


class AdapterCheckpointError(UsageError, ValueError):
    """An adapter checkpoint is missing, foreign or does not fit the model (the message is one line)."""


def adapters_of(chunks: Iterable[torch.nn.Module]) -> Dict[str, LoraAdapter]:
    """Canonical module name -> adapter, over this rank's model chunks."""
    found = {}
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoraAdapter):
                found[module.module_name] = module
    return found


def single_model(chunks: Iterable[torch.nn.Module]) -> torch.nn.Module:
    """The one model chunk of this rank, unwrapped from DDP / Float16Module (adapter checkpoints take one)."""
    chunks = list(chunks)
    if len(chunks) != 1:
        raise AdapterCheckpointError(
            f"adapter checkpoints take one model chunk per rank, got {len(chunks)} (virtual pipeline stages)"
        )
    model = chunks[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP / Float16Module wrappers
    return model


def _activation_name(function: Any) -> str:
    """`silu`, `gelu`, `squared_relu`, ...: the function's own name (Megatron passes plain functions)."""
    return getattr(function, "__name__", type(function).__name__)


def architecture(model: torch.nn.Module) -> Dict[str, Any]:
    """The `FIELDS` of an (unwrapped) `GPTModel` / `HybridModel`."""
    config = model.config
    position = getattr(model, "position_embedding_type", None) or getattr(config, "position_embedding_type", None)
    return {
        "position_embedding_type": str(position) if position is not None else "none",
        "normalization": str(config.normalization),
        "activation": _activation_name(config.activation_func),
        "qk_layernorm": bool(getattr(config, "qk_layernorm", False)),
        "add_bias_linear": bool(config.add_bias_linear),
        "add_qkv_bias": bool(getattr(config, "add_qkv_bias", False)),
        "multi_latent_attention": bool(getattr(config, "multi_latent_attention", False)),
    }


def describe(chunks: Iterable[torch.nn.Module]) -> Dict[str, Any]:
    """Plain-data description of the model and its adapters (what an exporter needs besides tensors)."""
    model = single_model(chunks)
    config = model.config
    adapters = list(adapters_of([model]).values())
    if not adapters:
        raise AdapterCheckpointError("the model has no LoRA adapters to save; attach them first (lora_linear patch)")
    return {
        "format": DESCRIPTION_FORMAT,
        **adapters[0].lora_config.description(),  # rank, alpha, rslora, patterns, modules_to_save
        "targets": sorted({adapter.module_name.rsplit(".", 1)[-1] for adapter in adapters}),
        "layout": LAYOUT,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups or config.num_attention_heads,
        "kv_channels": config.kv_channels,
        "gated_linear_unit": bool(config.gated_linear_unit),
        "num_experts": config.num_moe_experts or 0,
        "tied_embeddings": bool(getattr(model, "share_embeddings_and_output_weights", False)),
        **architecture(model),  # what a Hugging Face family must represent (export checks it)
    }
