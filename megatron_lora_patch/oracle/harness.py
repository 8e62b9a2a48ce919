"""The oracle harness: world-1 reference vs topologies, per phase (DESIGN.md section 8).

Every run (reference, topology, mutation) is a `testing.runner.Job`: the same seeded
tiny GPT, the same topology-invariant LoRA adapters (non-zero B, so grads reach A) and
the same global batch, trained K steps through Megatron DDP, finalize and Adam with
clipping, with the `lora_correct` patches applied in every rank. Captures are
canonicalized to the world-1 layout and compared per phase:

- forward: outputs of every adapted (non-expert) linear, first step, every microbatch;
- (MoE) routing: every router decision of every step must equal world-1's exactly, or the
  topology fails with where the routing diverged (comparisons after a flip are meaningless);
- loss: per-microbatch loss sums and token counts, and the reported lm loss, every step;
- grads: adapter grads after finalize, every step;
- grad_norm: the optimizer's grad norm, every step;
- deltas: adapter weights after K steps minus their initial values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Dict, List, Optional, Sequence

from megatron_lora_patch.oracle import canonical
from megatron_lora_patch.oracle.metrics import PhaseMetrics, compare_scalars, compare_tensors
from megatron_lora_patch.oracle.mutations import MUTATIONS, Mutation
from megatron_lora_patch.oracle.report import MutationResult, OracleReport, TopologyResult
from megatron_lora_patch.oracle.thresholds import THRESHOLDS
from megatron_lora_patch.patching import Patcher
from megatron_lora_patch.testing.driver import Capture, TrainSettings
from megatron_lora_patch.testing.launcher import WorldError
from megatron_lora_patch.testing.models import TinyGPTSpec
from megatron_lora_patch.testing.runner import Job, canonical_result, run_jobs
from megatron_lora_patch.testing.topology import Topology

#: The oracle's models: GQA (8 heads, 4 query groups: TP up to 4), SwiGLU, RoPE, RMSNorm;
#: 4 layers so PP up to 4 keeps whole layers per stage; the MoE variant has 4 experts, top-2.
DENSE = TinyGPTSpec(num_attention_heads=8, num_query_groups=4, num_layers=4)
MOE = TinyGPTSpec.moe(num_attention_heads=8, num_query_groups=4, num_layers=2)
REFERENCE = "tp1"


@dataclasses.dataclass(frozen=True)
class OracleSettings:
    steps: int = 2
    dtype: str = "fp32"  # fp32 | bf16
    seed: int = 1234
    model: str = "auto"  # dense | moe | auto (MoE for topologies with ep / etp)
    tp_invariant: bool = False
    lora_rank: int = 4
    lora_alpha: float = 8.0
    timeout_s: float = 600.0

    @property
    def thresholds(self) -> Dict[str, float]:
        if self.tp_invariant:  # bitwise identical or nothing
            return {phase: 0.0 for phase in THRESHOLDS[self.dtype]}
        return THRESHOLDS[self.dtype]


class OracleError(ValueError):
    """Bad oracle input (topology, model, mutation name); the message says what would be valid."""


def model_for(topology: Topology, settings: OracleSettings) -> TinyGPTSpec:
    expert_parallel = topology.ep > 1 or topology.etp > 1
    if settings.model == "dense" and expert_parallel:
        raise OracleError(f"topology {topology} shards experts but --model dense has none; use --model auto or moe")
    spec = MOE if settings.model == "moe" or (settings.model == "auto" and expert_parallel) else DENSE
    return spec.replace(dtype="bfloat16") if settings.dtype == "bf16" else spec


def check_topology(topology: Topology, settings: OracleSettings) -> TinyGPTSpec:
    """The model this topology runs, or one OracleError saying why it cannot run."""
    spec = model_for(topology, settings)
    if settings.tp_invariant and spec.is_moe:
        raise OracleError("--tp-invariant supports the dense model only; use --model dense or auto without ep/etp")
    if settings.tp_invariant and any(size > 1 for size in (topology.pp, topology.dp, topology.cp, topology.ep, topology.etp)):
        raise OracleError(
            f"--tp-invariant supports tensor parallelism (with or without sp) only; {topology} also uses "
            "pp/dp/cp/ep/etp: use topologies like tp2, tp2-sp, tp4"
        )
    topology.validate(num_experts=spec.num_experts, num_layers=spec.num_layers, seq_length=spec.seq_length)
    return spec


@contextlib.contextmanager
def oracle_job(settings: OracleSettings, mutation: Optional[Mutation]):
    """Entered in every rank around one run: the oracle's patches, LoRA config and mutation."""
    import torch

    import megatron_lora_patch
    from megatron_lora_patch.lora.config import LoraConfig, set_active

    enable = {
        "cpu_compat": not torch.cuda.is_available(),
        "lora_linear": True,
        "finalize_grads": True,
        "loss_normalization": True,
    }
    if settings.tp_invariant:
        enable["tp_invariant"] = True
    enable.update(mutation.patches if mutation else {})
    megatron_lora_patch.apply(plugins=["lora_correct"], enable=enable)
    lora = dict(rank=settings.lora_rank, alpha=settings.lora_alpha, b_init="nonzero", seed=settings.seed)
    lora.update(mutation.lora if mutation else {})
    set_active(LoraConfig(**lora))
    patcher = Patcher()
    try:
        if mutation is not None and mutation.install is not None:
            mutation.install(patcher)
        yield
    finally:
        patcher.revert()
        set_active(None)


def make_job(topology: Topology, settings: OracleSettings, mutation: Optional[Mutation] = None) -> Job:
    import functools

    spec = check_topology(topology, settings)
    train = TrainSettings(
        steps=settings.steps,
        seed=settings.seed,
    )
    train = dataclasses.replace(
        train,
        capture=Capture(
            forward=canonical.is_captured,
            on_step_end=functools.partial(_on_step_end, spec.seq_length, train.micro_batch_size),
        ),
    )
    if mutation is not None and mutation.settings:
        train = dataclasses.replace(train, **mutation.settings)
    context = functools.partial(oracle_job, settings, mutation)
    return Job(spec, topology, train, context=context)


def _on_step_end(seq_length: int, micro_batch_size: int, step: int, record: dict, chunks: list) -> None:
    """`Capture.on_step_end`: the rank's forward-capture layout, recorded once."""
    if step == 0:
        model = chunks[0]
        while hasattr(model, "module"):
            model = model.module
        record["extra"]["layout"] = canonical.rank_layout(model, seq_length, micro_batch_size)


def routing_maps(records: List[dict]) -> Dict[str, "object"]:
    """Every MoE routing decision of every step, in world-1 layout (empty for dense models)."""
    return {
        f"step{step}/{key}": routing
        for step in range(len(records[0]["steps"]))
        for key, routing in canonical.forward_outputs(records, step, canonical.ROUTING).items()
    }


def canonical_phases(records: List[dict], spec: TinyGPTSpec, shapes: Dict[str, tuple]) -> dict:
    """Everything one run is compared on, in world-1 layout, keyed per phase."""
    result = canonical_result(records, spec, shapes)
    phases = {"forward": canonical.forward_outputs(records), "loss": {}, "grads": {}, "grad_norm": {}}
    for step, entry in enumerate(result["steps"]):
        for index, microbatch in enumerate(entry["microbatches"]):
            for key, value in microbatch.items():
                phases["loss"][f"step{step}.mb{index}.{key}"] = value
        phases["loss"][f"step{step}.lm_loss"] = entry["lm_loss"]
        phases["grad_norm"][f"step{step}"] = entry["grad_norm"]
        for name, grad in entry["grads"].items():
            phases["grads"][f"step{step}/{name}"] = grad
    final = result["steps"][-1]["params"]
    phases["deltas"] = {name: final[name] - result["initial_params"][name] for name in final}
    return phases


def adapter_shapes(reference_records: List[dict]) -> Dict[str, tuple]:
    """Logical shapes of every captured parameter, read off the world-1 run (its tensors are whole)."""
    (record,) = reference_records
    return {record["shards"][name].logical_name: tuple(tensor.shape) for name, tensor in record["initial_params"].items()}


def compare(candidate: dict, reference: dict, thresholds: Dict[str, float]) -> Dict[str, PhaseMetrics]:
    metrics = {}
    for phase, expected in reference.items():
        if phase in ("loss", "grad_norm"):
            metrics[phase] = compare_scalars(candidate[phase], expected, thresholds[phase])
        else:
            metrics[phase] = compare_tensors(candidate[phase], expected, thresholds[phase])
    return metrics


def mutations_named(names: Sequence[str]) -> List[Mutation]:
    unknown = [name for name in names if name not in MUTATIONS]
    if unknown:
        raise OracleError(f"unknown mutation {unknown[0]!r}; known: {', '.join(MUTATIONS) or 'none'}")
    return [MUTATIONS[name] for name in names]


def run_oracle(
    topologies: Sequence[str], mutations: Sequence[Mutation] = (), settings: OracleSettings = OracleSettings()
) -> OracleReport:
    """Run the references, every topology and every mutation (each on the topology that
    exposes it); compare; return the report. A crashed or hung run is a FAIL row."""
    started = time.monotonic()
    if settings.tp_invariant and mutations:
        raise OracleError("--tp-invariant runs without mutations: they re-introduce bugs the invariant mode bypasses")
    runs = [(Topology.parse(spec), None) for spec in topologies]
    runs += [(Topology.parse(mutation.topology), mutation) for mutation in mutations]
    reference_topology = Topology.parse(REFERENCE)
    jobs, specs = [], []
    for topology, mutation in runs:
        run_settings = dataclasses.replace(settings, model=mutation.model) if mutation else settings
        jobs.append(make_job(topology, run_settings, mutation))
        specs.append(jobs[-1].spec)
    references = {spec: make_job(reference_topology, settings_for(spec, settings)) for spec in dict.fromkeys(specs)}
    outcomes = _run_isolated(list(references.values()) + jobs, settings.timeout_s)
    reference_phases, reference_routing, shapes = {}, {}, {}
    for spec, (records, error) in zip(references, outcomes):
        if error:
            raise RuntimeError(f"the world-1 reference run failed; nothing can be compared:\n{error}")
        shapes[spec] = adapter_shapes(records)
        reference_phases[spec] = canonical_phases(records, spec, shapes[spec])
        reference_routing[spec] = routing_maps(records)
    report = OracleReport(settings=_describe(settings))
    thresholds = settings.thresholds
    for (topology, mutation), job, (records, error) in zip(runs, jobs, outcomes[len(references):]):
        phases: Dict[str, PhaseMetrics] = {}
        routing = ""
        if error is None:
            try:
                candidate = canonical_phases(records, job.spec, shapes[job.spec])
                phases = compare(candidate, reference_phases[job.spec], thresholds)
                routing = canonical.routing_divergence(routing_maps(records), reference_routing[job.spec])
            except (ValueError, KeyError) as problem:  # a layout mismatch is a failure, never a pass
                error = f"comparison failed: {type(problem).__name__}: {problem}"
        if mutation is None:
            report.topologies.append(TopologyResult(str(topology), topology.world_size, phases, error, routing))
        else:
            report.mutations.append(MutationResult(mutation.name, str(topology), mutation.bug, phases, error, routing))
    report.wall_s = time.monotonic() - started
    return report


def settings_for(spec: TinyGPTSpec, settings: OracleSettings) -> OracleSettings:
    """The reference of a MoE spec runs the MoE model even when `settings.model` says auto."""
    return dataclasses.replace(settings, model="moe" if spec.is_moe else "dense")


def _run_isolated(jobs: List[Job], timeout: float) -> List[tuple]:
    """(records, None) or (None, error text) per job, in job order.

    Jobs of one world size share a set of processes (imports paid once); if that world
    fails, its jobs are re-run one by one so the failure is pinned on the right run and
    the others still count. `timeout` is per job.
    """
    outcomes: List[tuple] = [(None, "not run")] * len(jobs)
    by_world: Dict[int, List[int]] = {}
    for index, job in enumerate(jobs):
        by_world.setdefault(job.topology.world_size, []).append(index)
    for indices in by_world.values():
        try:
            group = run_jobs([jobs[i] for i in indices], timeout=timeout * len(indices))
            for index, records in zip(indices, group):
                outcomes[index] = (records, None)
            continue
        except WorldError as error:
            if len(indices) == 1:
                outcomes[indices[0]] = (None, str(error))
                continue
        for index in indices:
            try:
                outcomes[index] = (run_jobs([jobs[index]], timeout=timeout)[0], None)
            except WorldError as error:
                outcomes[index] = (None, str(error))
    return outcomes


def _describe(settings: OracleSettings) -> dict:
    return dataclasses.asdict(settings) | {
        "thresholds": settings.thresholds,
        "models": {"dense": str(DENSE), "moe": str(MOE)},
    }
