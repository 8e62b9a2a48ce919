"""The phases a run is compared on (docs/architecture.md section 8): its captures put in world-1 layout
and keyed per phase (forward, loss, grads, grad_norm, deltas with the routers' expert bias after each step;
MoE routing apart), and the per-phase
comparison against the reference, each key judged at the threshold of its optimizer step."""

from __future__ import annotations

import re
from typing import Dict, List

from megatron_lora_patch.proof.oracle import canonical
from megatron_lora_patch.proof.oracle.metrics import PhaseMetrics, compare_scalars, compare_tensors
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.proof.testbed.runner import canonical_result

STEP_KEY = re.compile(r"^step(\d+)")


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
    # DeepSeek's expert bias, a base buffer that starts at zero and moves every step: its value after each step
    # is its delta so far, judged with the deltas (it must not depend on the layout)
    phases["deltas"].update(canonical.agreed_expert_biases(records))
    return phases


def adapter_shapes(reference_records: List[dict]) -> Dict[str, tuple]:
    """Logical shapes of every captured parameter, read off the world-1 run (its tensors are whole)."""
    (record,) = reference_records
    return {
        record["shards"][name].logical_name: tuple(tensor.shape) for name, tensor in record["initial_params"].items()
    }


def compare(candidate: dict, reference: dict, settings) -> Dict[str, PhaseMetrics]:
    """Per phase, the metrics of its worst optimizer step (largest error over that step's threshold);
    `settings` is the run's `OracleSettings` (its `steps` and per-phase `threshold`).

    Each key belongs to a step (`step<j>...`; forward outputs: step 0; deltas: the last step) and
    is judged against that step's threshold; steps whose threshold is None are not compared, and
    a phase with no compared step is left out. A key missing on either side is an error."""
    metrics = {}
    for phase, expected in reference.items():
        if set(candidate[phase]) != set(expected):
            raise ValueError(
                f"{phase}: tensor sets differ from the reference: "
                f"missing {sorted(set(expected) - set(candidate[phase]))}, "
                f"extra {sorted(set(candidate[phase]) - set(expected))}"
            )
        measure = measure_for(phase)
        judged = [
            measure({key: candidate[phase][key] for key in keys}, {key: expected[key] for key in keys}, limit)
            for step, keys in sorted(keys_by_step(phase, expected, settings.steps).items())
            if (limit := settings.threshold(phase, step)) is not None
        ]
        if judged:
            metrics[phase] = max(judged, key=lambda m: (m.ratio != m.ratio, m.ratio))  # NaN first
    return metrics


def keys_by_step(phase: str, keys, steps: int) -> Dict[int, list]:
    """A phase's keys grouped by the optimizer step each belongs to (`step<j>...`; forward outputs: step 0;
    deltas: the last step)."""
    by_step: Dict[int, list] = {}
    for key in keys:
        match = STEP_KEY.match(key)
        step = steps - 1 if phase == "deltas" else int(match.group(1)) if match else 0
        by_step.setdefault(step, []).append(key)
    return by_step


def measure_for(phase: str):
    """How a phase's values are compared: scalars (losses, grad norms) or tensors."""
    return compare_scalars if phase in ("loss", "grad_norm") else compare_tensors
