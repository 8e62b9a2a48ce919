"""Multi-latent attention (MLA) on CPU: Megatron's local core attention with MLA's head dims.

`MultiLatentAttention` builds its core attention with `k_channels` (query-key head dim,
`qk_head_dim + qk_pos_emb_head_dim`) and `v_channels` (`v_head_dim`) and its own
`softmax_scale` (YaRN mscale^2 / sqrt(q_head_dim)). Only Transformer Engine's attention
takes those; Megatron's local `DotProductAttention` does not, so the local spec cannot build
MLA. Its math, though, is head-dim agnostic - softmax(scale * Q K^T, causal mask) V through
`baddbmm`, `FusedScaleMaskSoftmax` and `bmm` - except for the final view, which assumes the
value head dim is `kv_channels`. `MLADotProductAttention` is that attention with the value
width set from `v_channels`: every number is Megatron's own computation.

The `cpu_compat` hook swaps it in where `multi_latent_attention` builds the local
`DotProductAttention`; TE's attention kernel is never replaced (and never runs on CPU).
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def mla_attention_class(base: type) -> type:
    """`base` (Megatron's `DotProductAttention` or a subclass with its math, such as the testbed's CP
    attention) taking MLA's query-key (`k_channels`) and value (`v_channels`) head dims."""

    class MLAAttention(base):
        __doc__ = f"`{base.__name__}` with MLA's query-key and value head dims (`k_channels`, `v_channels`)."

        def __init__(self, *args, k_channels=None, v_channels=None, softmax_scale=None, **kwargs):
            if k_channels is None or v_channels is None:  # `Attention.__init__` builds one first, MLA then its own
                super().__init__(*args, softmax_scale=softmax_scale, **kwargs)
                return
            if softmax_scale is None:  # what TE's attention defaults to: 1 / sqrt(query-key head dim)
                softmax_scale = k_channels**-0.5
            super().__init__(*args, softmax_scale=softmax_scale, **kwargs)
            self.hidden_size_per_attention_head = k_channels
            self.hidden_size_per_attention_head_v = v_channels
            heads = self.num_attention_heads_per_partition
            self.hidden_size_per_partition = heads * v_channels  # the context's width: heads x value dim
            self.num_query_groups_per_partition = heads  # MLA: one key / value head per query head

    MLAAttention.__name__ = MLAAttention.__qualname__ = f"MLA{base.__name__}"
    return MLAAttention


def mla_dot_product_attention() -> type:
    """`MLADotProductAttention`: Megatron's local `DotProductAttention` with MLA's head dims."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return mla_attention_class(DotProductAttention)


def build_mla_core_attention(wrapped, instance, args, kwargs):
    """`build_module` of `multi_latent_attention`: the local `DotProductAttention` becomes the MLA one.

    Every other module (linears, norms, TE's attention) is built as Megatron builds it.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = args[0] if args else kwargs.get("spec_or_module")
    module = spec.module if isinstance(spec, ModuleSpec) else spec
    if module is DotProductAttention and "k_channels" in kwargs:
        replacement = mla_dot_product_attention()
        spec = ModuleSpec(module=replacement, params=spec.params) if isinstance(spec, ModuleSpec) else replacement
        if args:
            args = (spec, *args[1:])
        else:
            kwargs = {**kwargs, "spec_or_module": spec}
    return wrapped(*args, **kwargs)


def install(patcher, mla_module) -> None:
    """Build MLA's core attention on CPU (see the module docstring).

    0.14-0.16 set `HAVE_TE` when `megatron.core.extensions.transformer_engine` imports, which it does
    without Transformer Engine (its `TELinear` is then None), and `isinstance(..., TELinear)` raises:
    without a `TELinear` class there is no TE, so `HAVE_TE` is False.
    """
    patcher.wrap(mla_module, "build_module", build_mla_core_attention)
    if getattr(mla_module, "HAVE_TE", False) and not isinstance(getattr(mla_module, "TELinear", None), type):
        patcher.replace(mla_module, "HAVE_TE", False)
