"""The Hugging Face model families of the exchange, one record each: every reader keys by family here.

Export and import (module names: `names.names_for`; experts: `experts.py`; shared experts: `mlp.py`), the
family check (`families.resolve`), the hand-off's MoE layouts (`handoff/moe_layouts.py`) and `export --help`
(`cli/export.py`) read `FAMILIES`; none keeps a per-family table of its own. Adding a family is one record here
plus its test (tests/test_export_families.py; docs/extending.md). Standard library only, so that `--help` lists
the families without importing torch.

What each family's `transformers` model can represent (`families.mismatches` checks a checkpoint against it):

| family    | positions  | norm    | MLP             | q / k norm | experts | linear biases         |
|-----------|------------|---------|-----------------|------------|---------|-----------------------|
| llama     | rope, yarn | RMSNorm | gated (act*up)  | no         | no      | any (attention_bias, mlp_bias) |
| mistral   | rope, yarn | RMSNorm | gated           | no         | no      | none                  |
| qwen2     | rope, yarn | RMSNorm | gated           | no         | no      | q / k / v only        |
| qwen3     | rope, yarn | RMSNorm | gated           | yes        | no      | q / k / v / o only    |
| qwen3_moe | rope, yarn | RMSNorm | gated experts   | yes        | yes     | q / k / v / o only    |
| mixtral   | rope, yarn | RMSNorm | gated experts   | no         | yes     | none                  |
| qwen2_moe | rope, yarn | RMSNorm | gated experts   | no         | yes     | q / k / v only        |
| deepseek_v3 | rope, yarn | RMSNorm | gated (dense, experts) | latent norms | optional | none          |

`qwen2_moe` and `deepseek_v3` also have shared experts (docs/handoff.md section 2). `deepseek_v3` is the one
family with multi-latent attention (MLA, `HfNames.mla`) and the one whose model holds dense layers beside
(or instead of) MoE ones (`first_k_dense_replace`). Layouts: docs/architecture.md section 4.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional


@dataclasses.dataclass(frozen=True)
class MlaNames:
    """Where a family keeps Megatron's multi-latent attention linears, inside `HfNames.attention`
    (transformers' DeepseekV3Attention; `linear_proj` is `HfNames.o`). Each is one linear on both sides, the
    same rows in the same order (lora/exchange/mla.py)."""

    linear_q_proj: str = "q_proj"  # q_lora_rank unset
    linear_q_down_proj: str = "q_a_proj"
    linear_q_up_proj: str = "q_b_proj"
    linear_kv_down_proj: str = "kv_a_proj_with_mqa"
    linear_kv_up_proj: str = "kv_b_proj"


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
    shared_experts: str = ""  # the shared experts' MLP (lora/exchange/mlp.py); "" where the family has none
    mla: Optional[MlaNames] = None  # multi-latent attention's linears; None: q / k / v (GQA) attention


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where a Hugging Face MoE family keeps its fused 3D expert parameters (inside a decoder layer;
    transformers >= 5, PEFT `target_parameters`: lora/exchange/experts.py)."""

    experts: str = "mlp.experts"
    linear_fc1: str = "gate_up_proj"
    linear_fc2: str = "down_proj"


class PerExpertNames(NamedTuple):
    """The per-expert module names of transformers 4 MoE models: the hand-off's `per_expert` layout
    (handoff/moe_layouts.py), `<experts>.<e>.<gate|up|down>`."""

    experts: str = "mlp.experts"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face family: what its `transformers` model can represent, and its names."""

    qk_layernorm: bool
    biases: str  # the most a model may use: "none", "qkv", "attention" or "all" (each holds the ones before it)
    names: HfNames = HfNames()
    experts: Optional[ExpertNames] = None  # None: a dense family (no MoE layers)
    per_expert: Optional[PerExpertNames] = None  # None: no engine loads per-expert modules for it
    dense_layers: bool = False  # an MoE family whose model may also hold dense MLP layers (or only those)

    @property
    def moe(self) -> bool:
        return self.experts is not None


FAMILIES: Dict[str, Family] = {
    "llama": Family(qk_layernorm=False, biases="all"),
    "mistral": Family(qk_layernorm=False, biases="none"),
    "qwen2": Family(qk_layernorm=False, biases="qkv"),
    "qwen3": Family(qk_layernorm=True, biases="attention"),
    "qwen3_moe": Family(qk_layernorm=True, biases="attention", experts=ExpertNames(), per_expert=PerExpertNames()),
    "mixtral": Family(qk_layernorm=False, biases="none", experts=ExpertNames(),
                      per_expert=PerExpertNames("block_sparse_moe.experts", "w1", "w3", "w2")),
    "qwen2_moe": Family(qk_layernorm=False, biases="qkv", names=HfNames(shared_experts="mlp.shared_expert"),
                        experts=ExpertNames(), per_expert=PerExpertNames()),
    "deepseek_v3": Family(qk_layernorm=True, biases="none",
                          names=HfNames(shared_experts="mlp.shared_experts", mla=MlaNames()),
                          experts=ExpertNames(), per_expert=PerExpertNames(), dense_layers=True),
}


def with_experts() -> List[str]:
    """The MoE families, in table order."""
    return [name for name, family in FAMILIES.items() if family.moe]


def with_shared_experts() -> List[str]:
    """The families with shared experts beside the routed ones, in table order."""
    return [name for name, family in FAMILIES.items() if family.names.shared_experts]


def with_mla() -> List[str]:
    """The families with multi-latent attention, in table order."""
    return [name for name, family in FAMILIES.items() if family.names.mla is not None]


def with_per_expert() -> List[str]:
    """The families engines load per-expert LoRA modules for, in table order."""
    return [name for name, family in FAMILIES.items() if family.per_expert is not None]
