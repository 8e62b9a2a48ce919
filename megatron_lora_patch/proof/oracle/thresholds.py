"""Pass thresholds of the oracle, in one place, with the measurements behind them.

The metric is the relative L2 error `||x - ref|| / ||ref||` of each canonical tensor against
world-1 (absolute where a reference tensor is zero; a phase whose reference is all zero is an
error, and no phase passes at a relative error of 1 or more: an all-zero candidate is exactly 1).

Thresholds depend on the optimizer STEP a quantity belongs to, not on `--steps`, which makes
them valid for any step count: step 0 (forward outputs, first losses, first grads and grad
norm) is computed from identical weights, so only the order of floating-point sums differs
(TP partial sums, SP gathers, DP all-reduce, CP attention, pipeline boundaries). After step 0
Adam's update, close to lr * sign(g), turns that noise in near-zero grads into whole-step weight
differences, and the two runs drift apart: later steps get their own, looser threshold. Every
known bug is already large at step 0 (a missing TP SUM halves a gradient, an average divides it
by the domain size, mean-of-means reweights tokens, a wrong layout permutes rows), so the tight
step-0 gate sets every mutation's margin whatever `--steps` is.

Measured on the default topologies (seed 1234; worst over tp2, tp2-sp, dp2, pp2, cp2, ep2,
tp2-etp2-sp; worst tensor; one run per dtype, every step's grads and weights recorded, run
length K = 1, 2, 5, 10, 20 read off it: training is prefix-deterministic):

    fp32            step 0     later steps, max over steps 1..K-1        threshold
                               K=2      K=5      K=10     K=20           step 0 / later
    forward         1.5e-6     -        -        -        -              1e-5
    loss            1.1e-7     2.2e-7   1.6e-6   4.3e-6   8.7e-6         1e-5 / 1e-4
    grads           4.9e-6     5.4e-5   5.0e-4   5.0e-4   3.8e-3         1e-4 / 2e-2
    grad_norm       6.3e-7     9.8e-6   1.7e-4   1.7e-4   2.1e-3         1e-5 / 1e-2
    deltas (K=1)    6.7e-5     after K: 4.5e-5  4.9e-5   1.0e-4   2.1e-4  1e-3 / 2e-3

Later-step noise grows about tenfold per ten steps (tp2-etp2-sp grad norm: 1.7e-4 at K=10,
2.1e-3 at K=20), so no fixed threshold holds for unbounded K: `--steps` is capped at 20
(cli/oracle.py MAX_STEPS), where the worst noise is 4.9x below its threshold (6.5x for
K <= 10: forward). The 16 two-rank mutations, measured the same way, move step 0 by at
least 0.26 (grad norm) or 0.36 (grads): every one is caught by >= 1.1e4x at every K
(weakest: skip_expert_tp_sum, 1.13 / 1e-4 in step-0 grads).

bf16 (8 mantissa bits): step 0 differs by rounding of TP partial sums to bf16 (forward 3.7e-2
dense, 0.29 MoE tp2-etp2-sp; loss 8.4e-4; grads 5.7e-2; grad norm 7.6e-3), and the runs then
diverge chaotically: later-step grads reach 0.26 at step 1 and 7.4 by step 8, deltas 0.2 to
0.66, larger than several bugs (avg_instead_of_sum moves deltas by 0.19). No threshold below 1
separates those, so bf16 gates step 0 only (later steps, their routing, and deltas are not
compared; a step-0 routing flip is reported, not failed: `routing_must_match`) with thresholds
3.1x (forward) to 6x (loss) above that noise. The 16 two-rank mutations move bf16 step 0 by
0.25 to 61 and are caught by 3.4x (xavier_fan_in_local_shard: grads 0.68 / 0.2) to 1.9e3x:
bf16 is a check with a known-bug floor; the 100x margins are fp32's.
"""

from __future__ import annotations

from typing import Optional

PHASES = ("forward", "loss", "grads", "grad_norm", "deltas")
#: The preflight's bf16 rule (proof/oracle/bf16_rule.py, with its measurements): a bf16 topology's error against
#: fp32 may be this many times the one-rank bf16 run's own error.
BF16_TOPOLOGY_FACTOR = 5.0

#: dtype -> phase -> (threshold at step 0, threshold at later steps); None: not compared.
#: Forward outputs exist for step 0 only; deltas (weights after the last step minus the
#: initial ones) take "step 0" after one step and "later" after more.
THRESHOLDS: dict[str, dict[str, tuple[Optional[float], Optional[float]]]] = {
    "fp32": {
        "forward": (1e-5, None),
        "loss": (1e-5, 1e-4),
        "grads": (1e-4, 2e-2),
        "grad_norm": (1e-5, 1e-2),
        "deltas": (1e-3, 2e-3),
    },
    "bf16": {
        "forward": (0.9, None),
        "loss": (5e-3, None),
        "grads": (0.2, None),
        "grad_norm": (3e-2, None),
        "deltas": (None, None),
    },
}


def threshold(dtype: str, phase: str, step: int, layout_invariant: bool = False) -> Optional[float]:
    """The pass threshold of `phase` at optimizer step `step` (0-based), or None: not compared.

    `layout_invariant`: bitwise identity is claimed for every step, so 0 everywhere, bf16 included."""
    if layout_invariant:
        return 0.0
    first, later = THRESHOLDS[dtype][phase]
    return first if step == 0 else later


def routing_must_match(dtype: str, layout_invariant: bool = False) -> bool:
    """Whether a MoE routing decision that differs from world-1 fails the run.

    fp32 (and the bitwise mode): yes, comparisons after a flipped top-k choice are meaningless.
    bf16: rounding flips near-tie choices on correct code (measured: 3 tokens of 128 at step 0
    on tp2-etp2-sp), and the bf16 thresholds were measured with those flips in: reported only."""
    return layout_invariant or dtype != "bf16"


def describe(dtype: str, layout_invariant: bool = False) -> dict:
    """{phase: {"step 0": t, "later steps": t}} for the report (None: not compared)."""
    return {
        phase: {
            "step 0": threshold(dtype, phase, 0, layout_invariant),
            "later steps": threshold(dtype, phase, 1, layout_invariant),
        }
        for phase in PHASES
    }


def _check() -> None:
    for dtype, phases in THRESHOLDS.items():
        for phase, pair in phases.items():
            for value in pair:
                if value is not None and not 0 <= value < 1:
                    raise ValueError(
                        f"threshold {dtype}/{phase} = {value}: must be in [0, 1) (an all-zero tensor is 1.0)"
                    )


_check()
