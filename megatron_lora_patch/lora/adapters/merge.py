"""Merge LoRA adapters into the base weights (for serving or a full-model export) and back.

Each rank merges its own shard with no communication, because a weight shard's delta
is made of local factors only (docs/architecture.md section 4):
- column-parallel: `W_shard += s * B_shard A` (A replicated; B is cut like W's rows,
  including the SwiGLU `[gate_shard; up_shard]` layout);
- row-parallel: `W_shard += s * B A_shard` (B replicated; A is cut like W's columns).

`merge_adapters` detaches the adapters from their layers (so the forward is the plain
base layer with merged weights) and returns them; `unmerge_adapters` subtracts the same
delta (computed in float32) and re-attaches them: the inverse up to the weights' dtype rounding.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME
from megatron_lora_patch.runtime.errors import UsageError

Merged = List[Tuple[torch.nn.Module, LoraAdapter]]


def delta(adapter: LoraAdapter) -> torch.Tensor:
    """`s * B A` of this rank's factors, in float32: the local slice of the logical weight delta."""
    return adapter.scale * adapter.up_weight().detach().float() @ adapter.A.detach().float()


def _layers_with_adapters(chunks: Iterable[torch.nn.Module]) -> Dict[str, torch.nn.Module]:
    return {
        name: module
        for chunk in chunks
        for name, module in chunk.named_modules()
        if isinstance(module._modules.get(ADAPTER_NAME), LoraAdapter)
    }


def _add_delta(layer: torch.nn.Module, adapter: LoraAdapter, sign: float) -> None:
    weight = layer.weight
    with torch.no_grad():
        weight.copy_((weight.float() + sign * delta(adapter)).to(weight.dtype))


def merge_adapters(chunks: Iterable[torch.nn.Module]) -> Merged:
    """Add every adapter's delta to its layer's weight shard and detach the adapter; returns what to unmerge."""
    layers = _layers_with_adapters(chunks)
    dora = [adapter.module_name for layer in layers.values() if (adapter := layer._modules[ADAPTER_NAME]).magnitude]
    if dora:
        raise UsageError(f"merge_adapters: {dora[0]} has a DoRA adapter ({len(dora)} in all), whose merge rescales "
                         "each weight row; merging DoRA is not supported yet (train with MEGATRON_LORA_DORA=0)")
    merged: Merged = []
    for layer in layers.values():
        adapter = layer._modules[ADAPTER_NAME]
        _add_delta(layer, adapter, +1.0)
        del layer._modules[ADAPTER_NAME]
        merged.append((layer, adapter))
    return merged


def unmerge_adapters(merged: Merged) -> None:
    """Undo `merge_adapters`: subtract each delta and re-attach the adapter to its layer."""
    for layer, adapter in merged:
        if ADAPTER_NAME in layer._modules:
            raise RuntimeError(f"{adapter.module_name} already has an adapter attached; it was not merged")
        _add_delta(layer, adapter, -1.0)
        layer.add_module(ADAPTER_NAME, adapter)
