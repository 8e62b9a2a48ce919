"""The preflight's bf16 rule (docs/preflight.md, "bf16"): a bf16 topology is judged by its distance from an fp32
reference, relative to the one-rank bf16 run's own distance from it.

A fixed bf16 tolerance is wrong for a user's model: bf16's rounding (8 mantissa bits) sets the noise, and that
noise depends on widths, depth, data and kernels (proof/oracle/thresholds.py measured forward errors from 3.7e-2
to 0.29 on two tiny models). So a bf16 preflight runs three worlds: the fp32 world-1 reference (the truth), the
one-rank bf16 run (bf16's own error, with no parallelism in it), and the topology in bf16. For each phase and
optimizer step, with `noise` the one-rank bf16 run's worst relative error against fp32 at that step or any before
it (rounding noise accumulates), the topology's worst error against fp32 must stay within
`FACTOR x max(noise, fp32 threshold of that phase and step)`: never tighter than fp32's own noise, so a phase bf16
leaves exact (or nearly) is not judged on a zero.

A step where that limit reaches 1 is not compared: the one-rank bf16 run is itself about as far from fp32 as a
wrong answer (bf16 runs diverge chaotically after step 0, thresholds.py), so nothing there separates a bug from
rounding. The report lists the limits used.

FACTOR (thresholds.BF16_TOPOLOGY_FACTOR) comes from measured noise: the preflight CLI on CPU with gloo, bf16, 5 steps,
on a tiny dense GQA model (hidden 64, 1 kept layer, seq 16, vocab 128) and its MoE variant (4 experts, top-2); per run
the topology's error over the one-rank envelope, at the worst step of each phase:

    correct code       forward  loss   grads  grad_norm  deltas
    dp2, pp2           1.00     1.00   1.00   1.00       1.00    (the same bf16 arithmetic as one rank)
    tp2, tp2-sp        1.07     1.61   1.39   0.70       1.04
    cp2                1.00     1.00   1.05   1.35       1.09
    ep2 (MoE)          1.00     1.04   1.20   1.20       1.01
    tp2-etp2-sp (MoE)  1.02     1.17   1.08   2.51       1.05    (worst: 2.51; FACTOR 5 leaves 2x)

The 15 two-rank mutations on those topologies, judged the same way, fail by 8.2x (xavier_fan_in_local_shard:
grad_norm 41.2 / 5) to 7.4e3x (finalize_not_installed), against 3.4x under the fixed bf16 thresholds of
thresholds.py. The 100x margins are fp32's: bf16 remains a check with a known-bug floor.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

from megatron_lora_patch.proof.oracle import thresholds
from megatron_lora_patch.proof.oracle.phases import keys_by_step, measure_for

FACTOR = thresholds.BF16_TOPOLOGY_FACTOR


@dataclasses.dataclass(frozen=True)
class RelativeLimits:
    """`phases.compare`'s settings (`steps`, `threshold(phase, step)`) made from the one-rank bf16 run's noise."""

    steps: int
    limits: Mapping[Tuple[str, int], float]  # (phase, step) -> the topology's pass threshold
    noise: Mapping[Tuple[str, int], float]  # (phase, step) -> the one-rank bf16 run's largest error so far

    def threshold(self, phase: str, step: int) -> Optional[float]:
        """The pass threshold of `phase` at `step`; None: not compared (the limit would reach 1)."""
        return self.limits.get((phase, step))

    @property
    def thresholds(self) -> Dict[str, Dict[str, Optional[float]]]:
        """The report's {phase: {"step 0": t, "later steps": the loosest later t}} (None: not compared)."""
        described: Dict[str, Dict[str, Optional[float]]] = {}
        for phase in thresholds.PHASES:
            later = [limit for (name, step), limit in self.limits.items() if name == phase and step > 0]
            described[phase] = {"step 0": self.limits.get((phase, 0)), "later steps": max(later, default=None)}
        return described


def relative_limits(one_rank: dict, fp32: dict, steps: int) -> RelativeLimits:
    """The limits for a bf16 topology from the canonical phases of the one-rank bf16 run and the fp32 reference."""
    limits, noise = {}, {}
    for phase, expected in fp32.items():
        envelope = 0.0
        for step, keys in sorted(keys_by_step(phase, expected, steps).items()):
            floor = thresholds.threshold("fp32", phase, step)
            if floor is None:
                continue
            own = measure_for(phase)({key: one_rank[phase][key] for key in keys}, {key: expected[key] for key in keys},
                                     floor).rel_l2
            if own != own:
                raise ValueError(f"the one-rank bf16 run gave NaN in {phase} at step {step}: nothing to compare with")
            # Rounding noise accumulates over steps; one run's error at a step can dip by chance (measured: a loss
            # 4x under its step-1 error at step 2), so a step is judged by the largest error up to it.
            envelope = max(envelope, own)
            noise[(phase, step)] = envelope
            limit = FACTOR * max(envelope, floor)
            if limit < 1.0:  # PhaseMetrics fails any error of 1 or more: a limit there could never pass
                limits[(phase, step)] = limit
    return RelativeLimits(steps, limits, noise)
