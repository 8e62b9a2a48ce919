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


def scaling(config: dict) -> float:
    rank, alpha = config["r"], config["lora_alpha"]
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
    scale = scaling(config)
    parsed = modules(tensors)
    with torch.no_grad():
        for module, factors in parsed.items():
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
