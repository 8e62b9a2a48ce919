"""DoRA's extra cost over LoRA on one Megatron MLP layer pair (issue 37 item 6 benchmark; prints figures).

The pair of `lora_layer.py` (`ColumnParallelLinear` h -> 4h, `RowParallelLinear` 4h -> h, frozen base, the input
requiring grad, `--tokens` tokens, fp32 CPU, over `--tp` ranks of a gloo world), once with LoRA adapters and once
with DoRA ones (`LoraConfig.dora`, lora/adapters/dora.py), same weights and rank r. One repetition = forward +
backward of each variant back to back, the order flipping every repetition (ABBA); clocks as in `lora_layer.py`
(thread CPU time for the ratio, the collectives of the row layer's norm left out there; process CPU and wall time
as ratios), per repetition the slowest rank.

What DoRA adds per layer and forward (docs/configuration.md "DORA"): one pass over the rank's weight rows for
`W A^T` (out_local x in x r multiply-adds; `||W||^2` of the frozen base is cached), small r x r and out_local x r
products, the row rescale of the [tokens, out_local] output and its grad; at TP > 1 one all-reduce of out_local
floats per row-parallel layer. The bound (the LoRA benchmark's rule): DoRA / LoRA <= 1 + 2 x (DoRA FLOPs / LoRA
FLOPs - 1), the FLOPs counted by `torch.utils.flop_counter.FlopCounterMode` on the same steps.

Memory per rank, measured on the same steps: the bytes autograd saves for the backward (`saved_tensors_hooks`,
each storage counted once) and the DoRA state kept between steps (`m` and the cached `||W||^2`, one fp32 vector
per local output row each).

Usage: python -P benchmarks/dora_layer.py [--tp 1,2] [--hidden 1024,2048] [--ranks 16] [--tokens 512] [--reps 20]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lora_layer  # noqa: E402
from lora_layer import build_pair, step  # noqa: E402

VARIANTS = ("lora", "dora")


def saved_bytes(pair: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves for the backward of one forward of `pair`."""
    storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step(pair, x, grad)
    return sum(storages.values())


def dora_state_bytes(pair: torch.nn.Module) -> int:
    """Bytes DoRA keeps between steps: each adapter's magnitude `m` and its cached `||W||^2` per row."""
    total = 0
    for adapter in pair.modules():
        if getattr(adapter, "magnitude", None) is not None:
            cached = adapter.magnitude._base
            total += adapter.m.numel() * adapter.m.element_size()
            total += cached[1].numel() * cached[1].element_size() if cached else 0
    return total


def measure(pairs: dict, x: torch.Tensor, grad: torch.Tensor, reps: int) -> dict:
    """On one rank: `lora_layer.measure` of LoRA then DoRA, and each variant's memory."""
    figures = lora_layer.measure(pairs, x, grad, reps, VARIANTS)
    figures["saved_mb"] = {name: saved_bytes(pair, x, grad) / 2**20 for name, pair in pairs.items()}
    figures["state_kb"] = dora_state_bytes(pairs["dora"]) / 2**10
    return figures


def measure_all(rank: int, world_size: int, topology: str, hiddens: list, ranks: list, tokens: int,
                reps: int) -> list:
    """In each rank of the `topology` world: (hidden, r, this rank's figures) per setting."""
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    torch.set_num_threads(1)
    apply_only(("cpu_compat", "lora_linear"))
    rows = []
    with Topology.parse(topology).world() as world:
        for hidden in hiddens:
            torch.manual_seed(1)
            x = torch.randn(tokens, 1, hidden, requires_grad=True)
            grad = torch.randn(tokens, 1, hidden)
            for r in ranks:
                pairs = {name: build_pair(hidden, r, world.tp, False, "keep", dora=name == "dora")
                         for name in VARIANTS}
                rows.append((hidden, r, measure(pairs, x, grad, reps)))
    return rows


def summarize(per_rank: list) -> dict:
    """`lora_layer.summarize` of DoRA over LoRA, with the largest rank's memory figures."""
    summary = lora_layer.summarize(per_rank, VARIANTS)
    summary["saved_mb"] = {name: max(figures["saved_mb"][name] for figures in per_rank) for name in VARIANTS}
    summary["state_kb"] = max(figures["state_kb"] for figures in per_rank)
    return summary


def report(options, rows: list) -> None:
    print(f"MLP pair h -> 4h -> h, {options.tokens} tokens, fp32 CPU, 1 thread per rank, frozen base; "
          f"{options.reps} interleaved (ABBA) repetitions of forward + backward, per repetition the slowest rank; "
          f"ms and ratio: thread CPU time (collectives not counted); memory per rank")
    print(f"{'setting':>7} {'hidden':>6} {'r':>3} {'lora ms':>8} {'dora ms':>8} {'ratio [min, max]':>22} "
          f"{'FLOP ratio':>10} {'bound':>6} {'met':>3}  {'process CPU ratio':>22}  {'wall ratio':>22}  "
          f"{'saved MB lora/dora':>18} {'state KB':>8}")
    for setting, hidden, rank, figures in rows:
        saved = figures["saved_mb"]
        print(f"{setting:>7} {hidden:6d} {rank:3d} {figures['median_ms']['lora']:8.2f} "
              f"{figures['median_ms']['dora']:8.2f} {lora_layer.ratio_columns(figures)}  "
              f"{saved['lora']:8.2f}/{saved['dora']:<9.2f} {figures['state_kb']:8.1f}")


def main() -> None:
    from megatron_lora_patch.proof.testbed.launcher import run_world

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes (one gloo world each)")
    parser.add_argument("--hidden", default="1024,2048", help="comma list of hidden sizes")
    parser.add_argument("--ranks", default="16", help="comma list of LoRA ranks")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per variant")
    options = parser.parse_args()
    hiddens = [int(h) for h in options.hidden.split(",")]
    ranks = [int(r) for r in options.ranks.split(",")]
    rows = []
    for tp in (int(tp) for tp in options.tp.split(",")):
        per_rank = run_world(measure_all, tp, timeout=3000, name=f"dora-layer tp{tp}",
                             args=(f"tp{tp}", hiddens, ranks, options.tokens, options.reps))
        for settings in zip(*per_rank):
            hidden, rank, _ = settings[0]
            rows.append((f"tp{tp}", hidden, rank, summarize([figures for *_, figures in settings])))
    report(options, rows)


if __name__ == "__main__":
    main()
