"""Which Hugging Face model family can hold the model a checkpoint's adapters were trained on.

A PEFT adapter is only as good as the base model it is loaded onto: exporting the adapters of a
model built with Megatron's defaults (learned absolute positions, LayerNorm, a non-gated GeLU MLP)
under Llama names would give an adapter no Llama can use. `resolve` compares what the checkpoint
description records (lora/inventory.py `describe`, docs/architecture.md section 4) with what
each family's `transformers` model can represent (its record in lora/exchange/family_table.py, whose
docstring tabulates them), and refuses with one line naming the mismatch.

Every family has `tie_word_embeddings` and `num_key_value_heads` (GQA), so tied embeddings and
query groups never rule one out; a family with biases holds a model without them as zeros. The
activation must be one `transformers` names in `hidden_act` (Megatron's `squared_relu` is `relu2`).
With no family given, multi-latent attention (MLA) gets `deepseek_v3` (the one family with it; MoE or all
dense, since its model holds dense layers too), other MoE checkpoints `qwen3_moe` (q / k norms) or `mixtral`
(none), dense ones `qwen3` or `llama` (the names llama, mistral and qwen2 share); `qwen2_moe`, the other family
with shared experts (docs/handoff.md), is never inferred: adapters on shared experts under a family without
them are refused by their names (lora/exchange/mlp.py), naming those with them. Fields an older description lacks
are assumed to be what the family needs, and one warning says so.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from megatron_lora_patch.lora.exchange.family_table import FAMILIES, Family
from megatron_lora_patch.lora.exchange.mla import LINEARS as MLA_LINEARS
from megatron_lora_patch.lora.exchange.names import PeftFormatError, names_for

logger = logging.getLogger("megatron_lora_patch")

#: Megatron activation functions transformers can name in `hidden_act` (the same names; squared_relu is relu2).
HF_ACTIVATIONS = ("silu", "gelu", "quick_gelu", "squared_relu", "relu")
_BIAS_LEVELS = ("none", "qkv", "attention", "all")  # each level holds the ones before it (as zeros)


def _needs(family: Family) -> Dict[str, object]:
    """The description values a family needs (what is assumed where a field is missing)."""
    return {"position_embedding_type": "rope", "normalization": "RMSNorm", "gated_linear_unit": True,
            "activation": "silu", "qk_layernorm": family.qk_layernorm, "add_bias_linear": False, "add_qkv_bias": False}


def _bias_level(description: dict) -> str:
    if description.get("add_bias_linear"):
        return "all"
    return "qkv" if description.get("add_qkv_bias") else "none"


def mismatches(description: dict, name: str) -> List[str]:
    """What family `name` cannot represent of the recorded model, one phrase each (empty: it fits)."""
    family, found = FAMILIES[name], []
    position = description.get("position_embedding_type", "rope")
    if position not in ("rope", "yarn"):
        found.append(f"{position} position embeddings ({name}: rope)")
    if description.get("normalization", "RMSNorm") != "RMSNorm":
        found.append(f"{description['normalization']} ({name}: RMSNorm)")
    if not description.get("gated_linear_unit", True):
        found.append(f"a non-gated MLP ({name}: gated, e.g. --swiglu)")
    if description.get("activation", "silu") not in HF_ACTIVATIONS:
        found.append(f"activation {description['activation']} (transformers: {', '.join(HF_ACTIVATIONS)})")
    mla = _has_mla(description)
    if mla and family.names.mla is not None and description.get("qk_layernorm") is False:
        # transformers' DeepseekV3 always normalizes the latents; Megatron-Core's local layers omit them when
        # q_lora_rank is unset (their norm check wants Transformer Engine's fused norm + linear)
        found.append(f"no latent layernorms ({name}: q_a_layernorm / kv_a_layernorm; Megatron-Core's local layers "
                     "build none when q_lora_rank is unset, Transformer Engine's layers do)")
    elif description.get("qk_layernorm", family.qk_layernorm) != family.qk_layernorm:
        found.append(f"{'' if description['qk_layernorm'] else 'no '}q / k layernorm "
                     f"({name}: {'with' if family.qk_layernorm else 'without'})")
    if mla != (family.names.mla is not None):
        found.append(f"{'multi-latent' if mla else 'q / k / v (GQA)'} attention "
                     f"({name}: {'multi-latent' if family.names.mla else 'q / k / v'})")
    moe = bool(description.get("num_experts"))
    if moe != family.moe and not (family.dense_layers and not moe):
        found.append(f"{'MoE' if description.get('num_experts') else 'dense'} layers "
                     f"({name}: {'MoE' if family.moe else 'dense'})")
    bias = _bias_level(description)
    if _BIAS_LEVELS.index(bias) > _BIAS_LEVELS.index(family.biases):
        found.append(f"{'all linear' if bias == 'all' else 'q / k / v'} biases ({name}: {family.biases})")
    return found


def _has_mla(description: dict) -> bool:
    """Whether the model has multi-latent attention; a description without the field (an older
    megatron-lora-patch) tells it by its adapted linears."""
    if "multi_latent_attention" in description:
        return bool(description["multi_latent_attention"])
    return bool(set(description.get("targets") or ()) & set(MLA_LINEARS))


def _inferred(description: dict, label: str) -> str:
    if _has_mla(description):
        return "deepseek_v3"
    qk_layernorm = description.get("qk_layernorm")
    if not description.get("num_experts"):
        return "qwen3" if qk_layernorm else "llama"
    if qk_layernorm is None:
        raise PeftFormatError(
            f"the checkpoint does not record whether its MoE model has q / k layernorm (written by an older "
            f"megatron-lora-patch); pass {label} qwen3_moe (with) or mixtral (without)"
        )
    return "qwen3_moe" if qk_layernorm else "mixtral"


def resolve(description: dict, family: Optional[str], label: str = "family",
            what: str = "the checkpoint's model") -> str:
    """The family to write `what` as: `family` checked against the recorded model, or inferred when None; a family
    that cannot represent it is a one-line `PeftFormatError`, fields the description lacks one warning. The one
    resolver of the export and the hand-off (`handoff.adapter_state`), so both accept the same families."""
    if family is not None:
        names_for(family, label)
    name = family if family is not None else _inferred(description, label)
    found = mismatches(description, name)
    if found:
        fitting = [other for other in FAMILIES if not mismatches(description, other)]
        fix = f"pass {label} {' or '.join(fitting)}" if fitting else (
            f"no family ({', '.join(FAMILIES)}) can hold it: export needs a Llama-style model "
            "(rope, RMSNorm, gated MLP), or merge the adapter into the Megatron weights instead")
        raise PeftFormatError(f"{label} {name} cannot represent {what}: {', '.join(found)}; {fix}")
    assumed = {field: value for field, value in _needs(FAMILIES[name]).items() if field not in description}
    if assumed:
        logger.warning(
            "the checkpoint does not record %s (written by an older megatron-lora-patch); assumed what %s needs: %s",
            ", ".join(assumed), name, ", ".join(f"{field}={value}" for field, value in assumed.items()),
        )
    return name
