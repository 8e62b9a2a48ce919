"""The world-size-1 side of tests/test_finalize_grads.py: the logical LoRA pair's tensors, the global batch
and each DP rank's share of it, the reference grads on full tensors in one process, and the tolerance
derived from the float32 summation length (tests/error_metrics.py)."""

from __future__ import annotations

import torch
from error_metrics import fp32_sum_tolerance

IN, HIDDEN, OUT, RANK_R = 6, 8, 5, 2
SEQ, MICROBATCHES_PER_DP_RANK = 4, 2
MY_PATCHES = ("finalize_grads", "loss_normalization")
REPLICATED, SHARDED = ("a1", "b2"), ("b1", "a2")


def grad_tolerance(dp: int) -> float:
    """Relative L2 allowed against world-1: fp32 reduction-order noise only (tokens x longest dot product).

    Measured at dp=1: <= 2.5e-7 under every kernel/thread variant tried, vs 2.3e-5 allowed; the
    unpatched replicated factors (TP SUM skipped) are >= 0.26 off, 1e4x the tolerance.
    """
    return fp32_sum_tolerance(dp * MICROBATCHES_PER_DP_RANK * SEQ * HIDDEN * max(IN, OUT))


# -- model and reference (imported by test_loss_normalization too) -----------------------------


def logical_tensors(seed: int = 7) -> dict:
    """The full (world-size-1) weights and adapters; B non-zero so every factor gets a grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "w1": (HIDDEN, IN),
        "w2": (OUT, HIDDEN),
        "a1": (RANK_R, IN),
        "b1": (HIDDEN, RANK_R),
        "a2": (RANK_R, HIDDEN),
        "b2": (OUT, RANK_R),
    }
    return {name: torch.randn(shape, generator=g) * 0.5 for name, shape in shapes.items()}


def global_batch(dp: int, seed: int = 11) -> list:
    """`dp * MICROBATCHES_PER_DP_RANK` samples with very different trainable-token counts."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(dp * MICROBATCHES_PER_DP_RANK):
        mask = torch.zeros(SEQ)
        mask[: 1 + (index * 3) % SEQ] = 1.0
        samples.append(
            {"x": torch.randn(SEQ, IN, generator=g), "target": torch.randn(SEQ, OUT, generator=g), "mask": mask}
        )
    return samples


def samples_of_dp_rank(samples: list, dp_rank: int, dp: int) -> list:
    """Megatron's sampler order: microbatch m of DP rank r is global sample m*dp + r (mbs 1)."""
    return [samples[m * dp + dp_rank] for m in range(MICROBATCHES_PER_DP_RANK)]


def per_token_losses(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((y - target) ** 2).sum(-1)


def reference(samples: list, mean_of_means_dp: int = 0) -> dict:
    """World-size-1 grads and loss of the global token mean (or, if asked, DP mean of microbatch means)."""
    t = {name: tensor.clone().requires_grad_(name[0] in "ab") for name, tensor in logical_tensors().items()}
    total, tokens, means = 0.0, 0.0, []
    for sample in samples:
        h = sample["x"] @ t["w1"].T + (sample["x"] @ t["a1"].T) @ t["b1"].T
        y = h @ t["w2"].T + (h @ t["a2"].T) @ t["b2"].T
        losses = per_token_losses(y, sample["target"]) * sample["mask"]
        total = total + losses.sum()
        tokens += float(sample["mask"].sum())
        means.append(losses.sum() / sample["mask"].sum())
    loss = total / tokens if not mean_of_means_dp else sum(means) / len(means)
    loss.backward()
    return {"loss": float(total / tokens), "grads": {name: t[name].grad for name in ("a1", "b1", "a2", "b2")}}


