"""Local (non-Transformer-Engine) `HybridStack` specs, cut from Megatron's GPT local layer specs.

Megatron-Core's own hybrid stack spec (`models/hybrid/hybrid_layer_specs.py`) is built from
Transformer Engine modules. On CPU the attention (`*`), MLP (`-`) and MoE (`E`) layers of a
hybrid pattern take the modules of the GPT local layer spec instead: the same linears,
norms, core attention and experts a local GPT layer has, split the way Megatron's hybrid
spec splits them (an attention layer without MLP, an MLP layer without attention, an MoE
layer without attention). Mamba and gated-delta-net layers are not offered: their mixers
need CUDA kernels (see `testbed.args_hybrid`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional


def stack_classes():
    """(HybridStack, HybridStackSubmodules): Megatron-Core 0.18+, `MambaStack` (the same stack) before."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    except ImportError:  # up to 0.17 the same stack is MambaStack
        from megatron.core.ssm.mamba_block import MambaStack as HybridStack
        from megatron.core.ssm.mamba_block import MambaStackSubmodules as HybridStackSubmodules
    return HybridStack, HybridStackSubmodules


def local_stack_spec(gpt_layer: Any, moe_layer: Optional[Any] = None, *, final_norm: bool):
    """A `HybridStack` spec whose attention and MLP layers are cut from `gpt_layer` (a GPT local layer
    spec without experts) and whose MoE layer, if given, is `moe_layer` (a GPT local MoE layer spec)
    without its attention. `final_norm`: build the stack's final norm (see `local_final_norm`)."""
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    stack, submodules_class = stack_classes()
    no_mlp = dict(pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    no_attention = dict(input_layernorm=IdentityOp, self_attention=IdentityOp, self_attn_bda=IdentityFuncOp)
    layers = {
        "attention_layer": dataclasses.replace(
            gpt_layer, submodules=dataclasses.replace(gpt_layer.submodules, **no_mlp)
        ),
        "mlp_layer": ModuleSpec(module=MLPLayer, submodules=dataclasses.replace(gpt_layer.submodules, **no_attention)),
    }
    if moe_layer is not None:
        layers["moe_layer"] = dataclasses.replace(
            moe_layer, submodules=dataclasses.replace(moe_layer.submodules, **no_attention)
        )
    return ModuleSpec(module=stack, submodules=submodules_class(**layers), params={"post_layer_norm": final_norm})


@contextlib.contextmanager
def local_final_norm(norm_class: Any):
    """While a HybridModel is built: its stack's final norm as `norm_class` (the GPT local block's norm).

    `HybridStack` builds the final norm as `TENorm` whatever its spec says, and Transformer Engine
    is absent on CPU; the local norm computes the same function (`config.normalization`)."""
    from megatron.core.models.hybrid import hybrid_block

    from megatron_lora_patch.runtime.patching import Patcher

    patcher = Patcher()
    patcher.replace(hybrid_block, "TENorm", norm_class)
    try:
        yield
    finally:
        patcher.revert()
