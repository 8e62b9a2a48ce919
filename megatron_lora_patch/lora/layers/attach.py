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

Fail closed: every target entry set by the user (the defaults need not all exist) and
every exclude entry must match some linear layer of the model
(else it is a typo: a `LoraConfigError` naming the entry, where it was set, a "did you
mean" and the layer names that exist), and the model chunk must end with at least one
adapter. A PP stage or EP rank holds only some layers / experts, so an entry that matches
nothing here is checked against the names the whole model has (each layer and expert
index over its full range, the output layer on the other stages).
"""

from __future__ import annotations

import difflib
import itertools
import logging
import re
import weakref
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters.adapter import LoraAdapter
from megatron_lora_patch.lora.adapters.metadata import ADAPTER_NAME, adapter_info
from megatron_lora_patch.lora.adapters.projections import projection_rows
from megatron_lora_patch.lora.config import (
    DEFAULT_TARGETS,
    PATTERN_FIELDS,
    LoraConfig,
    LoraConfigError,
    active_with_labels,
    code_labels,
)
from megatron_lora_patch.lora.config import module_matches as _matches
from megatron_lora_patch.lora.layers.dora_scope import refuse_unproven_dora
from megatron_lora_patch.lora.layers.shared_outer import share_outer_factors
from megatron_lora_patch.lora.layers.trained_fully import is_trained_fully, mark
from megatron_lora_patch.lora.layers.unsupported import refuse_duplicated, refuse_unsupported
from megatron_lora_patch.lora.training.param_sync import hook_linear

logger = logging.getLogger(__name__)

#: Models that carry adapters (weakly held): a checkpoint save of their tensors describes them.
_attached: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def attached_models() -> List[torch.nn.Module]:
    """The live models `attach_adapters` gave adapters to (checkpoints/megatron.py describes their saves)."""
    return list(_attached)


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

    from megatron_lora_patch.lora.layers.te import te_linear_kind

    if isinstance(module, ColumnParallelLinear) and module.weight is not None:
        return "column", False, False
    if isinstance(module, RowParallelLinear):
        return "row", False, False
    te_kind = te_linear_kind(module)
    return (*te_kind, True) if te_kind else None


_INDEX = re.compile(r"(?<=layers\.)\d+|(?<=local_experts\.)\d+")


def _whole_model_names(model: torch.nn.Module, names: List[str]) -> set:
    """The linear names of the whole (world-size-1) model, from those of this chunk."""
    config = getattr(model, "config", None)
    ranges = {
        "layers.": range(getattr(config, "num_layers", 0) or 0),
        "local_experts.": range(getattr(config, "num_moe_experts", 0) or 0),
    }
    whole = set(names)
    for name in names:
        spans = list(_INDEX.finditer(name))
        kinds = [next(k for k in ranges if name.endswith(k, 0, span.start())) for span in spans]
        choices = [ranges[kind] or [span.group()] for kind, span in zip(kinds, spans)]
        for indices in itertools.product(*choices):
            parts, end = [], 0
            for span, index in zip(spans, indices):
                parts += [name[end : span.start()], str(index)]
                end = span.end()
            whole.add("".join(parts) + name[end:])
    if not getattr(model, "post_process", True) and not getattr(model, "share_embeddings_and_output_weights", False):
        whole.add("output_layer")  # on the last pipeline stage
    return whole


def _short_names(names: List[str]) -> List[str]:
    return list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))


def _layer_list(names: List[str]) -> str:
    shorts = _short_names(names)
    example = f" (or fnmatch globs over qualified names such as {names[0]!r})" if names else ""
    return (", ".join(shorts) or "(none)") + example


def _check_entries(
    model: torch.nn.Module, names: List[str], entries: tuple, label: str, what: str = "linear layer"
) -> None:
    """Every entry matches a `what` (one of `names`) here or elsewhere in the whole model, else a typo."""
    whole: Optional[set] = None
    for entry in entries:
        if any(_matches(name, (entry,)) for name in names):
            continue
        whole = _whole_model_names(model, names) if whole is None else whole
        if any(_matches(name, (entry,)) for name in whole):
            continue
        is_glob = any(char in entry for char in "*?[")  # a glob's nearest name says little
        close = [] if is_glob else difflib.get_close_matches(entry, _short_names(names) + sorted(whole), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise LoraConfigError(
            f"{label} entry {entry!r} matches no {what} of the model{hint}; "
            f"{what}s: {_layer_list(names)}"
        )


def _setting(label: str, values: tuple) -> str:
    text = ",".join(values)
    return f"{label}={text!r}" if label.isidentifier() else f"{label} {text!r}"


def _select(model: torch.nn.Module, names: List[str], config: LoraConfig, labels: dict) -> List[str]:
    """The names of the linears to adapt; raises when an entry is a typo or nothing is selected."""
    if config.targets != DEFAULT_TARGETS:  # the defaults need not all exist in every model
        _check_entries(model, names, config.targets, labels["targets"])
    _check_entries(model, names, config.exclude, labels["exclude"])
    targeted = [name for name in names if _matches(name, config.targets)]
    selected = [name for name in targeted if not _matches(name, config.exclude)]
    if selected or any(adapter_info(p) for p in model.parameters()):
        _check_patterns(model, selected, config, labels)
        return selected
    if targeted:
        raise LoraConfigError(
            f"{_setting(labels['exclude'], config.exclude)} excludes all {len(targeted)} linear layers that "
            f"{labels['targets']} selects, so LoRA would train nothing; narrow {labels['exclude']}"
        )
    raise LoraConfigError(  # the entries match layers of other pipeline stages / expert ranks only
        f"{_setting(labels['targets'], config.targets)} selects no linear layer of this model chunk, so its "
        f"rank would train nothing; add one of its layers: {_layer_list(names)}"
    )


def _check_patterns(model: torch.nn.Module, selected: List[str], config: LoraConfig, labels: dict) -> None:
    """Every rank / alpha pattern entry matches an adapted layer; the rank is the same on every
    layer and expert of one module kind (adapter checkpoints stack them into one tensor)."""
    for field in PATTERN_FIELDS:
        entries = tuple(key for key, _ in getattr(config, field))
        _check_entries(model, selected, entries, labels[field], what="adapted layer")
    if not config.rank_pattern:
        return
    whole = [
        name
        for name in sorted(_whole_model_names(model, selected))
        if _matches(name, config.targets) and not _matches(name, config.exclude)
    ]
    kinds: Dict[str, str] = {}
    for name in whole:
        first = kinds.setdefault(_INDEX.sub("*", name), name)
        if config.rank_for(first) != config.rank_for(name):
            raise LoraConfigError(
                f"{labels['rank_pattern']} gives {first} rank {config.rank_for(first)} but {name} rank "
                f"{config.rank_for(name)}; ranks may differ between module kinds, not between layers or "
                "experts of one kind (adapter checkpoints stack them); use patterns without layer or expert indices"
            )


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

    from megatron_lora_patch.lora.layers.te import geometries

    shapes = geometries(module, mode, grouped, is_expert=expert_index is not None)
    if not grouped:
        return [(name, expert_index, shapes[0])]
    offset = get_pg_rank(parent.ep_group) * parent.num_local_experts
    prefix, short = name.rsplit(".", 1)
    return [(f"{prefix}.local_experts.{offset + j}.{short}", offset + j, shape) for j, shape in enumerate(shapes)]


def attach_adapters(model: torch.nn.Module, config: Optional[LoraConfig] = None) -> List[str]:
    """Attach a `LoraAdapter` to every targeted parallel linear of `model`; freeze the rest.

    Returns the canonical names of the adapted modules. Raises `LoraConfigError` when a
    target or exclude entry matches no linear layer, when nothing is selected, when the
    rank exceeds a targeted layer's dimensions, or when a `modules_to_save` entry names a
    module that cannot train fully (`trained_fully.py`). Calling it again adds nothing.
    """
    config, labels = (config, code_labels()) if config is not None else active_with_labels()
    linears: Dict[str, Tuple[Tuple[str, bool, bool], Optional[int], torch.nn.Module, torch.nn.Module]] = {}
    for name, expert_index, module, parent in canonical_modules(model):
        kind = _linear_kind(module)
        if kind is not None:
            linears[name] = (kind, expert_index, module, parent)
    selected = _select(model, list(linears), config, labels)
    refuse_duplicated([name for name in selected if linears[name][0][0] == "duplicated"])
    refuse_unsupported(model, ((name, *linears[name][2:]) for name in selected))
    refuse_unproven_dora(config, labels, ((name, linears[name][1], linears[name][2], linears[name][0][2])
                                          for name in selected))
    trained_fully = mark(model, config, labels, selected)
    for name in selected:
        kind, expert_index, module, parent = linears[name]
        if ADAPTER_NAME in module._modules:
            continue
        adapters = []
        for adapter_name, adapter_expert, geometry in _adapter_specs(name, kind, expert_index, module, parent):
            smallest, rank = min(geometry.input_size, geometry.output_size), config.rank_for(adapter_name)
            if rank > smallest:
                setting = labels["rank_pattern"] if rank != config.rank else labels["rank"]
                raise LoraConfigError(
                    f"LoRA rank {rank} exceeds {name} (in {geometry.input_size}, out "
                    f"{geometry.output_size}); set {setting} <= {smallest}"
                )
            adapters.append(
                LoraAdapter(
                    geometry,
                    parallel_mode=kind[0],
                    module_name=adapter_name,
                    expert_index=adapter_expert,
                    config=config,
                    out_stride=_out_stride(name, parent),
                    projection_rows=projection_rows(adapter_name, getattr(parent, "config", None), adapter_expert)
                    if config.separate_projections else None,
                )
            )
        grouped = kind[1]
        module.add_module(ADAPTER_NAME, torch.nn.ModuleList(adapters) if grouped else adapters[0])
        hook_linear(module)  # DDP's overlapped param gather waits in the adapters' pre-hooks (param_sync.py)
    share_outer_factors(model, config, labels["expert_shared_outer"])
    freeze_base(model)
    _attached.add(model)
    logger.info("LoRA: %d adapters (rank %d, scale %g, patterns %s), trained fully: %s", len(selected), config.rank,
                config.scale, {field: getattr(config, field) for field in PATTERN_FIELDS}, trained_fully or "none")
    return selected


def freeze_base(model: torch.nn.Module) -> None:
    """Only adapter parameters and fully trained weights (`trained_fully`) keep `requires_grad`,
    so DDP and the optimizer see only them."""
    for param in model.parameters():
        if adapter_info(param) is None and not is_trained_fully(param):
            param.requires_grad_(False)
