"""Megatron expert adapters in Hugging Face PEFT's layout for 3D expert parameters (`target_parameters`).

`transformers` 5 keeps each MoE layer's experts as two 3D parameters, `mlp.experts.gate_up_proj`
`[E, 2F, H]` (rows `[gate; up]`, like Megatron's SwiGLU `linear_fc1`) and `mlp.experts.down_proj`
`[E, H, F]`; `peft` (0.18+) adapts them with `LoraConfig(target_parameters=[...])`: one
`ParamWrapper` per parameter holding a rank-r adapter per expert, packed as

    lora_A.weight  [E * r, in]   rows e*r .. e*r+r-1 are expert e's A (expert-major)
    lora_B.weight  [out, r * E]  column k*E + e is column k of expert e's B (expert-minor)

with the delta of expert e `scaling * B_e @ A_e` (peft's `ParamWrapper.get_delta_weight`). That is
exactly Megatron's per-expert adapter of `decoder.layers.L.mlp.experts.local_experts.e.linear_fc1`
(one A for gate and up, as in the fused parameter) and `...linear_fc2`, for SequentialMLP and
TE grouped experts alike (both name their adapters by global expert index, lora/layers/attach.py).
When both parameters of a layer are adapted, peft nests the wrappers in the order the module
declares its parameters: `experts.base_layer.lora_*` is `gate_up_proj`, `experts.lora_*` is `down_proj`.
One wrapper has one r and alpha, so every expert of a layer and kind must share them.
The router (`mlp.gate`) has no adapter. Each family's expert names: its record's `experts`
(lora/exchange/family_table.py).
Layouts: docs/architecture.md section 4.
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, List, Set, Tuple

import torch

from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.lora.exchange import checks
from megatron_lora_patch.lora.exchange import names as peft
from megatron_lora_patch.lora.exchange.family_table import FAMILIES, ExpertNames, with_experts
from megatron_lora_patch.lora.exchange.names import PEFT_PREFIX

_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
#: Megatron linear -> position among the experts module's parameters (peft nests wrappers in this order).
_ORDER = ("linear_fc1", "linear_fc2")


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _parse(name: str) -> Tuple[int, int, str]:
    match = _EXPERT.match(name)
    if match is None:
        raise peft.PeftFormatError(f"{name}: no PEFT name for this Megatron expert module (supported: expert fc1, fc2)")
    return int(match.group(1)), int(match.group(2)), match.group(3)


def _expert_names(family: str) -> ExpertNames:
    record = FAMILIES.get(family)
    if record is None or record.experts is None:
        raise peft.PeftFormatError(
            f"model family {family!r} has no MoE experts in transformers; export MoE adapters with "
            f"--family {' or '.join(with_experts())}"
        )
    return record.experts


def _layer_kinds(names: Iterable[str]) -> Dict[Tuple[int, str], Set[int]]:
    """(layer, linear) -> the expert indices adapted there."""
    kinds: Dict[Tuple[int, str], Set[int]] = {}
    for name in names:
        layer, expert, linear = _parse(name)
        kinds.setdefault((layer, linear), set()).add(expert)
    return kinds


def _paths(kinds: Iterable[Tuple[int, str]], names: ExpertNames, layers: str) -> Dict[Tuple[int, str], Tuple[str, str]]:
    """(layer, linear) -> (HF parameter path, PEFT wrapper path), both without `base_model.model.`."""
    kinds = set(kinds)
    paths = {}
    for layer, linear in kinds:
        module = f"{layers}.{layer}.{names.experts}"
        outer = [other for other in _ORDER[_ORDER.index(linear) + 1 :] if (layer, other) in kinds]
        paths[(layer, linear)] = (f"{module}.{getattr(names, linear)}", module + ".base_layer" * len(outer))
    return paths


def _modules(layer: int, linear: str, num_experts: int) -> List[str]:
    """Megatron's canonical names of one layer's `linear` over all experts, in expert order."""
    return [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}" for e in range(num_experts)]


def _check_complete(kinds: Dict[Tuple[int, str], Set[int]], num_experts: int) -> None:
    for (layer, linear), experts in sorted(kinds.items()):
        if experts != set(range(num_experts)):
            raise peft.PeftFormatError(
                f"decoder.layers.{layer} adapts {linear} of experts {sorted(experts)} only; a PEFT expert adapter "
                f"covers all {num_experts} experts of a layer (target every expert or none)"
            )


def _one_setting(settings: LoraConfig, names: List[str], path: str) -> Tuple[int, float]:
    values = {(settings.rank_for(name), settings.alpha_for(name)) for name in names}
    if len(values) > 1:
        raise peft.PeftFormatError(
            f"{path}: the experts' adapters have (rank, alpha) {sorted(values)}; PEFT has one per layer and parameter"
        )
    return values.pop()


def to_peft(
    logical: peft.Logical, description: dict, family: str
) -> Tuple[Dict[str, torch.Tensor], Dict[str, Tuple[int, float]]]:
    """PEFT tensors of the expert adapters in `logical`, and (rank, alpha) per HF parameter path."""
    if not logical:
        return {}, {}
    names = _expert_names(family)  # the family first: a dense one has no place for experts
    settings, num_experts = LoraConfig.from_description(description), description["num_experts"]
    kinds = _layer_kinds(logical)
    _check_complete(kinds, num_experts)
    tensors: Dict[str, torch.Tensor] = {}
    settings_by_path: Dict[str, Tuple[int, float]] = {}
    for (layer, linear), (path, wrapper) in sorted(_paths(kinds, names, peft.names_for(family).layers).items()):
        experts = _modules(layer, linear, num_experts)
        settings_by_path[path] = _one_setting(settings, experts, path)
        lora_a = torch.cat([logical[name][0] for name in experts], dim=0)
        lora_b = torch.stack([logical[name][1] for name in experts], dim=-1).flatten(1)
        tensors[f"{PEFT_PREFIX}{wrapper}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"{PEFT_PREFIX}{wrapper}.lora_B.weight"] = lora_b.contiguous()
    return tensors, settings_by_path


def target_parameters(paths: Iterable[str], family: str, num_layers: int) -> List[str]:
    """PEFT `target_parameters`: `mlp.experts.<param>` when every layer has it, else full parameter paths."""
    paths, layers = set(paths), re.escape(peft.names_for(family).layers)
    in_layer = {path: re.sub(rf"^{layers}\.\d+\.", "", path) for path in paths}
    complete = all(list(in_layer.values()).count(short) == num_layers for short in in_layer.values())
    return sorted(set(in_layer.values()) if complete else paths)


def from_peft(
    tensors: Dict[str, torch.Tensor], config: dict, description: dict, expected: Iterable[str], family: str, where: str
) -> Tuple[peft.Logical, Set[str]]:
    """The logical expert adapters named in `expected` (exact inverse of `to_peft`), and the PEFT keys read."""
    expected = list(expected)
    if not expected:
        return {}, set()
    # An adapter peft wrote itself names no family (`read` says llama); the MoE families share expert names.
    names = getattr(FAMILIES.get(family), "experts", None) or ExpertNames()
    num_experts = description["num_experts"]
    kinds = _layer_kinds(expected)
    _check_complete(kinds, num_experts)
    logical: peft.Logical = {}
    read: Set[str] = set()
    for (layer, linear), (path, wrapper) in sorted(_paths(kinds, names, peft.names_for(family).layers).items()):
        experts = _modules(layer, linear, num_experts)
        keys = [f"{PEFT_PREFIX}{wrapper}.lora_{factor}.weight" for factor in ("A", "B")]
        for key in keys:
            if key not in tensors:
                raise peft.PeftFormatError(
                    f"{where}: missing {key} (needed for Megatron {experts[0]} and the other experts)"
                )
        read.update(keys)
        lora_a, lora_b = (tensors[key] for key in keys)
        checks.check_declared_rank(config, path, lora_a, where, num_experts)
        for name in experts:
            checks.check_scaling(config, description, name, [path], where)
        rank = LoraConfig.from_description(description).rank_for(experts[0])
        packed = num_experts * rank
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != packed or lora_b.shape[1] != packed:
            raise peft.PeftFormatError(
                f"{where}: {wrapper} has lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}; "
                f"{num_experts} experts of rank {rank} need [{packed}, in] and [out, {packed}]"
            )
        per_a = lora_a.reshape(num_experts, rank, -1)
        per_b = lora_b.reshape(lora_b.shape[0], rank, num_experts)
        for expert, name in enumerate(experts):
            logical[name] = (per_a[expert].clone(), per_b[..., expert].contiguous())
    return logical, read
