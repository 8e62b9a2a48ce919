"""Hugging Face PEFT export / import of LoRA adapters (`adapter_model.safetensors` + `adapter_config.json`).

The logical (world-size-1) adapters are the source and target of both directions:
export reads them from an adapter-only distributed checkpoint (`checkpoint.save_adapters`;
Megatron's `dist_checkpointing` gathers the TP / EP / PP shards), import slices them
onto this rank's adapters (any topology). Conversion, per transformer layer i:

| Megatron module            | PEFT modules (Llama names)                  | how                           |
|----------------------------|---------------------------------------------|-------------------------------|
| self_attention.linear_qkv  | self_attn.q_proj, k_proj, v_proj            | B split from the mixed per-query-group rows (GQA); the one A copied to all three |
| self_attention.linear_proj | self_attn.o_proj                            | as is                         |
| mlp.linear_fc1 (SwiGLU)    | mlp.gate_proj, up_proj                      | B rows [gate; up] split; A copied |
| mlp.linear_fc2             | mlp.down_proj                               | as is                         |

With `separate_projections` each projection gets its own A rows and B block (lora/projections.py).
PEFT's scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`) is the adapter's
`s`; per-module ranks and alphas travel as PEFT's `rank_pattern` / `alpha_pattern` (keys are
regexes matched against the end of a module path, the first matching key wins): export writes a
projection name (`gate_proj`) when every layer shares the value, else full module paths.
Import refuses, naming the module, what the model's adapters cannot express (different A's
on a shared-A fused layer, other shapes, missing or unknown modules, another r, alpha or rsLoRA, DoRA, biases).
`adapter_config.json` holds only PEFT's own fields (peft warns about any other key); this
package's metadata (the model family) sits beside it in `megatron_lora_patch.json`.
Expert adapters (MoE families): PEFT's `target_parameters` layout (lora/peft_experts.py); fully
trained modules (`modules_to_save`: `lm_head`, `embed_tokens`): lora/peft_modules.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_lora_patch.errors import UsageError

from . import layouts, peft_mlp, peft_modules, projections
from .config import LoraConfig
from .peft_modules import PEFT_PREFIX

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
    shared_experts: str = ""  # the shared experts' MLP (lora/peft_mlp.py); "" where the family has none


#: Model families whose decoder layers use these names (Llama-style; add rows for others).
NAME_TABLE: Dict[str, HfNames] = {
    "llama": HfNames(),
    "mistral": HfNames(),
    "qwen2": HfNames(),
    "qwen3": HfNames(),
    "qwen3_moe": HfNames(),  # experts: peft_experts.EXPERT_TABLE
    "qwen2_moe": HfNames(shared_experts="mlp.shared_expert"),  # shared experts: docs/handoff.md section 2
    "mixtral": HfNames(),
}

_LAYER_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|"
                           r"mlp\.(?:shared_experts\.)?linear_fc1|mlp\.(?:shared_experts\.)?linear_fc2)$")


def names_for(family: str, label: str = "model family") -> HfNames:
    if family not in NAME_TABLE:
        raise PeftFormatError(f"unknown {label} {family!r}; known: {', '.join(NAME_TABLE)}")
    return NAME_TABLE[family]


def _projections(module: str, names: HfNames, gated: bool) -> List[str]:
    """HF module paths (inside a layer) that one Megatron module becomes, in split order."""
    if module == "self_attention.linear_qkv":
        return [f"{names.attention}.{p}" for p in (names.q, names.k, names.v)]
    if module == "self_attention.linear_proj":
        return [f"{names.attention}.{names.o}"]
    return peft_mlp.projections(module, names, gated)


def _split_b(module: str, b: torch.Tensor, description: dict) -> List[torch.Tensor]:
    if module == "self_attention.linear_qkv":
        return list(
            layouts.qkv_mixed_to_separate(
                b, description["num_attention_heads"], description["num_query_groups"], description["kv_channels"]
            )
        )
    if module.endswith("linear_fc1"):  # mlp or mlp.shared_experts
        return list(layouts.fc1_to_gate_up(b))
    return [b]


def _join_b(module: str, parts: List[torch.Tensor], description: dict) -> torch.Tensor:
    if module == "self_attention.linear_qkv":
        return layouts.qkv_separate_to_mixed(*parts, description["num_query_groups"], description["kv_channels"])
    if module.endswith("linear_fc1"):
        return layouts.gate_up_to_fc1(*parts)
    return parts[0]


def _parse(name: str) -> Tuple[int, str]:
    match = _LAYER_MODULE.match(name)
    if match is None:
        raise PeftFormatError(f"{name}: no PEFT name for this Megatron module (supported: qkv, proj, fc1, fc2)")
    return int(match.group(1)), match.group(2)


def to_peft(
    logical: Logical, description: dict, family: str = "llama", full: Optional[Dict[str, torch.Tensor]] = None
) -> Tuple[Dict[str, torch.Tensor], dict]:
    """PEFT tensors (sorted by name, contiguous) and adapter config (PEFT fields only) for the logical
    adapters and the fully trained weights `full` (canonical module name -> logical weight)."""
    from . import peft_experts  # it builds on this module

    settings = LoraConfig.from_description(description)
    expert_logical = {name: pair for name, pair in logical.items() if peft_experts.is_expert(name)}
    tensors, expert_settings = peft_experts.to_peft(expert_logical, description, family)
    full_tensors, trained_fully = peft_modules.to_peft(full or {}, description)
    tensors.update(full_tensors)
    dense = {name: pair for name, pair in logical.items() if name not in expert_logical}
    ranks: Dict[str, int] = {}
    alphas: Dict[str, float] = {}
    targets = _dense_to_peft(dense, description, family, tensors, ranks, alphas)
    for path, (rank, alpha) in expert_settings.items():  # the patterns cover dense and expert paths
        ranks[path], alphas[path] = rank, alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "rank_pattern": _pattern_keys(ranks, settings.rank),
        "alpha_pattern": _pattern_keys(alphas, settings.alpha),
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": settings.rslora,
        "use_dora": False,
        **trained_fully,  # modules_to_save, ensure_weight_tying
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    if expert_settings:
        config["target_parameters"] = peft_experts.target_parameters(expert_settings, family, description["num_layers"])
    return dict(sorted(tensors.items())), config


def _dense_to_peft(
    logical: Logical, description: dict, family: str, tensors: Dict[str, torch.Tensor], ranks: dict, alphas: dict
) -> List[str]:
    """Add the PEFT tensors, ranks and alphas (by HF module path) of non-expert adapters; returns `target_modules`."""
    names = names_for(family)
    settings = LoraConfig.from_description(description)
    layer_modules: Dict[str, set] = {}
    for name, (lora_a, lora_b) in logical.items():
        layer, module = _parse(name)
        pairs = projections.per_projection(lora_a, _split_b(module, lora_b, description), description)
        for projection, (part_a, part_b) in zip(_projections(module, names, description["gated_linear_unit"]), pairs):
            path = f"{names.layers}.{layer}.{projection}"
            # A copy per projection: PEFT has one A per module, safetensors refuses shared storage.
            tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = part_a.clone().contiguous()
            tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = part_b.contiguous()
            ranks[path], alphas[path] = int(part_a.shape[0]), float(settings.alpha_for(name))
            layer_modules.setdefault(projection, set()).add(layer)
    every_layer = set(range(description["num_layers"]))
    # Short names adapt every layer in PEFT; list full paths when some layers have no adapter.
    complete = all(layers == every_layer for layers in layer_modules.values())
    return sorted({_short(path) for path in ranks} if complete else set(ranks))


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _pattern_keys(values: Dict[str, Any], default: Any) -> Dict[str, Any]:
    """PEFT pattern keys for the module paths whose value differs from `default`: the projection
    name when all its paths share one value, else each differing path in full."""
    by_projection: Dict[str, List[str]] = {}
    for path in values:
        by_projection.setdefault(_short(path), []).append(path)
    pattern: Dict[str, Any] = {}
    for projection, paths in sorted(by_projection.items()):
        distinct = {values[path] for path in paths}
        if distinct == {default}:
            continue
        if len(distinct) == 1:
            pattern[projection] = distinct.pop()
        else:
            pattern.update({path: values[path] for path in sorted(paths) if values[path] != default})
    return pattern


def from_peft(
    tensors: Dict[str, torch.Tensor],
    config: dict,
    description: dict,
    expected: Iterable[str],
    where: str = "PEFT adapter",
    family: Optional[str] = None,
) -> Logical:
    """The logical adapters of the modules named in `expected`, from PEFT tensors and config
    (exact inverse of `to_peft`).

    `family`: from `megatron_lora_patch.json` (`read`); None reads the key older exports embedded in the config.
    """
    from . import peft_experts  # it builds on this module

    _check_config(config, description, where)
    if family is None:
        family = (config.get(LEGACY_METADATA_KEY) or {}).get("family", "llama")
    names = names_for(family)
    expected = list(expected)
    expert_names = [name for name in expected if peft_experts.is_expert(name)]
    logical, expert_keys = peft_experts.from_peft(tensors, config, description, expert_names, family, where)
    layer_paths = {}
    for name in expected:
        if name in logical:
            continue
        layer, module = _parse(name)
        layer_paths[name] = (module, [f"{names.layers}.{layer}.{p}" for p in _projections(module, names, description["gated_linear_unit"])])
    known = {
        f"{PEFT_PREFIX}{path}.lora_{factor}.weight"
        for _, paths in layer_paths.values()
        for path in paths
        for factor in ("A", "B")
    }
    for key in tensors:
        if key not in known | expert_keys:
            raise PeftFormatError(f"{where}: {key} is not a module this model adapts (unsupported or not targeted)")
    for name, (module, paths) in layer_paths.items():
        logical[name] = _dense_from_peft(tensors, config, description, name, module, paths, where)
    return logical


def _dense_from_peft(tensors: Dict[str, torch.Tensor], config: dict, description: dict, name: str, module: str,
                     paths: List[str], where: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The logical (A, B) of one non-expert Megatron module from its PEFT projections `paths`."""
    a_parts, b_parts = [], []
    for path in paths:
        for factor, parts in (("A", a_parts), ("B", b_parts)):
            key = f"{PEFT_PREFIX}{path}.lora_{factor}.weight"
            if key not in tensors:
                raise PeftFormatError(f"{where}: missing {key} (needed for Megatron {name})")
            parts.append(tensors[key])
    check_scaling(config, description, name, paths, where)
    separate = description.get("separate_projections") and len(paths) > 1
    for path, a in zip(paths[1:], a_parts[1:]):
        if a.shape != a_parts[0].shape or not (separate or torch.equal(a, a_parts[0])):
            raise PeftFormatError(
                f"{where}: {path} has a different lora_A than {paths[0]}; the fused Megatron {name} "
                "has one A for all its projections unless built with MEGATRON_LORA_SEPARATE_PROJECTIONS=1"
            )
    if separate:
        stacked, b_parts = projections.join_blocks(a_parts, b_parts)
        a_parts = [stacked]
    try:
        lora_b = _join_b(module, b_parts, description)
    except (RuntimeError, ValueError):
        raise PeftFormatError(f"{where}: lora_B shapes {[tuple(b.shape) for b in b_parts]} of {paths} do not fit Megatron {name}") from None
    return a_parts[0], lora_b


def _check_config(config: dict, description: dict, where: str) -> None:
    if config.get("peft_type") != "LORA":
        raise PeftFormatError(f"{where}: peft_type is {config.get('peft_type')!r}, only 'LORA' is supported")
    for flag in ("use_dora", "fan_in_fan_out"):
        if config.get(flag):
            raise PeftFormatError(f"{where}: {flag}=true is not supported by Megatron LoRA adapters")
    if config.get("bias", "none") != "none":
        raise PeftFormatError(f"{where}: bias={config['bias']!r} is not supported (LoRA adapters have no bias)")
    rslora = bool(config.get("use_rslora"))
    if rslora != LoraConfig.from_description(description).rslora:
        raise PeftFormatError(
            f"{where}: use_rslora={str(rslora).lower()} but the model's adapters {'do not ' if rslora else ''}use "
            f"rsLoRA; build them with MEGATRON_LORA_RSLORA={int(rslora)}"
        )
    for field, value in (("r", config.get("r")), ("lora_alpha", config.get("lora_alpha"))):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise PeftFormatError(f"{where}: {field}={value!r} is not a positive number")
    for field in ("rank_pattern", "alpha_pattern"):
        pattern = config.get(field) or {}
        if not isinstance(pattern, dict) or not all(isinstance(v, (int, float)) for v in pattern.values()):
            raise PeftFormatError(f"{where}: {field} must map module patterns to numbers, got {pattern!r}")
        for key in pattern:
            try:
                re.compile(key)
            except re.error as error:
                raise PeftFormatError(f"{where}: {field} key {key!r} is not a valid regex: {error}") from None


def peft_pattern_value(pattern: Dict[str, Any], path: str, default: Any) -> Any:
    """PEFT's per-module value: the first key whose regex matches the end of `path` at a name boundary."""
    key = next((key for key in pattern if re.match(rf"(.*\.)?({key})$", path)), None)
    return default if key is None else pattern[key]


def check_scaling(config: dict, description: dict, name: str, paths: List[str], where: str) -> None:
    """The PEFT r and alpha of `paths` (the projections of Megatron `name`) are the model's for `name`."""
    ranks = [peft_pattern_value(config.get("rank_pattern") or {}, path, config["r"]) for path in paths]
    alphas = [peft_pattern_value(config.get("alpha_pattern") or {}, path, config["lora_alpha"]) for path in paths]
    for values, field in ((ranks, "r"), (alphas, "lora_alpha")):
        if len({float(value) for value in values}) > 1:
            raise PeftFormatError(
                f"{where}: {paths} have {field} {values}; the fused Megatron {name} has one adapter for all its "
                "projections, so this adapter cannot be expressed"
            )
    model = LoraConfig.from_description(description)
    for field, pattern_field, value, want, noun in (
        ("r", "rank_pattern", ranks[0], model.rank_for(name), "rank"),
        ("lora_alpha", "alpha_pattern", alphas[0], model.alpha_for(name), "alpha"),
    ):
        if float(value) != float(want):
            pattern = config.get(pattern_field)
            fix = (
                f"MEGATRON_LORA_{pattern_field.upper()} matching {pattern_field} {pattern}"
                if pattern
                else f"MEGATRON_LORA_{noun.upper()}={value}"
            )
            raise PeftFormatError(
                f"{where}: {field}={value} for {paths[0]} but the model's adapter {name} has {noun} {want}; "
                f"build them with {fix}"
            )


def check_shapes(logical: Logical, shapes: Dict[str, Tuple[tuple, tuple]], where: str) -> None:
    """Every logical factor has the model's shape for it (`shapes`: name -> (A shape, B shape))."""
    for name, (lora_a, lora_b) in logical.items():
        want_a, want_b = shapes[name]
        if tuple(lora_a.shape) != tuple(want_a) or tuple(lora_b.shape) != tuple(want_b):
            raise PeftFormatError(
                f"{where}: Megatron {name} needs A {tuple(want_a)} and B {tuple(want_b)}, the adapter gives "
                f"A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)}"
            )


def write(out_dir: str, tensors: Dict[str, torch.Tensor], config: dict, family: str = "llama") -> None:
    """Write `adapter_model.safetensors`, `adapter_config.json` and `megatron_lora_patch.json` (deterministic bytes)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
    for name, data in ((CONFIG_NAME, config), (METADATA_NAME, {"family": family})):
        with open(os.path.join(out_dir, name), "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")


def _load_json(path: str) -> Any:
    try:
        with open(path) as handle:
            return json.load(handle)
    except ValueError as error:
        raise PeftFormatError(f"{path}: invalid JSON: {error}") from None


def read(peft_dir: str) -> Tuple[Dict[str, torch.Tensor], dict, str]:
    """PEFT tensors, config and model family from a directory, or a one-line `PeftFormatError`.

    The family comes from `megatron_lora_patch.json`, else from the key older exports embedded
    in the config, else it is "llama" (an adapter written by peft itself).
    """
    from safetensors.torch import load_file

    weights, config_path = os.path.join(peft_dir, WEIGHTS_NAME), os.path.join(peft_dir, CONFIG_NAME)
    for path in (weights, config_path):
        if not os.path.isfile(path):
            raise PeftFormatError(f"{peft_dir}: no {os.path.basename(path)}; expected a PEFT LoRA adapter directory")
    config = _load_json(config_path)
    metadata_path = os.path.join(peft_dir, METADATA_NAME)
    if os.path.isfile(metadata_path):
        metadata = _load_json(metadata_path)
    else:
        metadata = config.get(LEGACY_METADATA_KEY) if isinstance(config, dict) else None
    family = metadata.get("family", "llama") if isinstance(metadata, dict) else "llama"
    return load_file(weights), config, family
