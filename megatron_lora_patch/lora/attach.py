"""The model-level pass that attaches adapters and freezes the base model.

Why a model-level pass and not the linear layer's `__init__`: both target selection
(`linear_qkv`, excludes by qualified name) and topology-invariant init (a function of
the module name) need the layer's qualified name, which a layer does not know while
it is being built. The `lora_linear` patch runs this pass right after `GPTModel`
finishes construction (before Megatron-LM's `get_model` wraps it in DDP and builds the
optimizer); other models can call `attach_adapters(model)` themselves.

Names are canonicalized to the world-size-1 model: a transformer layer's index is its
global `layer_number - 1` (PP / VPP stages hold local indices), and a local expert's
index is its global expert index (EP ranks hold local indices).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .adapter import LoraAdapter
from .config import LoraConfig, LoraConfigError, active
from .metadata import ADAPTER_NAME, adapter_info

logger = logging.getLogger(__name__)


def canonical_modules(model: torch.nn.Module) -> Iterator[Tuple[str, Optional[int], torch.nn.Module, torch.nn.Module]]:
    """`(canonical name, global expert index or None, module, parent)` for every submodule."""
    from megatron.core.utils import get_pg_rank

    def walk(module, prefix, expert_index):
        expert_offset = None
        if isinstance(getattr(module, "local_experts", None), torch.nn.ModuleList):
            # SequentialMLP: local expert j of EP rank e is global expert e * num_local + j.
            expert_offset = get_pg_rank(module.ep_group) * module.num_local_experts
        for child_name, child in module.named_children():
            segments = [child_name]
            child_expert = expert_index
            if child_name == "local_experts" and expert_offset is not None:
                for local_index, expert in child.named_children():
                    global_index = expert_offset + int(local_index)
                    yield from visit(expert, module, f"{prefix}local_experts.{global_index}", global_index)
                continue
            if isinstance(module, torch.nn.ModuleList) and isinstance(getattr(child, "layer_number", None), int):
                segments = [str(child.layer_number - 1)]  # global layer index, whatever the PP stage
            yield from visit(child, module, prefix + ".".join(segments), child_expert)

    def visit(module, parent, name, expert_index):
        yield name, expert_index, module, parent
        yield from walk(module, name + ".", expert_index)

    yield from walk(model, "", None)


def _linear_kind(module: torch.nn.Module) -> Optional[Tuple[str, bool, bool]]:
    """(parallel mode, grouped, Transformer Engine) of an adaptable linear, else None."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from .te import te_linear_kind

    if isinstance(module, ColumnParallelLinear) and module.weight is not None:
        return "column", False, False
    if isinstance(module, RowParallelLinear):
        return "row", False, False
    te_kind = te_linear_kind(module)
    return (*te_kind, True) if te_kind else None


def _matches(name: str, patterns: tuple) -> bool:
    short = name.rsplit(".", 1)[-1]
    return any(pattern == short or fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def _out_stride(name: str, parent: torch.nn.Module) -> int:
    """2 for a gated (SwiGLU) fc1 (MLP, or TE grouped experts): TP shards hold `[gate_shard; up_shard]`."""
    gated = getattr(getattr(parent, "config", None), "gated_linear_unit", False)
    return 2 if gated and name.endswith("linear_fc1") else 1


def _adapter_specs(name, kind, expert_index, module, parent) -> List[Tuple[str, Optional[int], object]]:
    """`(canonical name, expert index, geometry)` of each adapter a linear gets.

    Megatron linears are their own geometry; a TE linear gets one from its weight(s); a
    TE grouped linear holds all local experts, so it gets one adapter per expert, named
    like SequentialMLP's (`...experts.local_experts.<global index>.linear_fc1`).
    """
    mode, grouped, is_te = kind
    if not is_te:
        return [(name, expert_index, module)]
    from megatron.core.utils import get_pg_rank

    from .te import geometries

    shapes = geometries(module, mode, grouped, is_expert=expert_index is not None)
    if not grouped:
        return [(name, expert_index, shapes[0])]
    offset = get_pg_rank(parent.ep_group) * parent.num_local_experts
    prefix, short = name.rsplit(".", 1)
    return [(f"{prefix}.local_experts.{offset + j}.{short}", offset + j, shape) for j, shape in enumerate(shapes)]


def attach_adapters(model: torch.nn.Module, config: Optional[LoraConfig] = None) -> List[str]:
    """Attach a `LoraAdapter` to every targeted parallel linear of `model`; freeze the rest.

    Returns the canonical names of the adapted modules. Raises `LoraConfigError` when
    the targets match no linear layer (listing the ones that exist) or when the rank
    exceeds a targeted layer's dimensions. Calling it again adds nothing.
    """
    config = config or active()
    linears: Dict[str, Tuple[Tuple[str, bool, bool], Optional[int], torch.nn.Module, torch.nn.Module]] = {}
    for name, expert_index, module, parent in canonical_modules(model):
        kind = _linear_kind(module)
        if kind is not None:
            linears[name] = (kind, expert_index, module, parent)
    selected = [
        name for name in linears if _matches(name, config.targets) and not _matches(name, config.exclude)
    ]
    if not selected and not any(adapter_info(p) for p in model.parameters()):
        raise LoraConfigError(
            f"LoRA targets {','.join(config.targets)} (exclude {','.join(config.exclude) or '-'}) match no "
            f"linear layer; set MEGATRON_LORA_TARGETS to names from: {', '.join(linears) or '(none)'}"
        )
    for name in selected:
        kind, expert_index, module, parent = linears[name]
        if ADAPTER_NAME in module._modules:
            continue
        adapters = []
        for adapter_name, adapter_expert, geometry in _adapter_specs(name, kind, expert_index, module, parent):
            smallest = min(geometry.input_size, geometry.output_size)
            if config.rank > smallest:
                raise LoraConfigError(
                    f"LoRA rank {config.rank} exceeds {name} (in {geometry.input_size}, out "
                    f"{geometry.output_size}); set MEGATRON_LORA_RANK <= {smallest}"
                )
            adapters.append(
                LoraAdapter(
                    geometry,
                    parallel_mode=kind[0],
                    module_name=adapter_name,
                    expert_index=adapter_expert,
                    config=config,
                    out_stride=_out_stride(name, parent),
                )
            )
        grouped = kind[1]
        module.add_module(ADAPTER_NAME, torch.nn.ModuleList(adapters) if grouped else adapters[0])
    freeze_base(model)
    logger.info("LoRA: %d adapters (rank %d, scale %g)", len(selected), config.rank, config.scale)
    return selected


def freeze_base(model: torch.nn.Module) -> None:
    """Only adapter parameters keep `requires_grad`, so DDP and the optimizer see only them."""
    for param in model.parameters():
        if adapter_info(param) is None:
            param.requires_grad_(False)
