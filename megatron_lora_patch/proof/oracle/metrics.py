"""Comparison metrics: per tensor relative L2 and max-abs, per phase worst and per-layer mean."""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, Mapping, Optional

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")
#: Where a module's output is computed in a layer's forward, earliest first (drift is located there first).
FORWARD_ORDER = ("linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64 (absolute when expected is zero)."""
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} vs reference {tuple(expected.shape)}")
    difference = torch.linalg.vector_norm((actual.double() - expected.double()).flatten())
    scale = torch.linalg.vector_norm(expected.double().flatten())
    return float(difference / scale) if scale > 0 else float(difference)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max()) if expected.numel() else 0.0


@dataclasses.dataclass(frozen=True)
class PhaseMetrics:
    """One phase of one topology against the reference."""

    rel_l2: float  # worst tensor
    max_abs: float  # worst tensor
    worst_tensor: str
    per_layer: Mapping[str, float]  # mean relative L2 of the tensors of each transformer layer ("other": the rest)
    threshold: float
    first_over: str = ""  # the first tensor in forward order over the threshold ("" when none is)

    @property
    def passed(self) -> bool:
        # NaN fails; so does an error of 100% or more whatever the threshold (an all-zero
        # candidate against a non-zero reference is exactly 1.0); the bitwise gate asks max |difference| == 0
        if self.threshold == 0:
            return self.rel_l2 == 0 and self.max_abs == 0
        return self.rel_l2 <= self.threshold and self.rel_l2 < 1.0

    @property
    def ratio(self) -> float:
        if self.threshold == 0:  # the bitwise (layout-invariant) gate
            return 0.0 if self.rel_l2 == 0 else float("inf")
        return self.rel_l2 / self.threshold

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"passed": self.passed}


def compare_tensors(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], threshold: float
) -> PhaseMetrics:
    """Metrics over the same-named tensors; a missing or extra name is an error, never a pass."""
    if set(actual) != set(expected):
        raise ValueError(
            f"tensor sets differ from the reference: missing {sorted(set(expected) - set(actual))}, "
            f"extra {sorted(set(actual) - set(expected))}"
        )
    if not expected:
        raise ValueError("nothing to compare: the reference captured no tensor for this phase")
    if not any(bool(tensor.any()) for tensor in expected.values()):
        raise ValueError(
            f"nothing to compare: every reference tensor is zero ({len(expected)} tensors, e.g. {next(iter(expected))})"
        )
    errors = {name: relative_error(actual[name], expected[name]) for name in expected}
    worst = max(errors, key=lambda name: (errors[name] != errors[name], errors[name]))  # NaN first
    layers: dict[str, list[float]] = {}
    for name, error in errors.items():
        match = _LAYER.search(name)
        layers.setdefault(match.group(1) if match else "other", []).append(error)
    over = [name for name, error in errors.items() if not error <= threshold or (threshold == 0 and error != 0)]
    return PhaseMetrics(
        rel_l2=errors[worst],
        max_abs=max(max_abs_error(actual[name], expected[name]) for name in expected),
        worst_tensor=worst,
        per_layer={layer: sum(values) / len(values) for layer, values in sorted(layers.items())},
        threshold=threshold,
        first_over=min(over, key=forward_position) if over else "",
    )


def forward_position(name: str) -> tuple:
    """Sort key of a tensor name in forward order: its layer, then its module's place in the layer
    (FORWARD_ORDER), then the name; tensors outside any layer come last."""
    match = _LAYER.search(name)
    layer = int(match.group(1)) if match else float("inf")
    place = next((index for index, kind in enumerate(FORWARD_ORDER) if kind in name), len(FORWARD_ORDER))
    return (layer, place, name)


def compare_scalars(actual: Mapping[str, float], expected: Mapping[str, float], threshold: float) -> PhaseMetrics:
    """Scalars (losses, grad norms: Python floats) compared as float64, so no last bit is rounded away."""
    return compare_tensors(
        {k: torch.tensor(float(v), dtype=torch.float64) for k, v in actual.items()},
        {k: torch.tensor(float(v), dtype=torch.float64) for k, v in expected.items()},
        threshold,
    )


def worst_ratio(phases: Mapping[str, Optional[PhaseMetrics]]) -> float:
    ratios = [metrics.ratio for metrics in phases.values() if metrics is not None]
    return max(ratios, key=lambda r: (r != r, r)) if ratios else float("nan")


def compare_results(result: dict, reference: dict) -> Dict[str, float]:
    """Worst relative error per phase between two canonical results (`testbed.runner.canonical_result`).

    Phases: 'loss' (per-microbatch values), 'lm_loss', 'grad_norm', 'grads', 'params'.
    Raises if the two do not hold the same tensors (a layout bug must not pass silently).
    """
    worst = {"loss": 0.0, "lm_loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0}
    if len(result["steps"]) != len(reference["steps"]):
        raise ValueError(f"{len(result['steps'])} steps vs {len(reference['steps'])} in the reference")
    for got, want in zip(result["steps"], reference["steps"]):
        if [sorted(m) for m in got["microbatches"]] != [sorted(m) for m in want["microbatches"]]:
            raise ValueError("microbatch losses differ in count or kind from the reference")
        for got_mb, want_mb in zip(got["microbatches"], want["microbatches"]):
            for key in want_mb:
                worst["loss"] = max(
                    worst["loss"], relative_error(torch.tensor(got_mb[key]), torch.tensor(want_mb[key]))
                )
        for key in ("lm_loss", "grad_norm"):
            worst[key] = max(worst[key], relative_error(torch.tensor(got[key]), torch.tensor(want[key])))
        for phase in ("grads", "params"):
            if set(got[phase]) != set(want[phase]):
                raise ValueError(f"{phase}: parameter sets differ: {sorted(set(got[phase]) ^ set(want[phase]))}")
            for name, tensor in want[phase].items():
                worst[phase] = max(worst[phase], relative_error(got[phase][name], tensor))
    return worst
