"""Test-side readers of LoRA payloads written from the engines' own loaders (the engines cannot run here).

Each reader turns a payload into per-module (A, B) the way the cited engine code does and merges
`scaling * B @ A` into a `transformers` model's weights, which is what the engine's LoRA kernels add
at inference; equal logits then prove the names, shapes and orientation the engine reads.

- vLLM (vllm/lora/lora_model.py `LoRAModel.from_lora_tensors`, vllm/lora/utils.py
  `parse_fine_tuned_lora_name`: the module is the name without `base_model.model.` and
  `.lora_A.weight` / `.lora_B.weight`; vllm/lora/peft_helper.py: scaling `lora_alpha / r`, or
  `/ sqrt(r)` with `use_rslora`; vllm/lora/model_manager.py `_stack_moe_lora_weights`: 3D experts,
  gate_up under `experts.base_layer`, down under `experts`, A reshaped `(E, r, in)`, B `(out, r, E)`
  permuted to `(E, out, r)`).
- Per-expert modules (`experts.<e>.gate_proj` / `up_proj` / `down_proj`, vLLM's 2D `pack_moe`):
  expert e's A `[r, in]` and B `[out, r]`, gate and up into the rows `[gate; up]` of `gate_up_proj[e]`.
- PEFT's per-module r and alpha (`merge`): `rank_pattern` / `alpha_pattern` keys are regexes, the first
  one matching the end of the module path at a name boundary wins (peft/utils/other.py `get_pattern_key`).
- SGLang (`sglang_merge`; python/sglang/srt/lora/mem_pool.py `LoRAMemoryPool.load_lora_weight_to_buffer`,
  sgl-project/sglang 00639c4d; lora.py `LoRAAdapter.scaling`): one `r` per adapter, every A copied into
  the buffer rows `[:r]` and B into columns `[:r]` with the shape asserted equal; scaling `lora_alpha / r`
  (no rsLoRA, no patterns); a routed expert is read per expert when `experts.<e>.` is in its name,
  as 3D when its tensor is 3D, else as a plain module (peft's packed 2D wrappers: refused here).
- SGLang shared-outer (`shared_outer_deltas`; python/sglang/srt/lora/lora.py `LoRAAdapter.
  normalize_gate_up_proj`: a stacked gate_up lora_A is repeated twice along dim -2; mem_pool.py
  `LoRAMemoryPool.load_lora_weight_to_buffer`: a name with `experts.<e>.` is expert e's 2D weight, one
  with `experts` and no index a 3D one whose expert dim must be 1 and whose `[0]` every expert uses; the
  gate_up A buffer holds slot c at rows `c*r`, B is scaled by `lora_alpha / r` on load; the MoE kernel
  multiplies output slice c (gate, up) of `gate_up` B by A slot c).
"""

from __future__ import annotations

import math
import re

import torch

PREFIX = "base_model.model."
_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def modules(tensors: dict) -> dict:
    """module name -> {"A": lora_a, "B": lora_b}, parsed as vLLM's parse_fine_tuned_lora_name does."""
    found: dict = {}
    for name, tensor in tensors.items():
        module, factor = name[len(PREFIX):].rsplit(".lora_", 1)
        found.setdefault(module, {})[factor[0]] = tensor
    return found


def _pattern(config: dict, field: str, module: str, default):
    key = next((key for key in config.get(field) or {} if re.match(rf"(.*\.)?({key})$", module)), None)
    return default if key is None else config[field][key]


def scaling(config: dict, module: str = "") -> float:
    """PEFT's scaling of `module`: its rank / alpha from the patterns, else `r` / `lora_alpha`."""
    rank, alpha = _pattern(config, "rank_pattern", module, config["r"]), _pattern(
        config, "alpha_pattern", module, config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _stack_3d(factors: dict, experts: int, expert_minor: bool = True) -> tuple:
    """(A (E, r, in), B (E, out, r)) of one packed wrapper; `expert_minor=False` misreads B (control)."""
    lora_a = factors["A"].reshape(experts, -1, factors["A"].shape[-1])
    lora_b = factors["B"]
    if expert_minor:
        return lora_a, lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1)
    return lora_a, lora_b.reshape(lora_b.shape[0], experts, -1).permute(1, 0, 2)


def merge(model, tensors: dict, config: dict, expert_minor: bool = True):
    """`model` with every payload module's `scaling * B @ A` added to its weights (in place; returned)."""
    params = dict(model.named_parameters())
    parsed = modules(tensors)
    with torch.no_grad():
        for module, factors in parsed.items():
            scale = scaling(config, module)
            per_expert = _PER_EXPERT.match(module)
            if module.endswith(".experts.base_layer") or module.endswith(".experts"):
                down = not module.endswith(".base_layer")
                stem = module if down else module[: -len(".base_layer")]
                weight = params[f"{stem}.{'down_proj' if down else 'gate_up_proj'}"]
                lora_a, lora_b = _stack_3d(factors, weight.shape[0], expert_minor)
                weight += scale * torch.bmm(lora_b, lora_a)
            elif per_expert:
                stem, expert, projection = per_expert.groups()
                weight = params[f"{stem}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"][int(expert)]
                half = weight.shape[0] // 2
                rows = {"gate_proj": slice(0, half), "up_proj": slice(half, None)}.get(projection, slice(None))
                weight[rows] += scale * factors["B"] @ factors["A"]
            else:
                params[f"{module}.weight"] += scale * factors["B"] @ factors["A"]
    return model


def _one_r_and_alpha(config: dict, engine: str) -> None:
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"{engine} reads one r and lora_alpha per adapter; it would ignore {field}")


def vllm_merge(model, tensors: dict, config: dict, **reader):
    """vLLM's reading (`PEFTHelper`: one r and alpha, rsLoRA honoured), then `merge`."""
    _one_r_and_alpha(config, "vLLM")
    return merge(model, tensors, config, **reader)


def sglang_merge(model, tensors: dict, config: dict):
    """SGLang's reading (module docstring): refuse what its memory pool would refuse or misread, then `merge`
    with `lora_alpha / r`."""
    _one_r_and_alpha(config, "SGLang")
    for module, factors in modules(tensors).items():
        if module.endswith((".experts", ".experts.base_layer")):
            raise ValueError(f"{module}: packed 2D experts, neither per expert nor 3D; SGLang reads a plain module")
        if factors["A"].shape[0] != config["r"] or factors["B"].shape[1] != config["r"]:
            raise ValueError(f"{module}: LoRA buffer shape [:{config['r']}] does not match weight shapes "
                             f"{tuple(factors['A'].shape)}, {tuple(factors['B'].shape)}")
    return merge(model, tensors, {**config, "use_rslora": False})


_SHARED_OUTER = re.compile(r"^(.+\.layers\.\d+\.mlp\.experts)\.(?:(\d+)\.)?(gate_up_proj|down_proj)$")


def shared_outer_deltas(tensors: dict, config: dict, swap_gate_up: bool = False) -> dict:
    """(experts module, expert) -> (delta of gate_up_proj[e] `[2I, H]`, of down_proj[e] `[H, I]`), read as SGLang
    reads the shared-outer layout; `swap_gate_up` misreads gate_up B's rows as `[up; gate]` (control)."""
    scale, rank = config["lora_alpha"] / config["r"], config["r"]
    outer, inner = {}, {}
    for module, factors in modules(tensors).items():
        match = _SHARED_OUTER.match(module)
        if match is None:  # not an expert: `merge` reads it
            continue
        stem, expert, projection = match.groups()
        for factor, tensor in factors.items():
            if expert is None:  # 3D, expert dim 1
                assert tensor.dim() == 3 and tensor.shape[0] == 1, (module, tuple(tensor.shape))
                outer[(stem, projection, factor)] = tensor.repeat(1, 2, 1)[0] if factor == "A" else tensor[0]
            else:
                inner.setdefault((stem, int(expert)), {})[(projection, factor)] = tensor
    deltas = {}
    for (stem, expert), own in inner.items():
        lora_a, lora_b = outer[(stem, "gate_up_proj", "A")], own[("gate_up_proj", "B")] * scale
        half = lora_b.shape[0] // 2
        gate, up = (lora_b[half:], lora_b[:half]) if swap_gate_up else (lora_b[:half], lora_b[half:])
        gate_up = torch.cat([gate @ lora_a[:rank], up @ lora_a[rank:]])
        down = (outer[(stem, "down_proj", "B")] * scale) @ own[("down_proj", "A")]
        deltas[(stem, expert)] = (gate_up, down)
    return deltas


def per_expert_deltas(tensors: dict, config: dict) -> dict:
    """The same deltas from the per-expert layout (`[gate; up]` rows), each `(scaling * B) @ A`."""
    scale, found = config["lora_alpha"] / config["r"], {}
    for module, factors in modules(tensors).items():
        match = _PER_EXPERT.match(module)
        if match:
            stem, expert, projection = match.groups()
            found.setdefault((stem, int(expert)), {})[projection] = (factors["B"] * scale) @ factors["A"]
    return {key: (torch.cat([own["gate_proj"], own["up_proj"]]), own["down_proj"]) for key, own in found.items()}


def add_deltas(model, deltas: dict):
    """`model` with each expert's deltas added to its 3D `gate_up_proj` / `down_proj` (in place; returned)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for (stem, expert), (gate_up, down) in deltas.items():
            params[f"{stem}.gate_up_proj"][expert] += gate_up
            params[f"{stem}.down_proj"][expert] += down
    return model
