"""LoRA overhead of one Megatron MLP layer pair, against its FLOP bound (issue 17 benchmark; prints figures).

The pair: `ColumnParallelLinear` h -> 4h then `RowParallelLinear` 4h -> h (no bias), base
weights frozen, the input requiring grad (so the frozen base runs its dgrad chain, as inside
a model), `--tokens` tokens, fp32 on CPU. Variants, built in one world-size-1 Megatron world:
- `frozen`: the pair without adapters;
- `lora`: the same weights with the `lora_linear` patch's adapters (rank r, B non-zero).
One repetition = forward + backward (a fixed output grad) of each variant back to back,
the order flipping every repetition (ABBA), so machine drift hits both alike. Timed as the
calling thread's CPU time (`time.thread_time`): with one intra-op thread the forward and the
CPU autograd backward both run in it, and time spent descheduled by other load (CI on a
2-core machine) is not counted; cache and memory-bandwidth contention still are. Reported:
median step time of each variant and the median, min and max of the per-repetition ratio
LoRA / frozen, next to the FLOP ratio that `torch.utils.flop_counter.FlopCounterMode`
counts for the same steps. Goal (issue 17): ratio <= 1 + 2 x (LoRA FLOPs / frozen FLOPs).

Usage: python benchmarks/lora_layer.py [--hidden 1024,2048] [--ranks 8,16,64] [--tokens 512]
       [--reps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _apply_patches() -> None:
    from megatron_lora_patch.proof.testbed.patches import apply_only

    apply_only(("cpu_compat", "lora_linear"))


def build_pair(hidden: int, rank: int) -> torch.nn.Module:
    """The frozen MLP pair; with `rank` > 0 the LoRA adapters of the `lora_linear` patch on both."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_lora_patch.lora.attach import attach_adapters
    from megatron_lora_patch.lora.config import LoraConfig

    torch.manual_seed(0)
    config = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True)
    init, group = torch.nn.init.xavier_normal_, parallel_state.get_tensor_model_parallel_group()
    pair = torch.nn.Module()
    pair.linear_fc1 = ColumnParallelLinear(hidden, 4 * hidden, config=config, init_method=init, bias=False,
                                           gather_output=False, tp_group=group)
    pair.linear_fc2 = RowParallelLinear(4 * hidden, hidden, config=config, init_method=init, bias=False,
                                        input_is_parallel=True, skip_bias_add=False, tp_group=group)
    for param in pair.parameters():
        param.requires_grad_(False)
    if rank:
        attach_adapters(pair, LoraConfig(rank=rank, alpha=2.0 * rank, b_init="nonzero"))
    return pair


def step(pair: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward + backward of the pair; the input grad and any adapter grads are dropped after."""
    hidden, _ = pair.linear_fc1(x)
    output, _ = pair.linear_fc2(hidden)
    torch.autograd.backward(output, grad)
    x.grad = None
    for param in pair.parameters():
        param.grad = None


def measure(hidden: int, rank: int, tokens: int, reps: int) -> dict:
    """Interleaved step times (ABBA) and counted FLOPs of the frozen and LoRA pairs."""
    from torch.utils.flop_counter import FlopCounterMode

    pairs = {"frozen": build_pair(hidden, 0), "lora": build_pair(hidden, rank)}
    x = torch.randn(tokens, 1, hidden, requires_grad=True)
    grad = torch.randn(tokens, 1, hidden)
    flops = {}
    for name, pair in pairs.items():
        with FlopCounterMode(display=False) as counter:
            step(pair, x, grad)
        flops[name] = counter.get_total_flops()
    times = {name: [] for name in pairs}
    for repetition in range(reps + 1):  # repetition 0 warms up
        order = ("frozen", "lora") if repetition % 2 else ("lora", "frozen")
        for name in order:
            start = time.thread_time()
            step(pairs[name], x, grad)
            times[name].append(time.thread_time() - start)
    ratios = [lora / frozen for lora, frozen in zip(times["lora"][1:], times["frozen"][1:])]
    return {
        "median_ms": {name: statistics.median(values[1:]) * 1e3 for name, values in times.items()},
        "ratio": (statistics.median(ratios), min(ratios), max(ratios)),
        "flop_ratio": flops["lora"] / flops["frozen"] - 1.0,
    }


def measure_all(rank: int, world_size: int, hiddens: list, ranks: list, tokens: int, reps: int, threads: int) -> list:
    """In the world-size-1 rank: (hidden, r, figures) for every pair size and LoRA rank."""
    from megatron_lora_patch.proof.testbed.topology import Topology

    torch.set_num_threads(threads)
    _apply_patches()
    with Topology().world():
        return [(hidden, r, measure(hidden, r, tokens, reps)) for hidden in hiddens for r in ranks]


def main() -> None:
    from megatron_lora_patch.proof.testbed.launcher import run_world

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", default="1024,2048", help="comma list of hidden sizes")
    parser.add_argument("--ranks", default="8,16,64", help="comma list of LoRA ranks")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    options = parser.parse_args()
    hiddens = [int(h) for h in options.hidden.split(",")]
    ranks = [int(r) for r in options.ranks.split(",")]
    rows = run_world(measure_all, 1, args=(hiddens, ranks, options.tokens, options.reps, options.threads),
                     name="lora-layer", timeout=3000)[0]
    print(f"MLP pair h -> 4h -> h, {options.tokens} tokens, fp32 CPU, {options.threads} thread(s), frozen base, "
          f"input requires grad; {options.reps} interleaved (ABBA) repetitions of forward + backward, "
          f"thread CPU time")
    print(f"{'hidden':>6} {'r':>3} {'frozen ms':>10} {'lora ms':>9} {'ratio med':>9} {'[min, max]':>15} "
          f"{'FLOP ratio':>10} {'bound':>6}  met")
    for hidden, rank, figures in rows:
        median, low, high = figures["ratio"]
        bound = 1.0 + 2.0 * figures["flop_ratio"]
        print(f"{hidden:6d} {rank:3d} {figures['median_ms']['frozen']:10.2f} {figures['median_ms']['lora']:9.2f} "
              f"{median:9.3f} [{low:.3f}, {high:.3f}] {figures['flop_ratio']:10.4f} {bound:6.3f}  "
              f"{'yes' if median <= bound else 'NO'}")


if __name__ == "__main__":
    main()
