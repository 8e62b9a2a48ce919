"""PEFT names: the files of a PEFT adapter directory, the Hugging Face module names per model family,
and the one-line error for what PEFT cannot express (docs/architecture.md section 4, "Layouts")."""

from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import torch

from megatron_lora_patch.runtime.errors import UsageError

PEFT_PREFIX = "base_model.model."  # where PeftModel puts the wrapped model's names
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
METADATA_NAME = "megatron_lora_patch.json"  # our own fields, kept out of PEFT's config
LEGACY_METADATA_KEY = "megatron_lora_patch"  # where versions up to 0.x embedded them in the PEFT config

Logical = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # canonical module name -> (A, B)


class PeftFormatError(UsageError, ValueError):
    """A PEFT adapter cannot be expressed as (or made from) this model's adapters; one-line message."""


@dataclasses.dataclass(frozen=True)
class HfNames:
    """Where a Hugging Face model family keeps the projections LoRA targets."""

    layers: str = "model.layers"
    attention: str = "self_attn"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    mlp: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared_experts: str = ""  # the shared experts' MLP (lora/exchange/mlp.py); "" where the family has none


#: Model families whose decoder layers use these names (Llama-style; add rows for others).
NAME_TABLE: Dict[str, HfNames] = {
    "llama": HfNames(),
    "mistral": HfNames(),
    "qwen2": HfNames(),
    "qwen3": HfNames(),
    "qwen3_moe": HfNames(),  # experts: experts.EXPERT_TABLE
    "mixtral": HfNames(),
    "qwen2_moe": HfNames(shared_experts="mlp.shared_expert"),  # shared experts: docs/handoff.md section 2
}

def names_for(family: str, label: str = "model family") -> HfNames:
    if family not in NAME_TABLE:
        raise PeftFormatError(f"unknown {label} {family!r}; known: {', '.join(NAME_TABLE)}")
    return NAME_TABLE[family]
