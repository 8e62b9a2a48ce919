"""Pass thresholds of the oracle, in one place, with the reasoning.

The metric is the relative L2 error `||x - ref|| / ||ref||` of each canonical tensor
(absolute when the reference is zero); a phase passes when its worst tensor is below the
threshold. Why these numbers:

- fp32: a topology changes only the ORDER of floating-point sums (TP partial sums, SP
  gathers, DP all-reduce, CP attention, pipeline boundaries). For the tiny testbed models
  this moves forward outputs, losses and first-step grads by a few ulps: relative errors of
  1e-7 to 5e-6 (measured on the default set: forward <= 1.5e-6, losses <= 2.2e-7). Adam's
  first update is close to lr * sign(g), so a near-zero grad element moves by a whole step
  under a tiny difference: after one step the adapter deltas differ by up to 6.7e-5 (tp2),
  and later steps' grads and grad norm, computed on those weights, by up to 5.4e-5 and
  9.8e-6 (cp2). Hence thresholds about one decade above the measured worst: 1e-5 for
  forward and losses, 1e-4 for the grad norm, 1e-3 for grads and deltas. Every known bug
  moves some phase by 1e-2 or more (a missing TP SUM halves a gradient, an average divides
  it by the domain size, mean-of-means reweights tokens, a wrong layout permutes rows):
  the mutations are caught at 1.3e3 to 5e5 times these thresholds, never a close call.
- bf16: 8 mantissa bits (eps 7.8e-3). Measured on CPU at tp2 against world-1: forward outputs
  2e-2 to 4e-2 (growing with depth: per-layer means 0.007 to 0.018), losses 3e-3, grad norm 8e-3;
  adapter grads differ by about 0.1 per layer (0.26 worst tensor) because the TP partial sums are
  rounded to bf16 before they are summed, and Adam's sign-like first step carries that into the
  deltas (0.18). dp2 and pp2 agree to 1e-7. bf16 thresholds are therefore a noise band (about
  3x the measured worst), good for catching a broken run, not a proof: the mutation margins above
  are fp32 claims.
"""

from __future__ import annotations

PHASES = ("forward", "loss", "grads", "grad_norm", "deltas")

THRESHOLDS: dict[str, dict[str, float]] = {
    "fp32": {"forward": 1e-5, "loss": 1e-5, "grads": 1e-3, "grad_norm": 1e-4, "deltas": 1e-3},
    "bf16": {"forward": 1e-1, "loss": 1e-2, "grads": 1.0, "grad_norm": 3e-2, "deltas": 5e-1},
}


def threshold(dtype: str, phase: str) -> float:
    return THRESHOLDS[dtype][phase]
