"""The MoE expert layouts inference servers load, converted from the PEFT `target_parameters` layout.

`adapter_state` writes experts as peft does for transformers 5's 3D expert parameters (one packed
wrapper per layer and parameter: `mlp.experts[.base_layer].lora_A.weight [E*r, in]`, `lora_B.weight
[out, r*E]`; lora/exchange/experts.py). `convert(state, layout)` rewrites only the expert tensors, exactly:

- `"peft"`: unchanged. Loaded by peft >= 0.18 on transformers 5 and by vLLM's 3D-MoE path
  (`vllm/lora/model_manager.py`, `LoRAModelManager._stack_moe_lora_weights`: A reshaped `(E, r, in)`,
  B `(out, r, E)` permuted to `(E, out, r)`, gate_up under `experts.base_layer`, down under `experts`).
- `"per_expert"`: one LoRA module per expert and projection, as transformers 4 MoE models had them
  (`mlp.experts.<e>.gate_proj` / `up_proj` / `down_proj`; Mixtral `block_sparse_moe.experts.<e>.w1` /
  `w3` / `w2`): expert e's A rows and B columns, gate_up's B rows `[gate; up]` split and its one A copied
  to both. What vLLM's 2D `FusedMoEWithLoRA` packs per expert (`PackedLoRALayerWeights.pack_moe`), and the
  layout SGLang reads without `--experts-shared-outer-loras` (`LoRAMemoryPool.load_lora_weight_to_buffer`:
  `experts.<e>.` in a name selects the per-expert buffer; peft's packed 2D wrappers match neither that nor its
  3D branch). rank_pattern / alpha_pattern are re-keyed for the new module paths (`pattern_keys`).
- `"shared_outer"`: SGLang's `--experts-shared-outer-loras` (python/sglang/srt/lora/mem_pool.py,
  `LoRAMemoryPool.load_lora_weight_to_buffer`): per layer one 3D `experts.gate_up_proj.lora_A.weight
  [1, r, in]` (SGLang repeats a stacked gate_up A for gate and up, `LoRAAdapter.normalize_gate_up_proj`)
  and one `experts.down_proj.lora_B.weight [1, out, r]`, and per expert e `experts.<e>.gate_up_proj.
  lora_B.weight [2I, r]` (rows `[gate; up]`) and `experts.<e>.down_proj.lora_A.weight [r, I]`. Only for
  an adapter trained with `MEGATRON_LORA_EXPERT_SHARED_OUTER=1` (every expert holds the same outer
  factors, checked bitwise); SGLang loads every module at `r` with `lora_alpha / r`, so rank / alpha
  patterns and rsLoRA are refused.

docs/handoff.md section 4 (proof: logits of a loader that follows each engine's source).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict

import torch

from megatron_lora_patch.handoff.state import AdapterState
from megatron_lora_patch.lora.adapters.layouts import fc1_to_gate_up
from megatron_lora_patch.lora.exchange.checks import peft_pattern_value
from megatron_lora_patch.lora.exchange.family_table import FAMILIES, Family, PerExpertNames, with_per_expert
from megatron_lora_patch.lora.exchange.names import PEFT_PREFIX, PeftFormatError
from megatron_lora_patch.lora.exchange.peft import pattern_keys

#: layout -> the loaders known to read it (docs/handoff.md section 4 cites their source).
LOADERS = {
    "peft": "peft >= 0.18 on transformers >= 5, vLLM 3D-MoE LoRA (LoRAModelManager._stack_moe_lora_weights)",
    "per_expert": "SGLang (LoRAMemoryPool.load_lora_weight_to_buffer), vLLM 2D MoE LoRA (FusedMoEWithLoRA, "
                  "pack_moe), peft on transformers 4 MoE models",
    "shared_outer": "SGLang --experts-shared-outer-loras (LoRAMemoryPool.load_lora_weight_to_buffer)",
}
SHARED_OUTER_OPTION = "MEGATRON_LORA_EXPERT_SHARED_OUTER=1"
#: SGLang's names of the experts' two projections under --experts-shared-outer-loras, whatever the family.
SGLANG_SHARED_OUTER = ("gate_up_proj", "down_proj")


def _layer_list(family: Family) -> str:
    """The last name of the family's layer list (`layers` of `model.layers`): it stands before a layer index."""
    return family.names.layers.rsplit(".", 1)[-1]


def _layer(family: Family) -> str:
    """A pattern of one decoder layer's path (`...model.layers.<i>`, the family's layer list)."""
    return rf"(?P<layer>.+\.{re.escape(_layer_list(family))}\.\d+)"


def _packed(family: Family) -> re.Pattern:
    """The key of a packed expert wrapper's factor in the family's names (lora/exchange/experts.py)."""
    experts = re.escape(family.experts.experts)
    return re.compile(rf"^{_layer(family)}\.{experts}(?P<base>\.base_layer)?\.lora_(?P<f>[AB])\.weight$")


class LayoutError(PeftFormatError):
    """An adapter cannot be written in the requested MoE layout; one-line message."""


def _check(layout: str, state: AdapterState) -> None:
    if layout not in LOADERS:
        raise LayoutError(f"unknown MoE layout {layout!r}; known: {', '.join(LOADERS)}")
    if layout != "peft" and state.family not in with_per_expert():
        raise LayoutError(f"no engine loads {layout} LoRA modules for family {state.family!r}; {layout} is known for "
                          f"{', '.join(with_per_expert())} ({LOADERS[layout]})")
    if layout != "shared_outer":
        return
    if not state.shared_outer:
        raise LayoutError(
            "layout 'shared_outer' (SGLang --experts-shared-outer-loras) has one gate_up lora_A and one down lora_B "
            f"per layer, this adapter was trained with one per expert; train with {SHARED_OUTER_OPTION}, or use "
            "layout 'peft' or 'per_expert'"
        )
    for field in ("rank_pattern", "alpha_pattern", "use_rslora"):
        if state.config.get(field):
            raise LayoutError(f"SGLang loads every LoRA module at r with lora_alpha / r ({field}="
                              f"{state.config[field]} would be ignored); train without it for layout 'shared_outer'")


def _adapts_fc1(config: dict, layer_path: str, base: bool, layers_with_base: set, fc1: str) -> bool:
    """Whether a packed wrapper adapts the experts' fc1 (gate_up, named `fc1` in the family) rather than fc2
    (down): peft nests them in declaration order, so `base_layer` is fc1 when both are adapted."""
    if base or layer_path in layers_with_base:
        return base
    targets = {entry.rsplit(".", 1)[-1] for entry in config.get("target_parameters") or ()}
    return targets == {fc1}


def _per_expert(path: str, names: PerExpertNames, fc1: bool, lora_a, lora_b, rank: int) -> Dict[str, torch.Tensor]:
    """Expert e's (A, B) of one packed wrapper, under per-expert module names."""
    experts, gate, up, down = names
    num = lora_a.shape[0] // rank
    per_a, per_b = lora_a.reshape(num, rank, -1), lora_b.reshape(lora_b.shape[0], rank, num)
    out = {}
    for e in range(num):
        b = per_b[..., e]
        pieces = list(zip((gate, up), fc1_to_gate_up(b))) if fc1 else [(down, b)]
        for projection, part in pieces:
            stem = f"{path}.{experts}.{e}.{projection}"
            out[f"{stem}.lora_A.weight"] = per_a[e].clone().contiguous()
            out[f"{stem}.lora_B.weight"] = part.contiguous()
    return out


def _patterns(config: dict, tensors: Dict[str, torch.Tensor], family: Family) -> dict:
    """rank_pattern / alpha_pattern of the converted modules: each module's value is the packed config's for
    the parameter it came from (gate / up: fc1, down: fc2), keyed again by `pattern_keys` (a key that would
    also match the shared experts' or attention's projections is lengthened)."""
    (experts, _, _, down), packed = family.per_expert, family.experts
    per_expert = re.compile(rf"^{_layer(family)}\.{re.escape(experts)}\.\d+\.(?P<projection>[^.]+)$")
    paths = [key[len(PEFT_PREFIX) : -len(".lora_A.weight")] for key in tensors if key.endswith(".lora_A.weight")]
    fields = {}
    for field, default in (("rank_pattern", config["r"]), ("alpha_pattern", config["lora_alpha"])):
        values = {}
        for path in paths:
            match = per_expert.match(path)
            parameter = match and (packed.linear_fc2 if match.group("projection") == down else packed.linear_fc1)
            source = f"{match.group('layer')}.{packed.experts}.{parameter}" if match else path
            values[path] = peft_pattern_value(config.get(field) or {}, source, default)
        fields[field] = pattern_keys(values, default)
    return fields


def _shared_outer(path: str, names: PerExpertNames, fc1: bool, lora_a, lora_b, rank: int) -> Dict[str, torch.Tensor]:
    """One packed wrapper in SGLang's shared-outer names: the outer factor once (3D, expert dim 1), the
    inner one per expert; a one-line error when the experts' outer factors are not one tensor."""
    stem = f"{path}.{names[0]}"
    num = lora_a.shape[0] // rank
    per_a, per_b = lora_a.reshape(num, rank, -1), lora_b.reshape(lora_b.shape[0], rank, num).permute(2, 0, 1)
    parameter = SGLANG_SHARED_OUTER[0 if fc1 else 1]
    outer, inner, kind = (per_a, per_b, "lora_A") if fc1 else (per_b, per_a, "lora_B")
    if not all(torch.equal(outer[e], outer[0]) for e in range(num)):
        raise LayoutError(f"the experts of {path} hold different {parameter} {kind} factors, not one shared one; "
                          f"layout 'shared_outer' needs a model trained with {SHARED_OUTER_OPTION}")
    inner_kind = "lora_B" if kind == "lora_A" else "lora_A"
    out = {f"{stem}.{parameter}.{kind}.weight": outer[:1].clone().contiguous()}
    out.update({f"{stem}.{e}.{parameter}.{inner_kind}.weight": inner[e].clone().contiguous() for e in range(num)})
    return out


def _layout_config(config: dict, layout: str, family: Family, tensors: Dict[str, torch.Tensor]) -> dict:
    """adapter_config of the converted layout: experts as modules, not `target_parameters`."""
    if layout == "per_expert":
        config, modules = {**config, **_patterns(config, tensors, family)}, family.per_expert[1:]
    else:
        config, modules = dict(config), SGLANG_SHARED_OUTER
    config.pop("target_parameters")
    config["target_modules"] = sorted(set(config["target_modules"]) | set(modules))
    return config


def convert(state: AdapterState, layout: str = "peft") -> AdapterState:
    """`state` (PEFT `target_parameters` layout, as `adapter_state` returns it) in the MoE `layout`,
    or a one-line `LayoutError` for a layout / family no engine loads (docs/handoff.md section 4)."""
    _check(layout, state)
    if layout == "peft" or not state.config.get("target_parameters"):
        return state
    family = FAMILIES[state.family]
    if any(f".{_layer_list(family)}." in entry for entry in state.config["target_parameters"]):
        raise LayoutError(f"{layout} needs every layer's experts adapted (target_parameters names single layers)")
    write = _per_expert if layout == "per_expert" else _shared_outer
    pattern = _packed(family)
    packed = {key: pattern.match(key) for key in state.tensors}
    with_base = {match.group("layer") for match in packed.values() if match and match.group("base")}
    tensors = {key: value for key, value in state.tensors.items() if packed[key] is None}
    for key, match in packed.items():
        if match is None or match.group("f") == "B":
            continue
        layer, base = match.group("layer"), bool(match.group("base"))
        fc1 = _adapts_fc1(state.config, layer, base, with_base, family.experts.linear_fc1)
        parameter = family.experts.linear_fc1 if fc1 else family.experts.linear_fc2
        hf_path = f"{layer[len(PEFT_PREFIX):]}.{family.experts.experts}.{parameter}"
        rank = int(peft_pattern_value(state.config.get("rank_pattern") or {}, hf_path, state.config["r"]))
        lora_b = state.tensors[key[: -len("lora_A.weight")] + "lora_B.weight"]
        tensors.update(write(layer, family.per_expert, fc1, state.tensors[key], lora_b, rank))
    config = _layout_config(state.config, layout, family, tensors)
    return dataclasses.replace(state, config=config, tensors=dict(sorted(tensors.items())))
