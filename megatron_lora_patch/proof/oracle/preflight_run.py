"""Running a preflight plan (docs/fail-closed.md, "preflight"; the plan is made by `preflight.make_plan`):
the world-size-1 reference and the user's topology as worlds on the plan's device (CPU + gloo, or one GPU per
rank + NCCL) with the user's patches (and a mutation where asked), compared like the oracle (bf16: against an
fp32 reference within the one-rank bf16 run's own error, proof/oracle/bf16_rule.py), into a `PreflightReport`
that says where a mismatch starts and where it drifts most."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

from megatron_lora_patch.proof.oracle.preflight import Plan
from megatron_lora_patch.proof.oracle.preflight_report import PreflightReport, drift


def run_plan(plan: Plan):
    """Reference and topology runs, compared like the oracle; an `OracleReport` with one row and `preflight` details."""
    from megatron_lora_patch.proof.oracle.harness import routing_verdict
    from megatron_lora_patch.proof.oracle.report import TopologyResult
    from megatron_lora_patch.proof.testbed.topology import Topology

    started = time.monotonic()
    name = str(plan.topology) + (f" +{plan.mutation.name}" if plan.mutation else "")
    model = plan.spec.family
    report = PreflightReport(
        settings={
            "thresholds": plan.limits.thresholds,
            "dtype": plan.spec.dtype,
            "steps": plan.steps,
            "seed": plan.spec.args.seed,
            "model_summaries": {model: "your model (above)"},
        },
        preflight=plan.describe(),
    )
    records = truth = None
    with _visible_devices(plan.device):
        reference, error = _run(plan, Topology(), None)
        if error is None and plan.spec.dtype == "bf16":  # the bf16 rule's truth (proof/oracle/bf16_rule.py)
            truth, error = _run(dataclasses.replace(plan, spec=plan.spec.in_fp32()), Topology(), None)
        if error:
            error = f"the world-1 reference run failed; nothing was compared:\n{error}"
        else:
            records, error = _run(plan, plan.topology, plan.mutation)
    phases, routing = {}, ""
    if error is None:
        phases, routing, error, limits = _compare(plan, records, reference, truth)
        report.settings["thresholds"] = limits.thresholds
        if truth is not None:
            report.settings["bf16_noise"] = {f"{phase} step {n}": value for (phase, n), value in limits.noise.items()}
    wall_s = max((record.get("wall_s", 0.0) for record in records or ()), default=0.0) if error is None else 0.0
    routing, note = routing_verdict(routing, plan.spec.dtype)
    report.topologies.append(
        TopologyResult(name, plan.topology.world_size, phases, error, routing, wall_s, model, note)
    )
    report.drift = drift(phases, plan.spec.kinds)
    report.wall_s = time.monotonic() - started
    return report


def _run(plan: Plan, topology, mutation):
    """(rank records, None) or (None, the world's error text)."""
    from megatron_lora_patch.proof.oracle import canonical
    from megatron_lora_patch.proof.oracle.harness import _on_step_end
    from megatron_lora_patch.proof.testbed.launcher import WorldError
    from megatron_lora_patch.proof.testbed.runner import Job, run_jobs
    from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings

    micro_batch_size = plan.spec.args.micro_batch_size
    capture = Capture(
        forward=canonical.is_captured,
        on_step_end=functools.partial(_on_step_end, plan.spec, micro_batch_size),
    )
    settings = TrainSettings(
        steps=plan.steps,
        seed=plan.spec.args.seed,
        micro_batch_size=micro_batch_size,
        global_batch_size=micro_batch_size * plan.topology.dp * plan.micro_batches,
        capture=capture,
        data_path=plan.data_path,
        device=plan.device,
        # The world-1 reference keeps the plain optimizer: an independent check of the distributed one.
        use_distributed_optimizer=bool(plan.spec.args.use_distributed_optimizer) and topology.world_size > 1,
    )
    if mutation is not None and mutation.settings:
        settings = dataclasses.replace(settings, **mutation.settings)
    job = Job(
        plan.spec, topology, settings, context=functools.partial(preflight_job, plan.lora, plan.patches, mutation)
    )
    try:
        return run_jobs([job], timeout=plan.timeout_s, warnings=plan.rank_warnings)[0], None
    except WorldError as error:
        return None, str(error)


def _compare(plan: Plan, records, reference, truth=None):
    """(phases, routing divergence, error text or None, the limits judged by): against the world-1 reference, or
    for bf16 against the fp32 `truth` within the one-rank bf16 run's own error (proof/oracle/bf16_rule.py)."""
    from megatron_lora_patch.proof.oracle import canonical
    from megatron_lora_patch.proof.oracle.bf16_rule import relative_limits
    from megatron_lora_patch.proof.oracle.phases import adapter_shapes, canonical_phases, compare, routing_maps

    limits = plan.limits
    try:
        shapes = adapter_shapes(reference)
        expected = canonical_phases(reference if truth is None else truth, plan.spec, shapes)
        if truth is not None:
            limits = relative_limits(canonical_phases(reference, plan.spec, shapes), expected, plan.steps)
        phases = compare(canonical_phases(records, plan.spec, shapes), expected, limits)
        return phases, canonical.routing_divergence(routing_maps(records), routing_maps(reference)), None, limits
    except (ValueError, KeyError) as problem:  # a layout mismatch is a failure, never a pass
        return {}, "", f"comparison failed: {type(problem).__name__}: {problem}", limits


@contextlib.contextmanager
def preflight_job(lora, patches: dict, mutation):
    """Entered in every rank around a run: the patches as the user's environment resolves them
    (cpu_compat on CPU), the user's LoRA settings, and the mutation if one was asked for."""
    import torch

    import megatron_lora_patch
    from megatron_lora_patch.proof.oracle.harness import mutation_installed
    from megatron_lora_patch.proof.testbed.patches import TESTBED_PLUGINS

    enable = {**patches, "cpu_compat": not torch.cuda.is_available(), **(mutation.patches if mutation else {})}
    megatron_lora_patch.apply(plugins=TESTBED_PLUGINS, enable=enable)
    with mutation_installed(dataclasses.replace(lora, **(mutation.lora if mutation else {})), mutation):
        yield


@contextlib.contextmanager
def _visible_devices(device: str):
    """On "cpu" the ranks run with gloo also on a machine with GPUs (CUDA hidden from them); "cuda" leaves the
    GPUs visible: one per rank, NCCL."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
