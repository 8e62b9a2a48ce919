"""Sensitivity mutations: named, toggleable re-introductions of known bugs (docs/architecture.md section 8).

A mutation runs only inside the oracle harness. Each names the topology that exposes
it; the oracle must FAIL on that topology with the mutation on, or the harness is broken.

A mutation changes a run in up to four ways, all applied in every rank of the job:
- `install(patcher)`: runs after the oracle turned its patches on and before the model
  is built; every change goes through the `Patcher` (reverted when the job ends). It
  must be a module-level function (jobs are pickled to spawned ranks).
- `settings`: overrides of `testbed.settings.TrainSettings` fields.
- `lora`: overrides of `lora.config.LoraConfig` fields.
- `options`: `LoraConfig` fields of the feature whose bug it re-introduces (e.g. `modules_to_save`);
  unlike `lora`, its world-1 reference runs with them too.
- `patches`: on/off overrides of `lora_correct` patches (e.g. a patch left out).
- `data`: the data layout the bug needs (`"packed"`: THD rows, `testbed.packing`), reference included.

Each install bends exactly one invariant of docs/architecture.md section 4 or 5, at the place
where the real bug lived, and patches a function where it is looked up at call time
(module globals of its caller), so nothing outside the mutation changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Tuple

from megatron_lora_patch.proof.oracle.known_bugs import (
    avg_instead_of_sum,
    expert_grads_over_dense_dp,
    full_output_on_partial_sum_expert_path,
    lora_input_grad_outside_collective,
    lora_plus_ratio_on_a,
    rank_local_random_init,
    skip_expert_tp_sum,
    skip_tp_sum_column_a,
    skip_tp_sum_row_b,
    swiglu_gate_up_mismatch,
    wrong_qkv_packing,
    xavier_fan_in_local_shard,
)
from megatron_lora_patch.proof.oracle.known_bugs_dora import (
    dora_magnitude_outside_grad_sync,
    dora_norm_not_detached,
    dora_row_norm_local,
)
from megatron_lora_patch.proof.oracle.known_bugs_mla import (
    kv_adapter_after_latent_norm,
    partial_rope_key_grad,
    skip_tp_sum_mla_down_projection,
)
from megatron_lora_patch.proof.oracle.known_bugs_moe import expert_bias_from_local_counts
from megatron_lora_patch.proof.oracle.known_bugs_packed import (
    attention_across_packed_sequences,
    cp_chunks_across_sequences,
    loss_mask_ignored_on_one_cp_rank,
)
from megatron_lora_patch.proof.oracle.known_bugs_sync import (
    adapter_pre_hooks_not_fired,
    ddp_average_on_top,
    finalize_with_dp_only_token_count,
    finalize_with_local_trained_fully_grads,
    finalize_with_rank_local_token_count,
    grad_norm_metadata_on_replicated,
)
from megatron_lora_patch.runtime.patching import Patcher

_MOE = ("--num-experts", "a MoE model")
#: What each oracle model kind needs of the user's arguments, as `Mutation.needs` pairs.
MODEL_NEEDS = {
    "moe": (_MOE,),
    "deepseek": (_MOE, ("--moe-router-enable-expert-bias", "a MoE router with the expert bias")),
    "mla": (("--multi-latent-attention", "multi-latent attention"),),
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    bug: str  # what known bug it re-introduces, and where it was seen
    topology: str  # the topology that exposes it
    model: str = "dense"  # "dense" | "moe" | "mla" | "deepseek"
    install: Optional[Callable[[Patcher], None]] = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lora: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    patches: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    data: str = ""  # the data layout it needs ("packed"), its reference too; "" runs the oracle's
    # (Megatron-LM flag, what it gives) the user's arguments must set for the bug to change anything, beyond what its
    # `model` kind needs (`MODEL_NEEDS`); the preflight refuses the mutation without them rather than pass a run it
    # left unchanged (`requirements`)
    needs: Tuple[Tuple[str, str], ...] = ()
    # topology conditions (`exposure.CONDITIONS`) any one of which exposes the bug, as measured on every single-axis
    # two-rank topology (empty: every world, one rank too); and those its code does not model (`exposure.refusal`)
    exposed_by: Tuple[str, ...] = ()
    unsupported: Tuple[str, ...] = ()

    def requirements(self) -> Tuple[Tuple[str, str], ...]:
        """Every (flag, what it gives) the bug needs: its model kind's, then its own."""
        return MODEL_NEEDS.get(self.model, ()) + self.needs


# -- the registry --------------------------------------------------------------------------

_ALL = (
    Mutation(
        "skip_tp_sum_column_a",
        "The replicated A of a column-parallel LoRA keeps its per-rank partial grad (no TP SUM), as in ART's "
        "Megatron backend before PR #619.",
        "tp2",
        exposed_by=("tp",),
        install=skip_tp_sum_column_a,
    ),
    Mutation(
        "skip_tp_sum_row_b",
        "The replicated B of a row-parallel LoRA keeps its per-rank partial grad (no TP SUM), as in ART's "
        "Megatron backend before PR #619.",
        "tp2",
        exposed_by=("tp",),
        install=skip_tp_sum_row_b,
    ),
    Mutation(
        "avg_instead_of_sum",
        "Replicated LoRA factor grads are AVERAGED over TP instead of summed, the reduction ART PR #619 "
        "replaced with a SUM on the shard domain.",
        "tp2-sp",
        exposed_by=("tp",),
        install=avg_instead_of_sum,
    ),
    Mutation(
        "skip_expert_tp_sum",
        "Expert LoRA factors replicated over expert-TP (fc1 A, fc2 B) keep partial grads (no expert-TP SUM), "
        "the expert half of ART PR #619.",
        "tp2-etp2-sp",
        exposed_by=("etp",),
        model="moe",
        install=skip_expert_tp_sum,
    ),
    Mutation(
        "local_token_normalization",
        "Each DP rank divides its loss by its own trainable-token count instead of the global count, the "
        "local normalization ART PR #619 fixed (docs/architecture.md section 5).",
        "dp2",
        exposed_by=("dp", "cp"),
        settings={"finalize_model_grads_func": finalize_with_rank_local_token_count},
    ),
    Mutation(
        "ddp_average_on_top",
        "DDP averages grads over DP on top of the 1/global-token scaling of per-token loss (the combination "
        "Megatron-Core forbids with calculate_per_token_loss and average_in_collective).",
        "dp2",
        exposed_by=("dp", "cp"),
        install=ddp_average_on_top,
    ),
    Mutation(
        "wrong_qkv_packing",
        "qkv LoRA B is sharded over TP as [all q | all k | all v] instead of Megatron's per-query-group "
        "[q, k, v] packing, the QKV layout bug of ART PR #619.",
        "tp2",
        install=wrong_qkv_packing,
    ),
    Mutation(
        "rank_local_random_init",
        "LoRA factors are drawn from a per-rank seed, so replicated factors start different on each TP rank "
        "(ART PR #619 broadcast-initializes them; docs/architecture.md section 4).",
        "tp2",
        exposed_by=("tp", "pp"),
        install=rank_local_random_init,
    ),
    Mutation(
        "lora_input_grad_outside_collective",
        "The column-parallel LoRA branch reads the rank-local input, so its input grad bypasses the base "
        "layer's TP all-reduce and stays a partial sum (docs/architecture.md section 4).",
        "tp2",
        exposed_by=("tp",),
        unsupported=("sp",),
        install=lora_input_grad_outside_collective,
    ),
    Mutation(
        "full_output_on_partial_sum_expert_path",
        "The expert fc2 LoRA output is all-reduced to a full output on the explicit-expert-comm path whose "
        "dispatcher sums partials again (double count, Megatron-Bridge #5634 / #6089).",
        "tp2-etp2-sp",
        exposed_by=("etp",),
        model="moe",
        install=full_output_on_partial_sum_expert_path,
    ),
    Mutation(
        "expert_grads_over_dense_dp",
        "Expert LoRA factors are synced over the dense DP group instead of expert-DP (allreduce=True), "
        "mixing different experts' weights and grads (Megatron-Bridge #5229).",
        "ep2",
        exposed_by=("expert_dp",),
        model="moe",
        install=expert_grads_over_dense_dp,
    ),
    Mutation(
        "grad_norm_metadata_on_replicated",
        "Replicated LoRA factors are counted on every TP rank in the grad norm, as when they carry "
        "tensor_model_parallel=True metadata (double-counted norm, wrong clipping).",
        "tp2",
        exposed_by=("tp",),
        install=grad_norm_metadata_on_replicated,
    ),
    Mutation(
        "finalize_not_installed",
        "config.finalize_model_grads_func is None, so DP sync, 1/num_tokens scaling and the replicated SUM "
        "never run (SkyRL #223; the finalize_grads patch that detects it is off).",
        "dp2",
        settings={"finalize_model_grads_func": None},
        patches={"finalize_grads": False},
    ),
    Mutation(
        "xavier_fan_in_local_shard",
        "Row-parallel LoRA A is initialized with the fan-in of its local TP shard instead of the full "
        "input size (Megatron-Bridge #5840).",
        "tp2",
        exposed_by=("tp",),
        install=xavier_fan_in_local_shard,
    ),
    Mutation(
        "swiglu_gate_up_mismatch",
        "SwiGLU fc1 LoRA B is a plain contiguous split of [gate; up] while each base shard holds "
        "[gate_shard; up_shard] (docs/architecture.md section 4).",
        "tp2",
        exposed_by=("tp",),
        install=swiglu_gate_up_mismatch,
    ),
    Mutation(
        "cp_token_count_dp_only",
        "The per-token loss denominator is summed over DP only, not DP x CP, so each CP rank divides by its "
        "own chunk's count when CP > 1 (seed 002, NMFW-17 CP review).",
        "cp2",
        exposed_by=("cp",),
        settings={"finalize_model_grads_func": finalize_with_dp_only_token_count},
    ),
    Mutation(
        "packed_attention_across_sequences",
        "Packed (THD) rows get plain causal attention: a token attends to the earlier sequences of its row, "
        "as when cu_seqlens never reach the attention (issue 36).",
        "cp2",
        install=attention_across_packed_sequences,
        data="packed",
    ),
    Mutation(
        "packed_cp_chunks_across_sequences",
        "CP splits a packed row into 2 * cp chunks of the row, cutting across sequence boundaries, instead of "
        "2 * cp chunks per sequence (Megatron's per-document split, TE's thd_get_partitioned_indices).",
        "cp2",
        exposed_by=("cp",),
        install=cp_chunks_across_sequences,
        data="packed",
    ),
    Mutation(
        "packed_local_token_normalization",
        "Under packing each rank divides its loss by its own valid-token count instead of the global "
        "count over DP x CP (packed rows' masks leave unequal counts per rank; docs/architecture.md section 5).",
        "cp2",
        exposed_by=("dp", "cp"),
        settings={"finalize_model_grads_func": finalize_with_rank_local_token_count},
        data="packed",
    ),
    Mutation(
        "packed_loss_mask_ignored_on_one_cp_rank",
        "CP rank 1 ignores the loss mask of its packed chunks (prompt tokens and sequence ends trained).",
        "cp2",
        exposed_by=("cp",),
        install=loss_mask_ignored_on_one_cp_rank,
        data="packed",
    ),
    Mutation(
        "trained_fully_outside_dp_sync",
        "A fully trained weight (modules_to_save: the output layer) keeps its own DP rank's grad, never summed "
        "over DP, as when it is trained outside DDP's grad buffers (each DP rank then steps differently).",
        "dp2",
        exposed_by=("dp", "cp"),
        settings={"finalize_model_grads_func": finalize_with_local_trained_fully_grads},
        options={"modules_to_save": ("output_layer",)},
    ),
    Mutation(
        "adapter_param_gather_not_awaited",
        "Under --overlap-param-gather (distributed optimizer) the adapters' forward pre-hooks never run, as when "
        "an adapter's math rides its linear's call: DDP never waits for their params' all-gather, so the next "
        "step reads factors before the other DP ranks' updates arrive (lora/training/param_sync.py).",
        "dp2",
        exposed_by=("dp", "cp"),
        install=adapter_pre_hooks_not_fired,
        settings={"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
                  "ddp_bucket_size": 4096},
    ),
    Mutation(
        "lora_plus_ratio_on_a",
        "LoRA+ applies its learning-rate ratio to A instead of B (PEFT's loraplus_lr_ratio scales lora_B), so A "
        "takes the large steps and B the small ones.",
        "tp2",
        install=lora_plus_ratio_on_a,
        options={"plus_ratio": 4.0},
    ),
    Mutation(
        "dora_row_norm_local",
        "A row-parallel layer's DoRA norm ||W + sBA|| is taken over the rank's own input slice, not summed over "
        "TP (the input dimension the norm runs over is the sharded one).",
        "tp2",
        exposed_by=("tp",),
        install=dora_row_norm_local,
        options={"dora": True},
    ),
    Mutation(
        "dora_magnitude_outside_grad_sync",
        "A row-parallel layer's DoRA magnitude m (replicated over TP) keeps its per-rank partial grad: m left "
        "out of the replicated factors' TP SUM.",
        "tp2",
        exposed_by=("tp",),
        install=dora_magnitude_outside_grad_sync,
        options={"dora": True},
    ),
    Mutation(
        "dora_norm_not_detached",
        "DoRA's weight norm keeps its graph, so A and B also get the norm's gradient (PEFT detaches the norm, "
        "DoRA paper section 4.3).",
        "tp2",
        install=dora_norm_not_detached,
        options={"dora": True},
    ),
    Mutation(
        "mla_down_projection_grad_not_summed",
        "The replicated factor of an MLA down projection (linear_q_down_proj / linear_kv_down_proj) keeps its "
        "per-rank partial grad under SP, each rank having seen its own sequence shard (the MLA fix other "
        "projects shipped after release).",
        "tp2-sp",
        exposed_by=("tp",),
        model="mla",
        install=skip_tp_sum_mla_down_projection,
    ),
    Mutation(
        "kv_adapter_after_latent_layernorm",
        "The kv down projection's LoRA term is added after MLA's latent layernorm (kv_layernorm) instead of to "
        "the projection's output before it, where PEFT's kv_a_proj_with_mqa adapter sits.",
        "dp2",
        model="mla",
        install=kv_adapter_after_latent_norm,
        # Megatron's local spec builds kv_layernorm only with --qk-layernorm (else IdentityOp: nothing to be after)
        needs=(("--qk-layernorm", "MLA's latent norms"),),
    ),
    Mutation(
        "mla_rope_key_grad_partial",
        "Megatron-Core's local-spec MLA: the RoPE key's grad stays a partial sum over TP behind the gather of "
        "the column-parallel kv down projection (lora_linear sums it; lora/layers/mla_rope_key.py).",
        "tp2",
        exposed_by=("tp",),
        model="mla",
        install=partial_rope_key_grad,
    ),
    Mutation(
        "expert_bias_from_local_counts",
        "DeepSeek's aux-loss-free expert bias is moved by each rank's own tokens per expert instead of the count "
        "over TP x DP x CP that Megatron-Core all-reduces, so the bias and the routing it steers depend on the layout.",
        "dp2",
        exposed_by=("tp", "dp", "cp"),
        model="deepseek",
        install=expert_bias_from_local_counts,
    ),
)

#: Every mutation by name, in the order the oracle runs them.
MUTATIONS: dict[str, Mutation] = {mutation.name: mutation for mutation in _ALL}
