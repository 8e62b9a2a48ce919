"""What the oracle runs: its models, its settings, and which topology / model / data combinations it can run.

`check_topology` is the one gate: a combination it accepts runs; one it refuses is one `OracleError` naming
what would be valid (the CLI prints it as the line the user sees). The harness (`oracle.harness`) runs and
judges what this module accepted.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Dict, Optional

from megatron_lora_patch.layout_invariant.checks import expert_layout_problem, moe_settings_problem
from megatron_lora_patch.layout_invariant.tree import LANES
from megatron_lora_patch.proof.oracle import thresholds as limits
from megatron_lora_patch.proof.testbed import mla
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec, check_topology_fits
from megatron_lora_patch.proof.testbed.packing import MAX_PACKED_CP
from megatron_lora_patch.proof.testbed.topology import Topology
from megatron_lora_patch.runtime.errors import UsageError

#: The oracle's models: GQA (8 heads, 4 query groups: TP up to 4), SwiGLU, RoPE, RMSNorm;
#: 4 layers so PP up to 4 keeps whole layers per stage; the MoE variant has 4 experts, top-2.
DENSE = TinyGPTSpec(num_attention_heads=8, num_query_groups=4, num_layers=4)
MOE = TinyGPTSpec.moe(num_attention_heads=8, num_query_groups=4, num_layers=2)
#: A `HybridModel` (Megatron-Core 0.18+) alternating attention and MLP layers, the dense widths.
HYBRID = TinyGPTSpec.hybrid("*-*-", num_attention_heads=8, num_query_groups=4)
#: Multi-latent attention (DeepSeek-V3 shaped: q down / up, latent norms, YaRN, d_v != d_qk), 4 heads: TP up to 4.
MLA = TinyGPTSpec.mla(num_layers=2)
#: DeepSeek-V3 shaped: MLA, a leading dense layer, then a MoE layer routed as DeepSeek-V3 routes (sigmoid scores,
#: the aux-loss-free expert bias, group-limited top-4 of 8 experts, a routed scaling factor) plus a shared expert.
DEEPSEEK = TinyGPTSpec.deepseek(num_layers=2)
#: The models by `--model` name (auto picks dense or moe).
MODELS = {"dense": DENSE, "moe": MOE, "hybrid": HYBRID, "mla": MLA, "deepseek": DEEPSEEK}
REFERENCE = "tp1"
PACKED = "packed"
DATA_LAYOUTS = ("unpacked", PACKED)


@dataclasses.dataclass(frozen=True)
class OracleSettings:
    steps: int = 2
    dtype: str = "fp32"  # fp32 | bf16
    seed: int = 1234
    model: str = "auto"  # dense | moe | hybrid | mla | deepseek | auto (MoE for topologies with ep / etp)
    layout_invariant: bool = False  # the layout_invariant patch on; every phase must match bitwise
    lora_rank: int = 4
    lora_alpha: float = 8.0
    # More LoraConfig fields as (name, value) pairs, e.g. (("rslora", True), ("rank_pattern", {...}))
    lora_options: tuple = ()
    tie_embeddings: bool = False  # the dense / MoE model with tied embedding and output weights
    global_batch_size: int = 8  # samples per step, micro batch 1 (--layout-invariant: 16, two per microbatch lane)
    data: str = "unpacked"  # unpacked | packed (THD rows of several sequences, testbed.packing)
    timeout_s: float = 600.0

    def threshold(self, phase: str, step: int) -> Optional[float]:
        """Pass threshold of `phase` at optimizer step `step`; None: not compared (proof/oracle/thresholds.py)."""
        return limits.threshold(self.dtype, phase, step, self.layout_invariant)

    @property
    def thresholds(self) -> Dict[str, Dict[str, Optional[float]]]:
        return limits.describe(self.dtype, self.layout_invariant)


class OracleError(UsageError, ValueError):
    """Bad oracle input (topology, model, mutation name); the message says what would be valid."""


def model_for(topology: Topology, settings: OracleSettings) -> TinyGPTSpec:
    expert_parallel = topology.ep > 1 or topology.etp > 1
    if settings.model in ("dense", "hybrid", "mla") and expert_parallel:
        raise OracleError(
            f"topology {topology} shards experts but --model {settings.model} has none; "
            "use --model auto, moe or deepseek"
        )
    if settings.model == "hybrid" and importlib.util.find_spec("megatron.core.models.hybrid") is None:
        raise OracleError("--model hybrid needs Megatron-Core 0.18 or newer (HybridModel); use --model dense")
    if settings.model in ("mla", "deepseek") and _megatron_core_version() < (0, 14):
        raise OracleError(
            f"--model {settings.model} needs Megatron-Core 0.14 or newer (the testbed's MLA sets YaRN's "
            "original_max_position_embeddings, which 0.13 lacks); use --model dense or moe"
        )
    if settings.model == "auto":
        spec = MOE if expert_parallel else DENSE
    else:
        spec = MODELS[settings.model]
    spec = spec.replace(tie_embeddings=True) if settings.tie_embeddings else spec
    spec = spec.replace(packed=True) if settings.data == PACKED else spec
    return spec.replace(dtype="bfloat16") if settings.dtype == "bf16" else spec


def _megatron_core_version() -> tuple:
    """The installed Megatron-Core's (major, minor): from its distribution's metadata, or, for a source checkout
    on the path (no distribution), from `megatron.core.package_info`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("megatron-core")
    except PackageNotFoundError:
        from megatron.core.package_info import __version__ as text
    return tuple(int(part) for part in text.split(".")[:2])


def check_topology(topology: Topology, settings: OracleSettings) -> TinyGPTSpec:
    """The model this topology runs, or one OracleError saying why it cannot run."""
    spec = model_for(topology, settings)
    _check_data(topology, settings)
    uncovered = _not_layout_invariant(spec)
    if settings.layout_invariant and uncovered:
        raise OracleError(
            f"--layout-invariant does not cover --model {spec.family}: {uncovered} (docs/architecture.md section 7); "
            f"run --model {spec.family} without --layout-invariant"
        )
    if spec.is_moe and topology.tp > 1 and not topology.sp:
        raise OracleError(
            f"--model {spec.family} on {topology}: Megatron-Core trains MoE layers under tensor parallelism only "
            f"with sequence parallelism; use {topology}-sp"
        )
    if settings.layout_invariant and topology.cp > 1:
        raise OracleError(
            f"--layout-invariant covers tp, sp, dp, pp, ep and etp; {topology} also uses cp: use topologies like "
            "tp2, tp2-sp, dp2, pp2, tp2-dp2, ep2, ep2-etp2, tp2-ep2-sp"
        )
    problem = spec.is_moe and expert_layout_problem(topology.tp, topology.etp, topology.ep)
    if settings.layout_invariant and problem:
        raise OracleError(f"--layout-invariant cannot run {topology}: {problem}")
    if settings.layout_invariant and LANES % topology.dp:
        raise OracleError(
            f"--layout-invariant needs a dp dividing {LANES} (1, 2, 4, 8); {topology} has dp{topology.dp}"
        )
    _check_dora(spec, topology, settings)
    check_topology_fits(spec, topology)
    return spec


def _check_dora(spec: TinyGPTSpec, topology: Topology, settings: OracleSettings) -> None:
    """DoRA is refused on MoE experts at build (lora/layers/dora_scope.py): say so before any world, unless the
    options exclude the experts."""
    options = dict(settings.lora_options)
    if options.get("dora") and spec.is_moe and not any("expert" in pattern for pattern in options.get("exclude", ())):
        raise OracleError(
            f"DoRA on {topology} (--model {spec.family}): DoRA on MoE experts is not supported; run DoRA on the dense "
            "model (topologies without ep / etp) or exclude the experts (exclude=('*experts*',))"
        )


def _not_layout_invariant(spec: TinyGPTSpec) -> str:
    """What of `spec` the layout-invariant mode does not cover ('' if nothing): MLA, and the MoE settings
    `layout_invariant.checks` refuses (DeepSeek's expert bias and shared experts)."""
    problems = [moe_settings_problem(spec) or ""] if spec.is_moe else []
    if mla.is_mla(spec):
        problems.append("its bitwise reduction order has not been proven on MLA's latent projections")
    return "; ".join(problem for problem in problems if problem)


def _check_data(topology: Topology, settings: OracleSettings) -> None:
    """One OracleError where the data layout cannot run: packed rows under the layout-invariant mode, a CP
    that cannot split every packed sequence, or the hybrid model."""
    if settings.data not in DATA_LAYOUTS:
        raise OracleError(f"--data {settings.data!r}: use one of {', '.join(DATA_LAYOUTS)}")
    if settings.data != PACKED:
        return
    if settings.layout_invariant:
        raise OracleError(
            "--layout-invariant is not proven on packed data yet (its layouts are checked on unpacked rows); "
            "run it with --data unpacked"
        )
    if topology.cp > MAX_PACKED_CP:
        raise OracleError(
            f"--data packed splits each packed sequence into 2 * cp chunks, up to cp{MAX_PACKED_CP}; "
            f"{topology} has cp{topology.cp}: use cp2 or less"
        )
    if settings.model == "hybrid":
        raise OracleError("--data packed runs the dense and MoE models; use --model dense, moe or auto")


def model_name(spec: TinyGPTSpec) -> str:
    return spec.family


def describe_model(spec: TinyGPTSpec) -> str:
    """A short description for the report header."""
    experts = f", {spec.num_experts} experts top-{spec.moe_router_topk}" if spec.is_moe else ""
    experts += f", layers {spec.hybrid_pattern!r} (* attention, - MLP)" if spec.hybrid_pattern else ""
    experts += (
        f", MLA q_lora_rank {spec.q_lora_rank} kv_lora_rank {spec.kv_lora_rank} {spec.rope_type}"
        if mla.is_mla(spec) else ""
    )
    experts += (
        f", {spec.moe_router_score_function} router, expert bias, {spec.moe_router_group_topk} of "
        f"{spec.moe_router_num_groups} groups, scale {spec.moe_router_topk_scaling_factor}, shared expert "
        f"{spec.moe_shared_expert_intermediate_size}, {spec.first_dense_layers} dense layer(s) first"
        if spec.family == "deepseek" else ""
    )
    return (
        f"{spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads / "
        f"{spec.num_query_groups} query groups{experts}, seq {spec.seq_length}"
    )


def settings_for(spec: TinyGPTSpec, settings: OracleSettings) -> OracleSettings:
    """The reference of a MoE spec runs the MoE model even when `settings.model` says auto."""
    return dataclasses.replace(settings, model=spec.family)
