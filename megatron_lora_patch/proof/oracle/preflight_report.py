"""The preflight's report: the oracle's table with one row (the user's topology), what was run
(`preflight`), and where a mismatch starts (the first layer in forward order over its threshold:
usually the bug) and where it drifts most (errors grow downstream of it)."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional, Sequence

from megatron_lora_patch.proof.oracle.report import OracleReport

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclasses.dataclass
class PreflightReport(OracleReport):
    """The oracle's report with one row (the user's topology), what was run, and where it drifts."""

    preflight: dict = dataclasses.field(default_factory=dict)
    drift: Optional[dict] = None

    def table(self) -> str:
        lines = super().table().splitlines()
        if self.drift:
            lines.insert(-1, drift_line(self.drift))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return super().as_dict() | {"preflight": self.preflight, "drift": self.drift}


#: Phases in the order a training step produces them: the first failing one is where drift starts.
PHASE_ORDER = ("forward", "loss", "grads", "grad_norm", "deltas")


def drift(phases: dict, kinds: Sequence[str]) -> Optional[dict]:
    """Where a mismatch starts and where it is worst: the first layer in forward order over its
    threshold (in the earliest failing phase that names a layer), then the failing phase furthest over
    its threshold and the layer and parameter that drift most (from the worst failing phase naming one)."""
    failing = {phase: metrics for phase, metrics in phases.items() if not metrics.passed}
    if not failing:
        return None
    order = functools.partial(_ratio_key, failing)
    phase = max(failing, key=order)
    located = [name for name in failing if _LAYER.search(failing[name].worst_tensor)]
    where = max(located, key=order) if located else phase
    metrics = failing[where]
    match = _LAYER.search(metrics.worst_tensor)
    layer = int(match.group(1)) if match else None
    return {
        "phase": phase, "over_threshold": failing[phase].ratio, "located_in_phase": where,
        "layer": layer, "layer_kind": _kind(kinds, layer),
        "parameter": metrics.worst_tensor, "rel_l2": metrics.rel_l2, "threshold": metrics.threshold,
        "first": _first(failing, kinds),
    }


def _first(failing: dict, kinds: Sequence[str]) -> Optional[dict]:
    """The first tensor over its threshold in forward order, in the earliest failing phase naming a layer."""
    for phase in sorted(failing, key=lambda name: PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER)):
        match = _LAYER.search(failing[phase].first_over)
        if match:
            layer = int(match.group(1))
            return {"phase": phase, "layer": layer, "layer_kind": _kind(kinds, layer),
                    "parameter": failing[phase].first_over}
    return None


def _kind(kinds: Sequence[str], layer: Optional[int]) -> Optional[str]:
    return kinds[layer] if layer is not None and layer < len(kinds) else None


def _ratio_key(failing: dict, phase: str) -> tuple:
    ratio = failing[phase].ratio
    return (ratio != ratio, ratio)  # NaN first


def drift_line(found: dict) -> str:
    layer = "no layer" if found["layer"] is None else f"layer {found['layer']} ({found['layer_kind']})"
    first = found.get("first")
    starts = (
        f"starts at: layer {first['layer']} ({first['layer_kind']}), {first['parameter']} in {first['phase']}; "
        if first else ""
    )
    return starts + (
        f"drifts most: phase {found['phase']} ({found['over_threshold']:.3g}x its threshold); worst located tensor: "
        f"{layer}, {found['parameter']} in {found['located_in_phase']} (rel L2 {found['rel_l2']:.2e}, "
        f"threshold {found['threshold']:.0e})"
    )
