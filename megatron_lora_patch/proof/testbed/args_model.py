"""The user's GPT model, built from their own Megatron-LM arguments and scaled down in depth.

`args_parse.parse_megatron_args(argv, topology_of)` runs Megatron-LM's own parser and
`validate_args` (as `pretrain_gpt.py` does, without initializing distributed); `ArgsModelSpec.from_args`
keeps every width (hidden, heads, query groups, ffn, experts, top-k, vocabulary) and only
cuts the number of layers to the fewest that hold every distinct layer kind (dense / MoE
from `--moe-layer-freq`; attention / MLP / MoE from `--hybrid-layer-pattern`, see
`testbed.args_hybrid`), a multiple of the pipeline size. A model still over the preflight's budget
is cut further by `testbed.args_cuts` (experts, vocabulary, widths; recorded in `cuts`). Inside a rank,
`ArgsModelSpec.build_model(topology, seed)` builds the TransformerConfig through
`core_transformer_config_from_args` and the layer spec the way Megatron-LM's GPT builder
chooses it, then overwrites every frozen base weight with a draw from (seed, logical
name) alone, so every topology and the world-size-1 reference hold the same model
(the LoRA adapters keep their own topology-invariant init).

Changes the comparison needs, each reported by `deviations()`: dropout off (random masks
cannot match across topologies); on CPU the local (non-Transformer-Engine) layers and no
fused CUDA kernels (they compute the same function).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import math
from typing import Any, List, Optional, Sequence, Tuple

from megatron_lora_patch.proof.testbed.args_check import failure_reason
from megatron_lora_patch.proof.testbed.args_hybrid import build_hybrid_model, hybrid_layer_kinds, kept_pattern
from megatron_lora_patch.runtime.errors import UsageError

DENSE, MOE = "dense", "moe"
#: What does not run on CPU (fused CUDA kernels: the same math; TE): (argument, value).
CPU_OFF = (
    ("apply_rope_fusion", False),
    ("bias_swiglu_fusion", False),
    ("bias_gelu_fusion", False),
    ("bias_dropout_fusion", False),
    ("masked_softmax_fusion", False),
    ("gradient_accumulation_fusion", False),
    ("cross_entropy_loss_fusion", False),
    ("no_persist_layer_norm", True),
    ("moe_grouped_gemm", False),
    ("transformer_impl", "local"),
)
DROPOUT_OFF = (("hidden_dropout", 0.0), ("attention_dropout", 0.0))
#: Arguments that fix a per-layer structure the depth cut would break.
UNSUPPORTED = (
    ("virtual_pipeline_model_parallel_size", "virtual pipeline stages"),
    ("num_layers_per_virtual_pipeline_stage", "virtual pipeline stages"),
    ("decoder_first_pipeline_num_layers", "uneven pipeline stages"),
    ("decoder_last_pipeline_num_layers", "uneven pipeline stages"),
    ("pipeline_model_parallel_layout", "a pipeline layout"),
    ("mtp_num_layers", "multi-token prediction layers"),
    ("heterogeneous_layers_config_path", "heterogeneous layers"),
    ("fp16", "fp16 loss scaling (compare in --bf16 or fp32)"),
)


def layer_kinds(args: argparse.Namespace) -> List[str]:
    """The kind of every layer of the user's model: from `--hybrid-layer-pattern` if given, else from
    `--num-experts` and `--moe-layer-freq`."""
    if getattr(args, "hybrid_layer_pattern", None):
        return hybrid_layer_kinds(args)
    if not args.num_experts:
        return [DENSE] * args.num_layers
    frequency = args.moe_layer_freq
    if isinstance(frequency, int):
        return [MOE if index % frequency == 0 else DENSE for index in range(args.num_layers)]
    return [MOE if flag else DENSE for flag in frequency]


def scaled_kinds(kinds: Sequence[str], pp: int, layers: Optional[int] = None) -> Tuple[str, ...]:
    """The fewest layers (a multiple of pp, or `layers`) holding every distinct kind, in first-seen order."""
    distinct = list(dict.fromkeys(kinds))
    if layers is None:
        layers = math.ceil(len(distinct) / pp) * pp
    if layers < len(distinct):
        raise UsageError(
            f"--layers {layers} cannot hold every layer kind ({', '.join(distinct)}); "
            f"use --layers {len(distinct)} or more"
        )
    if layers % pp:
        raise UsageError(f"--layers {layers} is not divisible by the pipeline size {pp}; use a multiple of {pp}")
    most_common = max(distinct, key=kinds.count)
    return tuple(distinct + [most_common] * (layers - len(distinct)))


def padded_vocab_size(args: argparse.Namespace) -> Tuple[int, int]:
    """(vocabulary size, size padded like Megatron-LM: to make_vocab_size_divisible_by * tp)."""
    vocab = args.vocab_size
    if vocab is None:
        try:
            from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

            vocab = build_tokenizer(args).vocab_size
        except Exception as error:  # any tokenizer failure: the user passes the size instead
            raise UsageError(
                f"cannot build the tokenizer to learn the vocabulary size ({type(error).__name__}: {error}); "
                "add --vocab-size N after -- (your tokenizer's size)"
            ) from None
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return vocab, math.ceil(vocab / multiple) * multiple


@dataclasses.dataclass(frozen=True, eq=False)
class ArgsModelSpec:
    """The scaled user model; duck-types the testbed's `TinyGPTSpec` where `Job` and the driver read it."""

    args: argparse.Namespace = dataclasses.field(repr=False)  # validated Megatron-LM arguments (the user's depth)
    kinds: Tuple[str, ...]  # kind of each kept layer
    seq_length: int
    vocab_size: int  # token ids drawn below this (the tokenizer's size)
    padded_vocab_size: int
    cpu: bool = True
    cuts: Tuple[Tuple[str, Any, Any], ...] = ()  # (option, yours, run): what args_cuts.cut_to_fit cut to fit

    @classmethod
    def from_args(cls, args, *, layers: Optional[int] = None, seq_length: Optional[int] = None, cpu: bool = True):
        kinds = layer_kinds(args)  # first: a hybrid pattern's own refusals name the pattern
        for name, what in UNSUPPORTED:
            if getattr(args, name, None):
                raise UsageError(
                    f"preflight does not support {what} yet: drop --{name.replace('_', '-')} for the preflight"
                )
        vocab, padded = padded_vocab_size(args)
        kinds = scaled_kinds(kinds, args.pipeline_model_parallel_size, layers)
        return cls(args, kinds, seq_length or args.seq_length, vocab, padded, cpu)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)

    @property
    def num_experts(self) -> Optional[int]:
        return self.args.num_experts

    @property
    def is_moe(self) -> bool:
        return bool(self.args.num_experts)

    @property
    def hybrid_pattern(self) -> Optional[str]:
        """The kept hybrid layer pattern at your pipeline size (a `|` at each stage boundary); None for GPT."""
        return self._pattern(self.args.pipeline_model_parallel_size)

    def _pattern(self, pp: int) -> Optional[str]:
        if not getattr(self.args, "hybrid_layer_pattern", None):
            return None
        return kept_pattern(self.kinds, pp)

    @property
    def family(self) -> str:
        """hybrid | moe | dense: the model kind the report names."""
        return "hybrid" if self.hybrid_pattern else MOE if MOE in self.kinds else DENSE

    @property
    def dtype(self) -> str:
        return "bf16" if self.args.bf16 else "fp32"

    def in_fp32(self) -> "ArgsModelSpec":
        """This model in fp32 (the bf16 preflight's reference, proof/oracle/bf16_rule.py), as Megatron-LM's
        `validate_args` sets it up without --bf16."""
        import torch

        args = copy.copy(self.args)
        args.bf16, args.params_dtype = False, torch.float32
        return dataclasses.replace(self, args=args)

    def changes(self) -> List[Tuple[str, Any, Any]]:
        """(argument, the user's value, the value the preflight runs with), beyond depth and sequence."""
        overrides = DROPOUT_OFF + (CPU_OFF if self.cpu else ())
        return [
            (name, getattr(self.args, name, None), value)
            for name, value in overrides
            if getattr(self.args, name, None) != value
        ]

    def run_args(self, topology: Any) -> argparse.Namespace:
        """The arguments of this scaled model on `topology` (None: the world-size-1 reference)."""
        args = copy.copy(self.args)
        for name, _, value in self.changes():
            setattr(args, name, value)
        sizes = {name: getattr(topology, name, 1) for name in ("tp", "pp", "cp", "ep", "etp")}
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = sizes["tp"], sizes["pp"]
        args.context_parallel_size, args.expert_model_parallel_size = sizes["cp"], sizes["ep"]
        args.expert_tensor_parallel_size = sizes["etp"]
        # validate_args resolved the weight-shard counts for the user's TP / expert-TP sizes; on another
        # topology they mean GTP (gtp_weight_remat_size = shards // tp), which LoRA refuses: one shard per rank.
        for shards, size in (
            ("tensor_parallel_num_weight_shards", sizes["tp"]),
            ("expert_tensor_parallel_num_weight_shards", sizes["etp"]),
        ):
            if hasattr(args, shards):
                setattr(args, shards, size)
        for remat in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size"):
            if hasattr(args, remat):
                setattr(args, remat, 1)
        args.sequence_parallel = bool(getattr(topology, "sp", False))
        args.num_layers = self.num_layers
        if self.hybrid_pattern:  # the world-size-1 reference: one stage, the same layers
            args.hybrid_layer_pattern = self._pattern(sizes["pp"])
        elif self.is_moe:
            args.moe_layer_freq = [int(kind == MOE) for kind in self.kinds]
        args.seq_length = self.seq_length
        args.max_position_embeddings = max(args.max_position_embeddings or 0, self.seq_length)
        args.use_cpu_initialization = (
            True  # Megatron sets the TP attributes of CPU-built params only while initializing
        )
        return args

    def config(self, topology: Any):
        """Megatron's TransformerConfig of this model on `topology`, through Megatron-LM's own path."""
        from megatron.training.argument_utils import core_transformer_config_from_args

        return core_transformer_config_from_args(self.run_args(topology))

    def check(self, topology: Any) -> None:
        """Build the config for the topology and for world size 1: a rejected model is one UsageError."""
        for where in (topology, None):
            try:
                self.config(where)
            except (AssertionError, ValueError, TypeError) as error:
                raise UsageError(f"Megatron-Core rejects this model: {failure_reason(error)}") from None

    def check_topology(self, topology: Any) -> None:
        """Nothing left to check: Megatron-LM's own `validate_args` accepted the user's topology."""

    def build_model(self, topology: Any, seed: int) -> list:
        """This rank's GPTModel or HybridModel (one chunk) with the logical base weights loaded. Needs
        parallel_state."""
        from megatron.core.models.gpt import GPTModel

        args, config = self.run_args(topology), self.config(topology)
        if self.hybrid_pattern:
            model = build_hybrid_model(self, args, config, functools.partial(_local_layer_spec, args))
        else:
            model = GPTModel(
                config=config,
                transformer_layer_spec=_layer_spec(config, args),
                rope_scaling=args.use_rope_scaling,
                **self.model_arguments(args),
            )
        load_logical_draw([model], seed, config.init_method_std)
        return [model]

    def model_arguments(self, args: argparse.Namespace) -> dict:
        """The keyword arguments Megatron-LM's GPT and hybrid model builders both take from the arguments."""
        from megatron.core import parallel_state

        return dict(
            vocab_size=self.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
            fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
            parallel_output=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
        )


def _layer_spec(config, args: argparse.Namespace):
    """The layer spec Megatron-LM's GPT builder picks (TE or local; the MoE block spec), with the
    testbed's context-parallel core attention on CPU (Megatron's local attention has no CP)."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = args.transformer_impl == "transformer_engine"
    if config.num_moe_experts:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization, qk_l2_norm=args.qk_l2_norm
        )
        _local_cp_attention(args, spec.layer_specs)
        return spec
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            args.num_experts, args.moe_grouped_gemm, args.qk_layernorm, args.multi_latent_attention
        )
    return _local_layer_spec(args, args.num_experts)


def _local_layer_spec(args: argparse.Namespace, num_experts: Optional[int]):
    """Megatron's GPT local layer spec for these arguments (`num_experts` None: a dense MLP), with the
    testbed's CP core attention where cp > 1."""
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts,
        args.moe_grouped_gemm,
        args.qk_layernorm,
        args.multi_latent_attention,
        normalization=args.normalization,
    )
    _local_cp_attention(args, [spec])
    return spec


def _local_cp_attention(args: argparse.Namespace, layers: Sequence[Any]) -> None:
    """With cp > 1 the local layers' core attention is the testbed's context-parallel one."""
    if args.transformer_impl == "transformer_engine" or args.context_parallel_size == 1:
        return
    from megatron_lora_patch.proof.testbed.cp_attention import ContextParallelDotProductAttention

    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention


def load_logical_draw(chunks: list, seed: int, std: float) -> None:
    """Every frozen parameter gets its slice of a tensor drawn from (seed, logical name) alone.

    Norm weights are 1 + noise (a wrong norm shard changes results), biases and weights
    N(0, std). Trainable parameters (the LoRA adapters) keep their own init.
    """
    import torch

    from megatron_lora_patch.proof.testbed.shards import named_shards

    with torch.no_grad():
        for local_name, param, shard in named_shards(chunks):
            if param.requires_grad:
                continue
            shape = list(param.shape)
            if shard.partition_dim is not None:
                shape[shard.partition_dim] *= shard.size
            digest = hashlib.sha256(f"{seed}:{shard.logical_name}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            full = torch.randn(shape, generator=generator)
            parts = shard.logical_name.split(".")
            is_norm = any("norm" in part for part in parts[-2:]) and parts[-1].endswith("weight")
            full = 1.0 + 0.1 * full if is_norm else std * full
            param.copy_(shard.take(full))

