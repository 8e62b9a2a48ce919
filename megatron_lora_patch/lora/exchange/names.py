"""PEFT names: the files of a PEFT adapter directory, a model family's record (its Hugging Face module names:
lora/exchange/family_table.py), and the one-line error for what PEFT cannot express (docs/architecture.md
section 4, "Layouts")."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_lora_patch.lora.exchange.family_table import FAMILIES, Family, HfNames
from megatron_lora_patch.runtime.errors import UsageError

PEFT_PREFIX = "base_model.model."  # where PeftModel puts the wrapped model's names
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
METADATA_NAME = "megatron_lora_patch.json"  # our own fields, kept out of PEFT's config
LEGACY_METADATA_KEY = "megatron_lora_patch"  # where versions up to 0.x embedded them in the PEFT config
# DoRA's magnitude as `get_peft_model_state_dict` saves it: `<module>.lora_magnitude_vector` (peft drops the
# `.<adapter>.weight` of its DoraLinearLayer), one entry per output feature of the HF module.
MAGNITUDE_KEY = "lora_magnitude_vector"

Logical = Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # canonical module name -> (A, B)
Magnitudes = Dict[str, torch.Tensor]  # canonical module name -> DoRA's logical m (one entry per output row)


class PeftFormatError(UsageError, ValueError):
    """A PEFT adapter cannot be expressed as (or made from) this model's adapters; one-line message."""


def family_record(family: str, label: str = "model family") -> Family:
    """The record of `family` (lora/exchange/family_table.py), or a one-line `PeftFormatError` naming the known ones."""
    if family not in FAMILIES:
        raise PeftFormatError(f"unknown {label} {family!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[family]


def names_for(family: str, label: str = "model family") -> HfNames:
    return family_record(family, label).names
