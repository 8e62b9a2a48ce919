"""PEFT names of a layer's dense MLP and of its shared experts (`mlp.shared_experts`, Qwen2-MoE / DeepSeek style).

Megatron's `SharedExpertMLP` is a dense SwiGLU MLP beside the routed experts, on the dense TP group:
its `linear_fc1` / `linear_fc2` adapters convert exactly like a dense MLP's (fc1 B rows `[gate; up]`
split into `gate_proj` / `up_proj`, one A copied; fc2 as `down_proj`; lora/exchange/peft.py), only under the
family's shared-expert module (`family_table.HfNames.shared_experts`, e.g. Qwen2-MoE's `mlp.shared_expert`).
Its sigmoid gate (`moe_shared_expert_gate`, HF `mlp.shared_expert_gate`) is a base weight, never
adapted. docs/handoff.md section 2.
"""

from __future__ import annotations

from typing import List

SHARED_PREFIX = "mlp.shared_experts."


def projections(module: str, names, gated: bool) -> List[str]:
    """HF module paths (inside a layer) of `mlp.linear_fc1|2` or `mlp.shared_experts.linear_fc1|2`, in split order."""
    from megatron_lora_patch.lora.exchange.family_table import with_shared_experts
    from megatron_lora_patch.lora.exchange.names import PeftFormatError

    mlp = names.mlp
    if module.startswith(SHARED_PREFIX):
        if not names.shared_experts:
            raise PeftFormatError(
                f"{module}: this model family has no shared experts; use --family {' or '.join(with_shared_experts())}"
            )
        mlp = names.shared_experts
    if module.endswith("linear_fc1"):
        if not gated:
            raise PeftFormatError(f"{module} without SwiGLU has no Llama-style PEFT name; use a gated model")
        return [f"{mlp}.{names.gate}", f"{mlp}.{names.up}"]
    return [f"{mlp}.{names.down}"]
