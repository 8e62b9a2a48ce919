"""Where DoRA (`LoraConfig.dora`, lora/adapters/dora.py) is proven, and the one-line refusals elsewhere.

Proven: the dense Megatron parallel linears of the local spec (column-parallel, including fused qkv
and SwiGLU fc1 with one norm per output row, and row-parallel) under TP, SP, DP and PP, without
dropout. Refused before any step, each with the setting to change:
- dropout: PEFT's DoRA then applies the magnitude to the base term of the *dropped-out* input, a
  different function from the dropout-free one, never compared here;
- MoE experts (sequential or grouped, and shared outer expert factors): their magnitude would have
  the expert-TP / expert-DP domains, unproven;
- Transformer Engine linears: their LoRA term rides TE's forward (lora/layers/te.py), which has no
  rescale of the bias-free output.
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError

DORA_FIX = "turn DoRA off (MEGATRON_LORA_DORA=0, LoraConfig.dora=False)"


def refuse_unproven_dora(config: LoraConfig, labels: dict,
                         selected: Iterable[Tuple[str, Optional[int], torch.nn.Module, bool]]) -> None:
    """Raise `LoraConfigError` when DoRA is on and a setting or a selected `(name, expert index, linear,
    Transformer Engine?)` is outside what DoRA is proven for (the module docstring)."""
    if not config.dora:
        return
    if config.dropout:
        raise LoraConfigError(
            f"DoRA with dropout ({labels['dropout']}={config.dropout:g}) is not supported (PEFT then rescales the "
            f"dropped-out base term, unproven here); set {labels['dropout']}=0 or {DORA_FIX}"
        )
    if config.expert_shared_outer:
        raise LoraConfigError(f"DoRA with {labels['expert_shared_outer']} is not supported; turn it off or {DORA_FIX}")
    for name, expert_index, module, is_te in selected:
        if expert_index is not None or getattr(module, "is_expert", False):
            raise LoraConfigError(
                f"DoRA on MoE experts ({name}) is not supported; exclude them (MEGATRON_LORA_EXCLUDE="
                f"'*experts*') or {DORA_FIX}"
            )
        if is_te:
            raise LoraConfigError(
                f"DoRA on Transformer Engine linears ({name}) is not supported; build the model with the local "
                f"spec (--transformer-impl local) or {DORA_FIX}"
            )
