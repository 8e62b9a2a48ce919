"""The oracle harness: world-1 reference vs topologies, per phase (docs/architecture.md section 8).

Every run (reference, topology, mutation) is a `testbed.runner.Job`: the same seeded
tiny GPT, the same topology-invariant LoRA adapters (non-zero B, so grads reach A) and
the same global batch, trained K steps through Megatron DDP, finalize and Adam with
clipping, with the `lora_correct` patches applied in every rank. Captures are
canonicalized to the world-1 layout and compared per phase:

- forward: outputs of every adapted (non-expert) linear, first step, every microbatch;
- (MoE) routing: every router decision of every compared step must equal world-1's exactly, or
  the topology fails with where the routing diverged (comparisons after a flip are meaningless);
- loss: per-microbatch loss sums and token counts, and the reported lm loss, every step;
- grads: adapter grads after finalize, every step;
- grad_norm: the optimizer's grad norm, every step;
- deltas: adapter weights after K steps minus their initial values.

Each quantity is judged against the threshold of its optimizer step (proof/oracle/thresholds.py:
step 0 tight, later steps looser; bf16 compares step 0 only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Dict, List, Optional, Sequence

from megatron_lora_patch.proof.oracle import canonical
from megatron_lora_patch.proof.oracle import thresholds as limits
from megatron_lora_patch.proof.oracle.mutations import MUTATIONS, Mutation
from megatron_lora_patch.proof.oracle.phases import STEP_KEY, adapter_shapes, canonical_phases, compare, routing_maps
from megatron_lora_patch.proof.oracle.report import MutationResult, OracleReport, TopologyResult
from megatron_lora_patch.proof.oracle.settings import (  # noqa: F401  (harness.<name> stays valid for callers)
    DATA_LAYOUTS,
    DEEPSEEK,
    DENSE,
    HYBRID,
    MLA,
    MODELS,
    MOE,
    PACKED,
    REFERENCE,
    OracleError,
    OracleSettings,
    check_topology,
    describe_model,
    model_for,
    model_name,
    settings_for,
)
from megatron_lora_patch.proof.testbed.launcher import WorldError
from megatron_lora_patch.proof.testbed.packing import cu_seqlens_of
from megatron_lora_patch.proof.testbed.runner import Job, run_jobs
from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings
from megatron_lora_patch.proof.testbed.topology import Topology
from megatron_lora_patch.runtime.patching import Patcher


def declared_defaults() -> dict:
    """Each production patch on or off as its declaration says (`PatchSpec.default`): what a user's
    `MEGATRON_PLUGINS=lora_correct` run gets, set explicitly so the environment cannot change the oracle."""
    from megatron_lora_patch.plugins import lora_correct

    return {module.SPEC.name: module.SPEC.default for module in lora_correct.PATCHES}


@contextlib.contextmanager
def oracle_job(settings: OracleSettings, mutation: Optional[Mutation]):
    """Entered in every rank around one run: the oracle's patches, LoRA config and mutation."""
    import torch

    import megatron_lora_patch
    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.proof.testbed.patches import TESTBED_PLUGINS

    enable = declared_defaults()
    enable["cpu_compat"] = not torch.cuda.is_available()
    enable["layout_invariant"] = settings.layout_invariant
    enable.update(mutation.patches if mutation else {})
    megatron_lora_patch.apply(plugins=TESTBED_PLUGINS, enable=enable)
    lora = dict(rank=settings.lora_rank, alpha=settings.lora_alpha, b_init="nonzero", seed=settings.seed)
    lora.update(dict(settings.lora_options))
    lora.update(mutation.lora if mutation else {})
    with mutation_installed(LoraConfig(**lora), mutation):
        yield


@contextlib.contextmanager
def mutation_installed(lora, mutation: Optional[Mutation]):
    """`lora` active and `mutation`'s changes installed for the block (a run in one rank); both undone after."""
    from megatron_lora_patch.lora.config import set_active

    set_active(lora)
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
    train = TrainSettings(steps=settings.steps, seed=settings.seed, global_batch_size=settings.global_batch_size)
    train = dataclasses.replace(
        train,
        capture=Capture(
            forward=canonical.is_captured,
            on_step_end=functools.partial(_on_step_end, spec, train.micro_batch_size),
        ),
    )
    if mutation is not None and mutation.settings:
        train = dataclasses.replace(train, **mutation.settings)
    context = functools.partial(oracle_job, settings, mutation)
    return Job(spec, topology, train, context=context)


def _on_step_end(spec: Any, micro_batch_size: int, step: int, record: dict, chunks: list) -> None:
    """`Capture.on_step_end`: the routers' expert biases after every step, and the rank's forward-capture
    layout, recorded once (packed rows: every row is
    split the same way, `testbed.packing`). `spec`: a `TinyGPTSpec`, or the preflight's model of the user's
    arguments (never packed)."""
    model = chunks[0]
    while hasattr(model, "module"):
        model = model.module
    record["extra"]["expert_bias"] = canonical.expert_biases(model)
    if step == 0:
        cu_seqlens = cu_seqlens_of(spec.seq_length).unsqueeze(0) if getattr(spec, "packed", False) else None
        record["extra"]["layout"] = canonical.rank_layout(model, spec.seq_length, micro_batch_size, cu_seqlens)


def mutations_named(names: Sequence[str]) -> List[Mutation]:
    unknown = [name for name in names if name not in MUTATIONS]
    if unknown:
        raise OracleError(f"unknown mutation {unknown[0]!r}; known: {', '.join(MUTATIONS) or 'none'}")
    return [MUTATIONS[name] for name in names]


def run_oracle(
    topologies: Sequence[str],
    mutations: Sequence[Mutation] = (),
    settings: OracleSettings = OracleSettings(),
    *,
    rank_warnings: str = "ignore",
) -> OracleReport:
    """Run the world-1 references, then every topology and every mutation (each on the topology
    that exposes it); compare; return the report. A crashed or hung run is a FAIL row (an
    ERRORED mutation); a failed reference stops there: the report says so and compares nothing.
    `rank_warnings`: the ranks' warnings filter ("default" shows Megatron's and torch's)."""
    started = time.monotonic()
    if settings.layout_invariant and mutations:
        raise OracleError(
            "--layout-invariant runs without mutations: they re-introduce bugs the invariant mode bypasses"
        )
    runs = [(Topology.parse(spec), None) for spec in topologies]
    runs += [(Topology.parse(mutation.topology), mutation) for mutation in mutations]
    run_settings = [mutation_settings(settings, m) for _, m in runs]
    jobs = [make_job(topology, s, m) for (topology, m), s in zip(runs, run_settings)]
    report = OracleReport(settings=_describe(settings))
    references = {  # one world-1 reference per model and LoRA options
        _reference_key(job, s): make_job(Topology.parse(REFERENCE), settings_for(job.spec, s))
        for job, s in zip(jobs, run_settings)
    }
    outcomes = _run_isolated(list(references.values()), settings.timeout_s, rank_warnings)
    expected = {}
    for key, (records, error) in zip(references, outcomes):
        spec = key[0]
        if error:
            report.reference_error = f"the world-1 reference run of the {model_name(spec)} model failed:\n{error}"
            report.wall_s = time.monotonic() - started
            return report
        shapes = adapter_shapes(records)
        expected[key] = (shapes, canonical_phases(records, spec, shapes), routing_maps(records))
    outcomes = _run_isolated(jobs, settings.timeout_s, rank_warnings)
    for (topology, mutation), job, s, (records, error) in zip(runs, jobs, run_settings, outcomes):
        phases, routing, error = _judge(job, records, error, expected[_reference_key(job, s)], settings)
        routing, note = routing_verdict(routing, settings.dtype, settings.layout_invariant)
        if mutation is None:
            wall_s = max((record.get("wall_s", 0.0) for record in records or ()), default=0.0)
            report.topologies.append(
                TopologyResult(
                    str(topology), topology.world_size, phases, error, routing, wall_s, model_name(job.spec), note
                )
            )
        else:
            report.mutations.append(
                MutationResult(mutation.name, str(topology), mutation.bug, phases, error, routing, note)
            )
    report.wall_s = time.monotonic() - started
    return report


def routing_verdict(routing: str, dtype: str, layout_invariant: bool = False) -> tuple:
    """(routing divergence that fails the run, note shown instead): bf16 rounding flips near-tie MoE routing
    choices on correct code, so there a divergence is reported, not failed (thresholds.routing_must_match)."""
    if routing and not limits.routing_must_match(dtype, layout_invariant):
        where = routing.split(": ", 1)[-1]
        return "", f"bf16 rounding flipped near-tie MoE routing choices (reported, not failed): {where}"
    return routing, ""


def _judge(job: Job, records, error: Optional[str], expected: tuple, settings: OracleSettings) -> tuple:
    """(phases, routing divergence, error) of one run against its reference."""
    if error is not None:
        return {}, "", error
    shapes, reference_phases, reference_routing = expected
    try:
        phases = compare(canonical_phases(records, job.spec, shapes), reference_phases, settings)
        routing = canonical.routing_divergence(
            _compared_steps(routing_maps(records), settings), _compared_steps(reference_routing, settings)
        )
        return phases, routing, None
    except (ValueError, KeyError) as problem:  # a layout mismatch is a failure, never a pass
        return {}, "", f"comparison failed: {type(problem).__name__}: {problem}"


def _compared_steps(routing: dict, settings: OracleSettings) -> dict:
    """The routing decisions of the steps whose grads are compared (bf16: step 0 only)."""
    return {
        key: value
        for key, value in routing.items()
        if settings.threshold("grads", int(STEP_KEY.match(key).group(1))) is not None
    }


def mutation_settings(settings: OracleSettings, mutation: Optional[Mutation]) -> OracleSettings:
    """What a mutation runs (and is referenced) under: its model and data layout (if it names one), plus the
    LoRA options its bug needs."""
    if mutation is None:
        return settings
    options = settings.lora_options + tuple(mutation.options.items())
    data = mutation.data or settings.data
    return dataclasses.replace(settings, model=mutation.model, lora_options=options, data=data)


def _reference_key(job: Job, settings: OracleSettings) -> tuple:
    """Runs of one model and LoRA options share a world-1 reference (options may hold dicts: keyed by repr)."""
    return job.spec, repr(settings.lora_options)


def _run_isolated(jobs: List[Job], timeout: float, warnings: str = "ignore") -> List[tuple]:
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
            group = run_jobs([jobs[i] for i in indices], timeout=timeout * len(indices), warnings=warnings)
            for index, records in zip(indices, group):
                outcomes[index] = (records, None)
            continue
        except WorldError as error:
            if len(indices) == 1:
                outcomes[indices[0]] = (None, str(error))
                continue
        for index in indices:
            try:
                outcomes[index] = (run_jobs([jobs[index]], timeout=timeout, warnings=warnings)[0], None)
            except WorldError as error:
                outcomes[index] = (None, str(error))
    return outcomes


def _describe(settings: OracleSettings) -> dict:
    return dataclasses.asdict(settings) | {
        "thresholds": settings.thresholds,
        "models": {"dense": str(DENSE), "moe": str(MOE)},
        "model_summaries": {spec.family: describe_model(spec) for spec in MODELS.values()},
    }
