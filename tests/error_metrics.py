"""The tests' error metrics (one helper per metric, named after it) and the fp32 tolerance they share.

* ``relative_l2_error``: ``||actual - expected|| / ||expected||`` (the oracle's metric, float64).
* ``max_abs_error_over_max``: ``max|actual - expected| / max|expected|`` (scale-free max-abs).
* ``fp32_sum_tolerance(n)``: what an fp32 result built from ``n``-term reductions may differ by
  (relative L2) when the reductions run in another order (another CPU, BLAS kernel, thread
  count or TP split): rounding errors of a reordered sum behave like a random walk, so the
  relative error is about ``eps * sqrt(n)``; ``FP32_SAFETY`` covers unlucky orders and kernels.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from megatron_lora_patch.proof.oracle.metrics import compare_results, compare_tensors
from megatron_lora_patch.proof.oracle.metrics import relative_error as relative_l2_error

__all__ = [
    "FP32_EPS",
    "assert_all_within",
    "assert_errors_within",
    "assert_steps_within",
    "first_step",
    "fp32_sum_tolerance",
    "max_abs_error_over_max",
    "relative_l2_error",
]

FP32_EPS = torch.finfo(torch.float32).eps
# Measured: test_finalize_grads' worst factor is 2.5e-7 relative L2 (tolerance 10*eps*sqrt(384) = 2.3e-5,
# 93x margin) over MKL SSE4.2/AVX2/AVX-512/CBWR=COMPATIBLE kernels, ATen default/avx2 and 1 or 2 threads.
FP32_SAFETY = 10.0


def fp32_sum_tolerance(num_terms: int) -> float:
    """Relative-L2 tolerance for fp32 results whose longest reduction chain sums `num_terms` terms."""
    if num_terms < 1:
        raise ValueError(f"num_terms must be >= 1, got {num_terms}")
    return FP32_SAFETY * FP32_EPS * math.sqrt(num_terms)


def max_abs_error_over_max(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|actual - expected| / max|expected| in float64 (absolute when expected is all zero)."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    assert expected.numel(), "nothing to compare: empty reference tensor"
    difference = (actual.detach().double() - expected.detach().double()).abs().max().item()
    scale = expected.detach().double().abs().max().item()
    return difference / scale if scale > 0 else difference


def assert_all_within(
    actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], tolerance: float
) -> dict:
    """Same non-empty name sets, every tensor within `tolerance` relative L2 (NaN fails); returns the errors."""
    metrics = compare_tensors(actual, expected, tolerance)  # raises on missing/extra names or nothing to compare
    assert metrics.passed, f"{metrics.worst_tensor}: relative L2 {metrics.rel_l2:.3e} > {tolerance:.3e}"
    return {name: relative_l2_error(actual[name], expected[name]) for name in expected}


def assert_errors_within(
    errors: Mapping[str, float], expected_keys: Iterable[str], tolerance: float, where: str = ""
) -> None:
    """`errors` has exactly `expected_keys` (an empty or partial capture never passes), each <= tolerance."""
    expected_keys = set(expected_keys)
    assert expected_keys, "nothing expected: the check would pass vacuously"
    assert set(errors) == expected_keys, f"{where}: errors for {sorted(errors)}, expected {sorted(expected_keys)}"
    bad = {key: value for key, value in errors.items() if not value <= tolerance}  # NaN fails
    assert not bad, f"{where}: errors above {tolerance}: {bad}"


def first_step(result: dict) -> dict:
    """A canonical training result (`proof.testbed.runner.canonical_result`) cut to its first optimizer step."""
    return {**result, "steps": result["steps"][:1]}


def assert_steps_within(result: dict, reference: dict, first_bound: float, later_bound: float, where: str = "") -> dict:
    """Every phase of step 0 within `first_bound` and of every step within `later_bound` (relative L2, worst
    tensor): before the first update only the order of sums differs, after it Adam amplifies that noise, so one
    step-0 bound on later steps fails on another CPU (docs/testing.md "Tolerances"). Returns both error maps."""
    first = compare_results(first_step(result), first_step(reference))
    every = compare_results(result, reference)
    print(f"{where} first step {_rounded(first)}; all steps {_rounded(every)}")
    failing = {phase: error for phase, error in first.items() if not error <= first_bound}
    assert not failing, f"{where} first step: relative errors above {first_bound}: {failing} (all: {first})"
    failing = {phase: error for phase, error in every.items() if not error <= later_bound}
    assert not failing, f"{where} later steps: relative errors above {later_bound}: {failing} (all: {every})"
    return {"first": first, "all": every}


def _rounded(errors: Mapping[str, float]) -> dict:
    return {phase: float(f"{error:.2e}") for phase, error in errors.items()}
