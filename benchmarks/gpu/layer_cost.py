"""LoRA's cost per MLP layer pair at real shapes on one GPU (issue 34's device script; prints figures).

The pair is `lora_layer.py`'s (`ColumnParallelLinear` h -> f, `RowParallelLinear` f -> h, frozen base, the
input requiring grad), built at the per-rank shard shapes of TP `t`: f = 4h / t. At world size 1 that is
exactly one TP rank's local work, adapters included: the column layer's A [r, h] and the row layer's B [h, r]
are replicated over TP (docs/architecture.md section 4), so they keep their full size while the base and the
other factors shrink. The TP collectives are not in it (one GPU).

Variants `frozen` and `lora` (rank r) alternate ABBA, forward + backward per repetition, timed with CUDA events
(on a CPU dry run, the wall clock). Reported per setting: both medians, the ratio's median [min, max] over
repetitions, the two bounds, and each variant's peak memory over the step (CUDA only):
- FLOP bound: LoRA / frozen FLOPs (every matrix product counted, 2 M N K);
- memory-traffic bound: LoRA / frozen bytes that the matrix products read and write (each operand and the
  result once, an accumulated result twice), the cost model for the skinny rank-r products, which are
  memory-bound on a GPU.
The measured ratio should lie between the two bounds' minimum and maximum: a rank-r product can cost no less
than its FLOPs and, run as a kernel of its own, no more than its traffic.

Usage: python benchmarks/gpu/layer_cost.py [--hidden 4096,8192] [--tp 1,8] [--ranks 16,64] [--tokens 8192]
       [--reps 20] [--dtype bf16] [--device cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: lora_layer's pair and step
from lora_layer import VARIANTS, build_pair, step  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PRODUCTS = {torch.ops.aten.mm.default: False, torch.ops.aten.addmm.default: True, torch.ops.aten.addmm_.default: True}


class ProductCounter(TorchDispatchMode):
    """FLOPs and operand bytes of every matrix product dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = getattr(func, "overloadpacket", None)
        overload = getattr(packet, "default", None)
        if overload in PRODUCTS:
            accumulates = PRODUCTS[overload]
            left, right = (args[1], args[2]) if accumulates else (args[0], args[1])
            (m, k), n = left.shape, right.shape[1]
            self.flops += 2 * m * n * k
            self.bytes += (m * k + k * n + m * n * (2 if accumulates else 1)) * left.element_size()
        return func(*args, **(kwargs or {}))


def _timed(pair, x, grad, device: str) -> float:
    """Seconds of one forward + backward."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(pair, x, grad)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    step(pair, x, grad)
    return time.perf_counter() - begin


def _peak_bytes(pair, x, grad, device: str) -> int:
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step(pair, x, grad)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(pairs: dict, x, grad, reps: int, device: str) -> dict:
    """Per variant: times (ABBA, repetition 0 warms up), counted FLOPs and bytes, peak memory of a step."""
    counts = {}
    for name, pair in pairs.items():
        with ProductCounter() as counter:
            step(pair, x, grad)
        counts[name] = (counter.flops, counter.bytes)
    times = {name: [] for name in pairs}
    for repetition in range(reps + 1):
        for name in VARIANTS if repetition % 2 else VARIANTS[::-1]:
            times[name].append(_timed(pairs[name], x, grad, device))
    ratios = [lora / frozen for lora, frozen in zip(times["lora"][1:], times["frozen"][1:])]
    return {
        "median_ms": {name: statistics.median(values[1:]) * 1e3 for name, values in times.items()},
        "ratio": [statistics.median(ratios), min(ratios), max(ratios)],
        "flop_bound": counts["lora"][0] / counts["frozen"][0],
        "traffic_bound": counts["lora"][1] / counts["frozen"][1],
        "peak_mib": {name: _peak_bytes(pair, x, grad, device) / 2**20 for name, pair in pairs.items()},
    }


def run(options) -> list:
    """Every (hidden, tp, r) setting's figures, in one world of size 1 on `options.device`."""
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.update(RANK="0", WORLD_SIZE="1")
    apply_only(("cpu_compat", "lora_linear"))  # cpu_compat's hooks skip where CUDA is available
    dtype, rows = DTYPES[options.dtype], []
    with Topology.parse("tp1").world():
        for hidden in options.hidden:
            for tp in options.tp:
                x = torch.randn(options.tokens, 1, hidden, dtype=dtype, device=options.device, requires_grad=True)
                grad = torch.randn(options.tokens, 1, hidden, dtype=dtype, device=options.device)
                frozen = build_pair(hidden, 0, 1, False, "keep", ffn=4 * hidden // tp, dtype=dtype).to(options.device)
                for rank in options.ranks:
                    lora = build_pair(hidden, rank, 1, False, "keep", ffn=4 * hidden // tp, dtype=dtype)
                    pairs = {"frozen": frozen, "lora": lora.to(options.device)}
                    rows.append({"hidden": hidden, "tp": tp, "r": rank,
                                 **measure(pairs, x, grad, options.reps, options.device)})
    return rows


def report(options, rows: list) -> None:
    device = torch.cuda.get_device_name() if options.device == "cuda" else "CPU (dry run)"
    print(f"MLP pair h -> 4h/tp -> h (one TP rank's shard), {options.tokens} tokens, {options.dtype}, {device}; "
          f"{options.reps} ABBA repetitions of forward + backward")
    print(f"{'hidden':>6} {'tp':>2} {'r':>3} {'frozen ms':>10} {'lora ms':>9} {'ratio [min, max]':>22} "
          f"{'FLOP bound':>10} {'traffic bound':>13} {'peak MiB frozen / lora':>23}")
    for row in rows:
        median, low, high = row["ratio"]
        peak = f"{row['peak_mib']['frozen']:.0f} / {row['peak_mib']['lora']:.0f}"
        print(f"{row['hidden']:6d} {row['tp']:2d} {row['r']:3d} {row['median_ms']['frozen']:10.3f} "
              f"{row['median_ms']['lora']:9.3f} {f'{median:.3f} [{low:.3f}, {high:.3f}]':>22} "
              f"{row['flop_bound']:10.4f} {row['traffic_bound']:13.4f} "
              f"{peak:>23}")


def _ints(text: str) -> list:
    return [int(value) for value in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=_ints, default=[4096, 8192])
    parser.add_argument("--tp", type=_ints, default=[1, 8], help="TP sizes whose per-rank shard is measured")
    parser.add_argument("--ranks", type=_ints, default=[16, 64])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", help="also write the figures here")
    options = parser.parse_args()
    if options.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a GPU; use --device cpu --dtype fp32 for a dry run")
    rows = run(options)
    report(options, rows)
    if options.json:
        pathlib.Path(options.json).write_text(json.dumps({"device": options.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
