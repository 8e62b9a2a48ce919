"""PEFT names of multi-latent attention (MLA, DeepSeek-V2 / V3): Megatron's MLA linears -> transformers'
DeepseekV3Attention (`self_attn.*`), one module each, the factors as they are.

| Megatron (`self_attention.`) | transformers (`self_attn.`) | output rows, both sides                           |
|------------------------------|-----------------------------|---------------------------------------------------|
| linear_q_proj (no q latent)  | q_proj                      | per head [qk_nope; qk_rope]                       |
| linear_q_down_proj           | q_a_proj                    | q_lora_rank                                       |
| linear_q_up_proj             | q_b_proj                    | per head [qk_nope; qk_rope]                       |
| linear_kv_down_proj          | kv_a_proj_with_mqa          | [kv_lora_rank; qk_rope] (the latent, then the RoPE key) |
| linear_kv_up_proj            | kv_b_proj                   | per head [qk_nope; v]                             |
| linear_proj                  | o_proj                      | hidden                                            |

Megatron's `MLASelfAttention.get_query_key_value_tensors` splits these outputs exactly as
`DeepseekV3Attention.forward` does (`view(..., heads, -1)` then split, the latent before the RoPE part), and
both rotate the RoPE part interleaved (Megatron's `mla` path, transformers' `rope_interleave=True`), so the
rows need no permutation. The adapters sit on each projection's own input, before the latent norms
(`q_a_layernorm` / `kv_a_layernorm`), where PEFT's sit. docs/export.md.
"""

from __future__ import annotations

from typing import List

#: Megatron's MLA linears besides `linear_proj` (whose name every family shares: `o_proj`).
LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
PREFIX = "self_attention."


def is_mla(module: str) -> bool:
    """Whether `module` (inside a layer) is one of MLA's own linears."""
    return module.startswith(PREFIX) and module[len(PREFIX) :] in LINEARS


def projections(module: str, names) -> List[str]:
    """The HF module path (inside a layer) of the MLA linear `module`, or a one-line `PeftFormatError` for a
    family without multi-latent attention."""
    from megatron_lora_patch.lora.exchange.family_table import with_mla
    from megatron_lora_patch.lora.exchange.names import PeftFormatError

    if names.mla is None:
        raise PeftFormatError(
            f"{module}: this model family has no multi-latent attention; use --family {' or '.join(with_mla())}"
        )
    return [f"{names.attention}.{getattr(names.mla, module[len(PREFIX) :])}"]
