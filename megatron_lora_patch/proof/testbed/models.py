"""Tiny Megatron-Core GPT models (dense and MoE, local spec) with topology-independent weights.

A `TinyGPTSpec` describes the model; `build_model(spec, topology, seed)` builds this
rank's model chunk(s) inside an initialized world and loads its slice of
`logical_state_dict(spec, seed)`, the full world-size-1 weights drawn from
(seed, parameter name) alone. So the world-1 model and every topology hold the same
logical weights; `testbed.shards` maps rank-local tensors to and from that layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megatron_lora_patch.proof.testbed import mla
from megatron_lora_patch.proof.testbed.layer_specs import (  # noqa: F401  (models.layer_spec stays valid)
    gpt_block_spec,
    hybrid_stack_spec,
    layer_spec,
)
from megatron_lora_patch.proof.testbed.logical import (  # noqa: F401  (models.<name> stays valid for callers)
    DEFAULT_SEED,
    check_topology_fits,
    logical_shapes,
    logical_state_dict,
)


@dataclass(frozen=True)
class TinyGPTSpec:
    """A small GPT: RMSNorm, GQA, SwiGLU, RoPE, no linear biases; MoE when `num_experts` is set.

    Query groups (2) bound tensor parallelism to tp <= 2 for attention; vocab 128 divides
    every tp up to 8, so no vocab padding is needed (padding would depend on tp).
    """

    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    num_layers: int = 2
    vocab_size: int = 128
    seq_length: int = 16
    tie_embeddings: bool = False
    dtype: str = "float32"  # "float32" | "bfloat16"
    init_std: float = 0.02
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "allgather"  # "allgather" | "alltoall"
    moe_ffn_hidden_size: Optional[int] = None  # defaults to ffn_hidden_size
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_shared_expert_intermediate_size: Optional[int] = None
    first_dense_layers: int = 0
    #: A `HybridModel` (Megatron-Core 0.18+) of attention (`*`) and MLP (`-`) layers, one char per layer.
    hybrid_pattern: Optional[str] = None
    #: RMSNorm of each query and key head before RoPE (Qwen3's q_norm / k_norm); with MLA the latent norms.
    qk_layernorm: bool = False
    #: Fed packed rows (THD, `testbed.packing`): the core attention is the testbed's packed attention at every CP.
    packed: bool = False
    #: Multi-latent attention (DeepSeek-V2 / V3) when set: the kv latent width (`testbed.mla`).
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None  # MLA's query latent width; None: one `linear_q_proj`
    qk_head_dim: int = 16
    qk_pos_emb_head_dim: int = 8
    v_head_dim: int = 12
    rope_type: str = "yarn"  # MLA's RoPE: "rope" | "yarn"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall"):
            raise ValueError(
                f"moe_token_dispatcher_type must be 'allgather' or 'alltoall', got {self.moe_token_dispatcher_type!r}"
            )
        if self.hybrid_pattern is not None and (
            set(self.hybrid_pattern) - set("*-") or len(self.hybrid_pattern) != self.num_layers or self.num_experts
        ):
            raise ValueError(
                "hybrid_pattern must hold one '*' (attention) or '-' (MLP) per layer and no experts, "
                f"got {self.hybrid_pattern!r}"
            )
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_query_groups:
            raise ValueError("hidden_size must divide by num_attention_heads, and heads by num_query_groups")
        mla.check(self)

    @classmethod
    def moe(cls, dispatcher: str = "allgather", **overrides: Any) -> "TinyGPTSpec":
        """The MoE variant: 4 SequentialMLP experts, top-2 routing, the given token dispatcher."""
        return cls(num_experts=4, moe_token_dispatcher_type=dispatcher, **overrides)

    @classmethod
    def mla(cls, q_lora_rank: Optional[int] = 24, **overrides: Any) -> "TinyGPTSpec":
        """The MLA variant (DeepSeek-V3 shaped, `q_lora_rank=None`: V2-Lite's `linear_q_proj`): latent norms
        where the local spec can build them, YaRN RoPE, value head dim != query-key head dim."""
        heads = overrides.get("num_attention_heads", cls.num_attention_heads)
        options: dict[str, Any] = dict(
            kv_lora_rank=16, q_lora_rank=q_lora_rank, qk_layernorm=q_lora_rank is not None, num_query_groups=heads
        )  # MLA has no query groups: one key / value head per query head
        return cls(**{**options, **overrides})

    @classmethod
    def deepseek(cls, **overrides: Any) -> "TinyGPTSpec":
        """MLA plus DeepSeek-V3's MoE: sigmoid scores with the aux-loss-free expert bias, group-limited top-k
        (top-4 of 8 experts in 2 of 4 groups: topk / group_topk = 2, as in DeepSeek-V3), a routed scaling
        factor, a shared expert and one leading dense layer."""
        options: dict[str, Any] = dict(
            num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=32, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
            moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=64, first_dense_layers=1,
        )
        return cls.mla(**{**options, **overrides})

    def replace(self, **changes: Any) -> "TinyGPTSpec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def hybrid(cls, pattern: str = "*-*-", **overrides: Any) -> "TinyGPTSpec":
        """The hybrid variant: a `HybridModel` whose layers alternate as `pattern` says."""
        return cls(hybrid_pattern=pattern, num_layers=len(pattern), **overrides)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    @property
    def family(self) -> str:
        """dense | moe | hybrid | mla | deepseek (MLA + MoE): the model kind reports and oracle settings name."""
        if self.hybrid_pattern:
            return "hybrid"
        if self.is_moe:
            return "deepseek" if mla.is_mla(self) else "moe"
        return "mla" if mla.is_mla(self) else "dense"

    def layer_kinds(self) -> str:
        """One char per layer: '*' attention + MLP (GPT), else the hybrid pattern's '*' / '-'."""
        return self.hybrid_pattern or "G" * self.num_layers

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


def _parallel_sizes(topology: Any) -> dict:
    """`TransformerConfig`'s parallel sizes of `topology` (None: world size 1)."""
    names = ("tp", "pp", "cp", "ep", "etp")
    sizes = {name: getattr(topology, name, 1) if topology is not None else 1 for name in names}
    return dict(
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"],
        expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["etp"],
        sequence_parallel=bool(getattr(topology, "sp", False)),
    )


def _moe_options(spec: TinyGPTSpec) -> dict:
    """The MoE fields of the config: SequentialMLP experts, no load-balancing loss; DeepSeek's routing (score
    function, expert bias, group-limited top-k, scaling factor), shared experts and leading dense layers."""
    return dict(
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_enable_expert_bias=spec.moe_router_enable_expert_bias,
        moe_router_num_groups=spec.moe_router_num_groups,
        moe_router_group_topk=spec.moe_router_group_topk,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_layer_freq=[0] * spec.first_dense_layers + [1] * (spec.num_layers - spec.first_dense_layers),
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
        moe_ffn_hidden_size=spec.expert_ffn_hidden_size,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
    )


def transformer_config(
    spec: TinyGPTSpec,
    topology: Any = None,
    *,
    calculate_per_token_loss: bool = False,
    perform_initialization: bool = True,
    **overrides: Any,
):
    """Megatron `TransformerConfig` of `spec` on `topology` (any object with tp, pp, cp, ep, etp, sp).

    `topology=None` is the world-size-1 reference. Keep `perform_initialization` on even
    though `build_model` overwrites every weight: with CPU initialization Megatron sets
    the `tensor_model_parallel` / `partition_dim` param attributes only while initializing.
    `overrides` go straight to `TransformerConfig` (e.g. `moe_aux_loss_coeff`).
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = spec.torch_dtype
    options: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        ffn_hidden_size=spec.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=spec.init_std,
        # the fused CUDA kernels off: the same math in plain torch ops, on CPU too
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **_parallel_sizes(topology),
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
        params_dtype=dtype,
        bf16=spec.dtype == "bfloat16",
        pipeline_dtype=dtype,
        calculate_per_token_loss=calculate_per_token_loss,
        qk_layernorm=spec.qk_layernorm,
    )
    if spec.is_moe:
        options.update(_moe_options(spec))
    if mla.is_mla(spec):
        options.update(mla.config_options(spec))
    options.update(overrides)
    return (MLATransformerConfig if mla.is_mla(spec) else TransformerConfig)(**options)


def build_model(
    spec: TinyGPTSpec,
    topology: Any = None,
    seed: int = DEFAULT_SEED,
    *,
    calculate_per_token_loss: bool = False,
    state_dict: Optional[dict] = None,
    **config_overrides: Any,
) -> list:
    """This rank's GPTModel (HybridModel for a hybrid spec) chunk(s), one per PP stage, no virtual stages,
    with the logical weights loaded.

    Needs `parallel_state` initialized for `topology` (e.g. inside `Topology.world()`);
    `topology=None` means world size 1. `state_dict` (logical layout) defaults to
    `logical_state_dict(spec, seed)`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_lora_patch.proof.testbed import shards

    _check_parallel_state(topology)
    config = transformer_config(spec, topology, calculate_per_token_loss=calculate_per_token_loss, **config_overrides)
    common = dict(
        config=config,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_embeddings,
        position_embedding_type="rope",
    )
    if spec.hybrid_pattern:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        stages = getattr(topology, "pp", 1)
        per_stage = spec.num_layers // stages  # '|' marks Megatron's stage boundaries (0.19 deprecates implicit ones)
        pattern = "|".join(spec.hybrid_pattern[i : i + per_stage] for i in range(0, spec.num_layers, per_stage))
        model = HybridModel(hybrid_stack_spec=hybrid_stack_spec(spec, topology), hybrid_layer_pattern=pattern, **common)
    else:
        model = GPTModel(transformer_layer_spec=gpt_block_spec(spec, topology), **common)
    chunks = [model]
    uncovered = shards.load_logical(chunks, state_dict if state_dict is not None else logical_state_dict(spec, seed))
    if any(name.endswith(".lora.m") for name in uncovered):  # DoRA's m: from the base weights just loaded
        from megatron_lora_patch.lora.checkpoints.magnitudes import reset_magnitudes

        reset_magnitudes(model)
    return chunks


def _check_parallel_state(topology: Any) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_model needs Megatron's parallel_state; build inside Topology.world() / initialize()")
    expected = {
        "tp": getattr(topology, "tp", 1),
        "pp": getattr(topology, "pp", 1),
        "cp": getattr(topology, "cp", 1),
        "ep": getattr(topology, "ep", 1),
        "etp": getattr(topology, "etp", 1),
    }
    actual = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
        "ep": parallel_state.get_expert_model_parallel_world_size(),
        "etp": parallel_state.get_expert_tensor_parallel_world_size(),
    }
    if expected != actual:
        raise RuntimeError(f"build_model topology {expected} does not match the initialized parallel_state {actual}")
