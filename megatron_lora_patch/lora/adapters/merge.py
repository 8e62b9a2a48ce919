"""Merge LoRA adapters into the base weights (for serving or a full-model export) and back.

Each rank merges its own shard with no communication, because a weight shard's delta
is made of local factors only (docs/architecture.md section 4):
- column-parallel: `W_shard += s * B_shard A` (A replicated; B is cut like W's rows,
  including the SwiGLU `[gate_shard; up_shard]` layout);
- row-parallel: `W_shard += s * B A_shard` (B replicated; A is cut like W's columns).

DoRA (PEFT's merge): `W' = m / ||W + s B A|| * (W + s B A)` per output row. The scale is exact under TP: a
column-parallel shard holds whole rows; a row-parallel shard holds a slice of every row, and the norm is SUMmed
over TP (`LoraAdapter.weight_norm`, one all-reduce per layer), so every rank scales its slice by the same
factor. A model with DoRA adapters therefore merges collectively over TP: call it on every rank. Before the first
all-reduce each TP group's ranks agree on the layers they reduce (`runtime.agreement`, a bounded wait on the store):
a rank that passes other chunks, or never calls, is named in one line within `timeout` instead of hanging its group.

`merge_adapters` detaches the adapters from their layers (so the forward is the plain
base layer with merged weights) and returns them; `unmerge_adapters` divides by DoRA's row scale, subtracts the
same delta (computed in float32) and re-attaches them: the inverse up to the weights' dtype rounding.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME
from megatron_lora_patch.runtime import agreement

Merged = List[Tuple[torch.nn.Module, LoraAdapter, Optional[torch.Tensor]]]  # (layer, adapter, DoRA's row scale)


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


def _merge(layer: torch.nn.Module, adapter: LoraAdapter) -> Optional[torch.Tensor]:
    """`W := W + s B A`, for DoRA then each local row times `m / ||W + s B A||` (a collective over TP for a
    row-parallel layer); returns DoRA's row scale (None: plain LoRA)."""
    weight = layer.weight
    row_scale = None
    if adapter.magnitude is not None:
        row_scale = adapter.m.detach().float() / adapter.weight_norm(weight)
    with torch.no_grad():
        merged = weight.float() + delta(adapter)
        if row_scale is not None:
            merged = merged * row_scale.unsqueeze(1)
        weight.copy_(merged.to(weight.dtype))
    return row_scale


def _unmerge(layer: torch.nn.Module, adapter: LoraAdapter, row_scale: Optional[torch.Tensor]) -> None:
    weight = layer.weight
    with torch.no_grad():
        restored = weight.float() if row_scale is None else weight.float() / row_scale.unsqueeze(1)
        weight.copy_((restored - delta(adapter)).to(weight.dtype))


def _reductions(layers: Iterable[torch.nn.Module]) -> Dict[Tuple[int, ...], List[str]]:
    """The TP group (its global ranks) -> the DoRA row-parallel layers whose merge all-reduces over it, in order."""
    import torch.distributed as dist

    groups: Dict[Tuple[int, ...], List[str]] = {}
    if not dist.is_initialized():
        return groups
    for layer in layers:
        adapter = layer._modules[ADAPTER_NAME]
        magnitude = adapter.magnitude
        if magnitude is not None and magnitude.parallel_mode == "row" and magnitude.group is not None:
            ranks = tuple(dist.get_process_group_ranks(magnitude.group))
            if len(ranks) > 1:
                groups.setdefault(ranks, []).append(adapter.module_name)
    return groups


def _merge_fix(field: str) -> str:
    return "pass the same model chunks to merge_adapters (each rank its shards of the same layers)"


def _agree_on_reductions(layers: List[torch.nn.Module], timeout: float) -> None:
    """Each TP group's ranks agree on the layers they reduce before the first all-reduce (groups in one order on
    every rank, so no two ranks wait for each other in opposite groups)."""
    for ranks, names in sorted(_reductions(layers).items()):
        digest = hashlib.sha256("|".join(names).encode()).hexdigest()[:12]  # all names, kept to one line
        fields = {"layers": f"{len(names)}, {names[0]} to {names[-1]}", "layer names (digest)": digest}
        call = agreement.Call("merge_adapters", "merge_adapters", fields, fix=_merge_fix, peers=ranks,
                              peers_text="every rank of its tensor-parallel group")
        agreement.agree(call, timeout)


def merge_adapters(chunks: Iterable[torch.nn.Module], timeout: float = agreement.DEFAULT_TIMEOUT_S) -> Merged:
    """Merge every adapter into its layer's weight shard and detach the adapter; returns what to unmerge
    (collective over TP when there are DoRA adapters: call on every rank; its TP peers must call within `timeout`
    seconds, else one line names the missing rank)."""
    agreement.check_timeout("merge_adapters", timeout)
    layers = list(_layers_with_adapters(chunks).values())
    _agree_on_reductions(layers, timeout)
    merged: Merged = []
    for layer in layers:
        adapter = layer._modules[ADAPTER_NAME]
        row_scale = _merge(layer, adapter)
        del layer._modules[ADAPTER_NAME]
        merged.append((layer, adapter, row_scale))
    return merged


def unmerge_adapters(merged: Merged) -> None:
    """Undo `merge_adapters`: undo DoRA's row scale, subtract each delta and re-attach the adapter to its layer."""
    for layer, adapter, row_scale in merged:
        if ADAPTER_NAME in layer._modules:
            raise RuntimeError(f"{adapter.module_name} already has an adapter attached; it was not merged")
        _unmerge(layer, adapter, row_scale)
        layer.add_module(ADAPTER_NAME, adapter)
