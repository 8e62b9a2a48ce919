"""The preflight's report: the oracle's table with one row (the user's topology), what was run
(`preflight`), and where a mismatch drifts most (phase, layer, parameter)."""

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


def drift(phases: dict, kinds: Sequence[str]) -> Optional[dict]:
    """Where a mismatch is worst: the failing phase furthest over its threshold, and the layer and
    parameter that drift most (from the worst failing phase that names one)."""
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
        "layer": layer, "layer_kind": kinds[layer] if layer is not None and layer < len(kinds) else None,
        "parameter": metrics.worst_tensor, "rel_l2": metrics.rel_l2, "threshold": metrics.threshold,
    }


def _ratio_key(failing: dict, phase: str) -> tuple:
    ratio = failing[phase].ratio
    return (ratio != ratio, ratio)  # NaN first


def drift_line(found: dict) -> str:
    layer = "no layer" if found["layer"] is None else f"layer {found['layer']} ({found['layer_kind']})"
    return (
        f"drifts most: phase {found['phase']} ({found['over_threshold']:.3g}x its threshold); worst located tensor: "
        f"{layer}, {found['parameter']} in {found['located_in_phase']} (rel L2 {found['rel_l2']:.2e}, "
        f"threshold {found['threshold']:.0e})"
    )
