"""One fc1 A and one fc2 B per MoE layer, shared by all its routed experts (`expert_shared_outer`).

SGLang's `--experts-shared-outer-loras` serves MoE LoRA with one gate_up lora_A and one down lora_B per
layer (the outer factors) and per-expert gate_up lora_B and down lora_A (the inner ones); docs/handoff.md
section 4 cites its loader. With `MEGATRON_LORA_EXPERT_SHARED_OUTER=1` training has that shape: every
routed expert keeps its own fc1 B and fc2 A, and the outer factors are one Parameter per layer that each
local expert's adapter holds as its `A` (linear_fc1) / `B` (linear_fc2).

- Init: the logical factor of (seed, the layer's experts module name such as
  `decoder.layers.0.mlp.experts.linear_fc1`, no expert index), topology-invariant like every adapter.
- Gradient: autograd sums the local experts' contributions into the one Parameter; it is replicated over
  expert TP (column A / row B), so `grad_sync` SUMs it there (its tag); and it is replicated over the EP
  ranks and expert-DP, which together are the dense DP group when expert TP equals TP: `allreduce=True`
  puts it into Megatron DDP's dense buffers, reduced over every DP rank like a dense weight. (An expert
  weight is reduced over expert-DP only, which would leave each EP rank with its own experts' part.)
- Grad norm: tagged replicated, so the patched duplicate predicate counts it on expert-TP rank 0 of its
  dense model-parallel group: once.
- Checkpoint: each local expert's linear still describes its `lora.A` / `lora.B`, so checkpoints keep the
  per-expert layout (the shared factor written under every expert index, identical copies) and export,
  import and resharding read them as before; the description records `expert_shared_outer`, and
  `load_adapters` refuses a checkpoint trained the other way.

Refused in one line before any step: separate projections, Transformer Engine grouped experts, expert TP
different from TP, the layout-invariant mode, a model without adapted routed experts.
"""

from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.init import logical_factors
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME, AdapterParamInfo, adapter_info, tag
from megatron_lora_patch.lora.config import LoraConfig, LoraConfigError

#: expert linear -> the factor its layer shares
OUTER_FACTORS = {"linear_fc1": "A", "linear_fc2": "B"}
_LOCAL_EXPERT = re.compile(r"\.local_experts\.\d+\.")
LAYOUT_INVARIANT_PATCH = "layout_invariant"


def shared_name(module_name: str) -> str:
    """`...mlp.experts.local_experts.3.linear_fc1` -> `...mlp.experts.linear_fc1` (the layer's shared factor)."""
    return _LOCAL_EXPERT.sub(".", module_name)


def _groups(model: torch.nn.Module) -> Dict[Tuple[str, str], List[LoraAdapter]]:
    """(shared name, factor) -> the local expert adapters holding it."""
    groups: Dict[Tuple[str, str], List[LoraAdapter]] = {}
    for module in model.modules():
        if isinstance(module, LoraAdapter) and module.expert_index is not None:
            factor = OUTER_FACTORS.get(module.module_name.rsplit(".", 1)[-1])
            if factor is not None:
                groups.setdefault((shared_name(module.module_name), factor), []).append(module)
    return groups


def _layout_invariant_on() -> bool:
    from megatron_lora_patch.runtime import registry

    return any(row.patch == LAYOUT_INVARIANT_PATCH and row.state == "applied" for row in registry.status())


def _refusal(model: torch.nn.Module, config: LoraConfig, groups: dict) -> str:
    """Why this model cannot share outer expert factors ('' when it can)."""
    from megatron.core.utils import get_pg_size

    model_config = getattr(model, "config", None)
    grouped = any(isinstance(module._modules.get(ADAPTER_NAME), torch.nn.ModuleList) for module in model.modules())
    tp = getattr(model_config, "tensor_model_parallel_size", 1) or 1
    etp = {get_pg_size(adapter.tp_group) for adapters in groups.values() for adapter in adapters}
    if config.separate_projections:
        return "it shares one fc1 A for gate and up, separate projections give them two; set one of them to 0"
    if grouped:
        return ("Transformer Engine grouped experts (TEGroupedMLP) hold all local experts in one linear; build the "
                "experts as SequentialMLP (no --moe-grouped-gemm)")
    if not groups:
        return "the model has no adapted routed expert linear_fc1 / linear_fc2 (an MoE model with them targeted)"
    if etp != {tp}:
        return (f"expert TP {sorted(etp)} differs from TP {tp}, and the shared factors are reduced over the dense DP "
                "group, which spans the EP and expert-DP ranks only when they are equal; set "
                "--expert-tensor-parallel-size to the TP size")
    if _layout_invariant_on():
        return "the layout-invariant mode does not support it; turn it off (MEGATRON_LORA_PATCH_LAYOUT_INVARIANT=0)"
    return ""


def _shared_parameter(name: str, factor: str, first: LoraAdapter, config: LoraConfig) -> torch.nn.Parameter:
    """The layer's logical outer factor (replicated over expert TP: every rank holds all of it), tagged."""
    local = getattr(first, factor)
    in_size, out_size = (local.shape[1], 1) if factor == "A" else (1, local.shape[0])
    logical = logical_factors(config, name, None, in_size, out_size)[0 if factor == "A" else 1]
    if logical.shape != local.shape:  # a rank_pattern glob over expert names that misses `name`
        raise LoraConfigError(f"rank_pattern gives {name} rank {config.rank_for(name)} but its experts rank "
                              f"{first.rank}; give the experts' rank by module kind (e.g. linear_fc1=8)")
    param = torch.nn.Parameter(logical.to(device=local.device, dtype=local.dtype))
    info = AdapterParamInfo(module=name, factor="A" if factor == "A" else "B", replicated=True, domain="expert_tp",
                            group=first.tp_group, expert=False)
    tag(param, info)
    param.allreduce = True  # dense DDP buffers: reduced over every DP rank, EP ranks included
    return param


def share_outer_factors(model: torch.nn.Module, config: LoraConfig, label: str) -> List[str]:
    """Give each MoE layer's local expert adapters one shared fc1 A and one shared fc2 B (`config.
    expert_shared_outer`); returns the shared factors' names. `label` names the setting in a refusal.
    Calling it again shares nothing new (factors already shared are kept, trained values included)."""
    if not config.expert_shared_outer:
        return []
    groups = _groups(model)
    reason = _refusal(model, config, groups)
    if reason:
        setting = f"{label}=1" if label.isidentifier() else label
        raise LoraConfigError(f"{setting} (one fc1 A and one fc2 B per MoE layer) is not supported here: {reason}")
    for (name, factor), adapters in groups.items():
        info = adapter_info(getattr(adapters[0], factor))
        if info is not None and info.module == name:
            continue  # already shared by an earlier call
        param = _shared_parameter(name, factor, adapters[0], config)
        for adapter in adapters:
            setattr(adapter, factor, param)
    return sorted(f"{name}.{factor}" for name, factor in groups)
