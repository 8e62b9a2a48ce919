"""Hugging Face PEFT export / import of LoRA adapters (`adapter_model.safetensors` + `adapter_config.json`).

The logical (world-size-1) adapters are the source and target of both directions:
export reads them from an adapter-only distributed checkpoint (`checkpoint.save_adapters`;
Megatron's `dist_checkpointing` gathers the TP / EP / PP shards), import slices them
onto this rank's adapters (any topology). Conversion, per transformer layer i
(Megatron module -> PEFT modules (Llama names): how):

- self_attention.linear_qkv -> self_attn.q_proj, k_proj, v_proj: B split from the mixed per-query-group rows (GQA);
  the one A copied to all three
- self_attention.linear_proj -> self_attn.o_proj: as is
- mlp.linear_fc1 (SwiGLU) -> mlp.gate_proj, up_proj: B rows [gate; up] split; A copied
- mlp.linear_fc2 -> mlp.down_proj: as is
- multi-latent attention's linears (family deepseek_v3) -> self_attn.q_a_proj, q_b_proj (or q_proj),
  kv_a_proj_with_mqa, kv_b_proj: as is (lora/exchange/mla.py)

With `separate_projections` each projection gets its own A rows and B block (lora/adapters/projections.py).
DoRA (`use_dora`): the magnitude `m` has one entry per output row of the Megatron layer (of the full layer, also
for row-parallel ones), so it splits into the projections' `lora_magnitude_vector` by the rows B splits by.
PEFT's scaling `lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`) is the adapter's
`s`; per-module ranks and alphas travel as PEFT's `rank_pattern` / `alpha_pattern` (keys are
regexes matched against the end of a module path, the first matching key wins): export writes for each
differing path the shortest key all the paths it matches agree on (`pattern_keys`): a projection name
(`gate_proj`), a longer suffix where kinds share a name (`experts.down_proj`, `shared_expert.down_proj`),
or the full path where layers differ.
Import refuses, naming the module, what the model's adapters cannot express (different A's
on a shared-A fused layer, other shapes, missing or unknown modules, another r, alpha, rsLoRA or DoRA, biases).
`adapter_config.json` holds only PEFT's own fields (peft warns about any other key); this
package's metadata (the model family) sits beside it in `megatron_lora_patch.json`.
Expert adapters (MoE families): PEFT's `target_parameters` layout (lora/exchange/experts.py); fully
trained modules (`modules_to_save`: `lm_head`, `embed_tokens`): lora/exchange/modules.py.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron_lora_patch.lora.adapters import layouts, projections
from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.lora.exchange import checks
from megatron_lora_patch.lora.exchange import experts as peft_experts
from megatron_lora_patch.lora.exchange import mla as peft_mla
from megatron_lora_patch.lora.exchange import mlp as peft_mlp
from megatron_lora_patch.lora.exchange import modules as peft_modules
from megatron_lora_patch.lora.exchange.family_table import HfNames
from megatron_lora_patch.lora.exchange.names import (
    LEGACY_METADATA_KEY,
    MAGNITUDE_KEY,
    PEFT_PREFIX,
    Logical,
    Magnitudes,
    PeftFormatError,
    names_for,
)

_LAYER_MODULE = re.compile(
    r"^decoder\.layers\.(\d+)\.(self_attention\.linear_qkv|self_attention\.linear_proj|"
    r"self_attention\.linear_(?:q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)|"
    r"mlp\.(?:shared_experts\.)?linear_fc1|mlp\.(?:shared_experts\.)?linear_fc2)$"
)


def _projections(module: str, names: HfNames, gated: bool) -> List[str]:
    """HF module paths (inside a layer) that one Megatron module becomes, in split order."""
    if module == "self_attention.linear_qkv":
        return [f"{names.attention}.{p}" for p in (names.q, names.k, names.v)]
    if module == "self_attention.linear_proj":
        return [f"{names.attention}.{names.o}"]
    if peft_mla.is_mla(module):
        return peft_mla.projections(module, names)
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
        raise PeftFormatError(
            f"{name}: no PEFT name for this Megatron module (supported: qkv, proj, the MLA linears, fc1, fc2)"
        )
    return int(match.group(1)), match.group(2)


def to_peft(
    logical: Logical,
    description: dict,
    family: str = "llama",
    full: Optional[Dict[str, torch.Tensor]] = None,
    magnitudes: Optional[Magnitudes] = None,
) -> Tuple[Dict[str, torch.Tensor], dict]:
    """PEFT tensors (sorted by name, contiguous) and adapter config (PEFT fields only) for the logical
    adapters, the fully trained weights `full` (canonical module name -> logical weight) and, for DoRA
    adapters, their logical magnitudes (canonical module name -> m)."""
    settings = LoraConfig.from_description(description)
    _check_magnitudes(logical, description, magnitudes or {})
    expert_logical = {name: pair for name, pair in logical.items() if peft_experts.is_expert(name)}
    tensors, expert_settings = peft_experts.to_peft(expert_logical, description, family)
    full_tensors, trained_fully = peft_modules.to_peft(full or {}, description)
    tensors.update(full_tensors)
    dense = {name: pair for name, pair in logical.items() if name not in expert_logical}
    ranks: Dict[str, int] = {}
    alphas: Dict[str, float] = {}
    targets = _dense_to_peft(dense, description, family, tensors, ranks, alphas, magnitudes or {})
    for path, (rank, alpha) in expert_settings.items():  # the patterns cover dense and expert paths
        ranks[path], alphas[path] = rank, alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "rank_pattern": pattern_keys(ranks, settings.rank),
        "alpha_pattern": pattern_keys(alphas, settings.alpha),
        "lora_dropout": 0.0,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": settings.rslora,
        "use_dora": settings.dora,
        **trained_fully,  # modules_to_save, ensure_weight_tying
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    if expert_settings:
        config["target_parameters"] = peft_experts.target_parameters(expert_settings, family, description["num_layers"])
    return dict(sorted(tensors.items())), config


def _check_magnitudes(logical: Logical, description: dict, magnitudes: Magnitudes) -> None:
    """DoRA adapters come with a magnitude for every module (none of them an expert: DoRA is refused there at
    build, and peft has no DoRA on `target_parameters`); plain LoRA adapters with none."""
    want = set(logical) if description.get("dora") else set()
    if set(magnitudes) != want or any(peft_experts.is_expert(name) for name in magnitudes):
        missing, extra = sorted(want - set(magnitudes)), sorted(set(magnitudes) - want)
        raise PeftFormatError(
            f"to_peft: DoRA={bool(description.get('dora'))} needs a magnitude for each adapted module (missing "
            f"{missing[:3]}) and none elsewhere (extra {extra[:3]}); export the checkpoint the adapters were saved in"
        )


def _dense_to_peft(
    logical: Logical,
    description: dict,
    family: str,
    tensors: Dict[str, torch.Tensor],
    ranks: dict,
    alphas: dict,
    magnitudes: Magnitudes,
) -> List[str]:
    """Add the PEFT tensors (with DoRA's `magnitudes`, if any), ranks and alphas (by HF module path) of non-expert
    adapters; returns `target_modules`."""
    names = names_for(family)
    settings = LoraConfig.from_description(description)
    layer_modules: Dict[str, set] = {}
    for name, (lora_a, lora_b) in logical.items():
        layer, module = _parse(name)
        pairs = projections.per_projection(lora_a, _split_b(module, lora_b, description), description)
        rows = _split_b(module, magnitudes[name], description) if name in magnitudes else [None] * len(pairs)
        for projection, (part_a, part_b), magnitude in zip(
            _projections(module, names, description["gated_linear_unit"]), pairs, rows
        ):
            path = f"{names.layers}.{layer}.{projection}"
            # A copy per projection: PEFT has one A per module, safetensors refuses shared storage.
            tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = part_a.clone().contiguous()
            tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = part_b.contiguous()
            if magnitude is not None:
                tensors[f"{PEFT_PREFIX}{path}.{MAGNITUDE_KEY}"] = magnitude.contiguous()
            ranks[path], alphas[path] = int(part_a.shape[0]), float(settings.alpha_for(name))
            layer_modules.setdefault(projection, set()).add(layer)
    every_layer = set(range(description["num_layers"]))
    # Short names adapt every layer in PEFT; list full paths when some layers have no adapter.
    complete = all(layers == every_layer for layers in layer_modules.values())
    return sorted({path.rsplit(".", 1)[-1] for path in ranks} if complete else set(ranks))


def _key_candidates(path: str) -> List[str]:
    """PEFT pattern keys that match `path`, shortest first: the dotted suffixes inside its layer (an expert
    index generalized to `\\d+`, never leading), then the full path."""
    parts = path.split(".")
    first = next((i for i, part in enumerate(parts) if part.isdigit()), -1)  # the layer index
    inner = [r"\d+" if part.isdigit() else part for part in parts[first + 1 :]]
    suffixes = [".".join(inner[i:]) for i in range(len(inner) - 1, -1, -1) if inner[i] != r"\d+"]
    return suffixes + [path]


def pattern_keys(values: Dict[str, Any], default: Any) -> Dict[str, Any]:
    """PEFT pattern keys for the module paths whose value differs from `default`: for each, the shortest key
    (`_key_candidates`) that every path it matches agrees on, so the first matching key is right whatever
    the order (`down_proj` when all share it; `experts.down_proj` / `shared_expert.down_proj` when routed
    and shared experts differ; the full path when layers differ)."""
    seen: Dict[str, set] = {}
    for path, value in values.items():
        for key in _key_candidates(path):
            seen.setdefault(key, set()).add(value)
    pattern: Dict[str, Any] = {}
    for path, value in values.items():
        if value != default:
            pattern[next(key for key in _key_candidates(path) if len(seen[key]) == 1)] = value
    return dict(sorted(pattern.items()))


def from_peft(
    tensors: Dict[str, torch.Tensor],
    config: dict,
    description: dict,
    expected: Iterable[str],
    where: str = "PEFT adapter",
    family: Optional[str] = None,
    magnitudes: Optional[Magnitudes] = None,
) -> Logical:
    """The logical adapters of the modules named in `expected`, from PEFT tensors and config
    (exact inverse of `to_peft`).

    `family`: from `megatron_lora_patch.json` (`read`); None reads the key older exports embedded in the config.
    `magnitudes`: receives DoRA's logical m per module (a DoRA adapter's import must pass a dict).
    """
    checks.check_config(config, description, where)
    if config.get("use_dora") and magnitudes is None:
        raise PeftFormatError(f"{where}: a DoRA adapter (use_dora=true) needs from_peft(..., magnitudes={{}})")
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
        layer_paths[name] = (
            module,
            [f"{names.layers}.{layer}.{p}" for p in _projections(module, names, description["gated_linear_unit"])],
        )
    known = {
        f"{PEFT_PREFIX}{path}.lora_{factor}.weight"
        for _, paths in layer_paths.values()
        for path in paths
        for factor in ("A", "B")
    }
    if config.get("use_dora"):
        known |= {f"{PEFT_PREFIX}{path}.{MAGNITUDE_KEY}" for _, paths in layer_paths.values() for path in paths}
    for key in tensors:
        if key not in known | expert_keys:
            raise PeftFormatError(f"{where}: {key} is not a module this model adapts (unsupported or not targeted)")
    for name, (module, paths) in layer_paths.items():
        logical[name] = _dense_from_peft(tensors, config, description, name, module, paths, where)
        if config.get("use_dora"):
            magnitudes[name] = _magnitude_from_peft(tensors, name, module, paths, description, where)
    return logical


def _magnitude_from_peft(
    tensors: Dict[str, torch.Tensor], name: str, module: str, paths: List[str], description: dict, where: str
) -> torch.Tensor:
    """DoRA's logical m of Megatron `name`: its projections' `lora_magnitude_vector`s joined by the rows of B."""
    parts = []
    for path in paths:
        key = f"{PEFT_PREFIX}{path}.{MAGNITUDE_KEY}"
        if key not in tensors or tensors[key].dim() != 1:
            raise PeftFormatError(f"{where}: use_dora=true but {key} is missing or not a vector (needed for Megatron "
                                  f"{name}); export the adapter again with peft's save_pretrained")
        parts.append(tensors[key])
    try:
        return _join_b(module, parts, description)
    except (RuntimeError, ValueError):
        raise PeftFormatError(
            f"{where}: {MAGNITUDE_KEY} lengths {[len(m) for m in parts]} of {paths} do not fit Megatron {name}"
        ) from None


def _dense_from_peft(
    tensors: Dict[str, torch.Tensor],
    config: dict,
    description: dict,
    name: str,
    module: str,
    paths: List[str],
    where: str,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The logical (A, B) of one non-expert Megatron module from its PEFT projections `paths`."""
    a_parts, b_parts = [], []
    for path in paths:
        for factor, parts in (("A", a_parts), ("B", b_parts)):
            key = f"{PEFT_PREFIX}{path}.lora_{factor}.weight"
            if key not in tensors:
                raise PeftFormatError(f"{where}: missing {key} (needed for Megatron {name})")
            parts.append(tensors[key])
    for path, lora_a in zip(paths, a_parts):
        checks.check_declared_rank(config, path, lora_a, where)
    checks.check_scaling(config, description, name, paths, where)
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
        raise PeftFormatError(
            f"{where}: lora_B shapes {[tuple(b.shape) for b in b_parts]} of {paths} do not fit Megatron {name}"
        ) from None
    return a_parts[0], lora_b
