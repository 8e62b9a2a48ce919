"""LoRA overhead of one Megatron MLP layer pair, against its FLOP bound (issue 17 benchmark; prints figures).

The pair: `ColumnParallelLinear` h -> 4h then `RowParallelLinear` 4h -> h (no bias), base
weights frozen, the input requiring grad (so the frozen base runs its dgrad chain, as inside
a model), `--tokens` tokens, fp32 on CPU, sharded over `--tp` ranks of a gloo world (TP 1:
world size 1); with `--sp` (TP > 1) sequence parallel, the input then being the rank's
sequence shard, and the adapters' `sp_input` ("keep" / "regather", `LoraConfig.sp_input`,
what the job's `MEGATRON_LORA_SP_INPUT` sets) taken from `--sp-input`. Variants, built in
one Megatron world per TP size:
- `frozen`: the pair without adapters;
- `lora`: the same weights with the `lora_linear` patch's adapters (rank r, B non-zero).
One repetition = forward + backward (a fixed output grad) of each variant back to back,
the order flipping every repetition (ABBA), so machine drift hits both alike. Timed as the
calling thread's CPU time (`time.thread_time`): with one intra-op thread the forward and the
CPU autograd backward both run in it, and time spent descheduled by other load (CI on a
2-core machine) is not counted; cache and memory-bandwidth contention still are. At TP > 1
the thread CPU time also leaves out the collectives: gloo runs them in its own worker threads
and the calling thread waits off-CPU, so the gather / reduce and the waiting for the other
rank are not counted (`lora_collectives.py` counts the collectives: `keep` adds none to the
frozen pair's, `regather` one all-gather per column layer). For that share, the process CPU
time (all threads, gloo's included; waiting still excluded) and the wall time are reported
too, as ratios only: on a loaded 2-core machine they are noisy. Per repetition each clock
takes the slowest rank's time (the step's cost in a synchronous world). Reported: median
step time of each variant and the median, min and max of the per-repetition ratio
LoRA / frozen, next to the FLOP ratio that `torch.utils.flop_counter.FlopCounterMode`
counts for the same steps on each rank (max over ranks; the ranks are symmetric; the in-place
`addmm_` counted like `addmm`). At TP 2
it differs from TP 1's: A of the column layer and B of the row layer are replicated
(docs/architecture.md section 4), so their GEMMs do not shrink with the base's shards.
Goal (issue 17): ratio <= 1 + 2 x (LoRA FLOPs / frozen FLOPs - 1).

Usage: python benchmarks/lora_layer.py [--tp 1,2] [--sp] [--sp-input keep,regather] [--hidden 1024,2048]
       [--ranks 8,16,64] [--tokens 512] [--reps 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VARIANTS = ("frozen", "lora")
#: Thread CPU time (the goal's clock), process CPU time (gloo's threads included) and wall time.
CLOCKS = (("thread", time.thread_time), ("process", time.process_time), ("wall", time.perf_counter))


def build_pair(hidden: int, rank: int, tp: int, sequence_parallel: bool, sp_input: str, ffn: int = 0,
               dtype: torch.dtype = torch.float32, dora: bool = False) -> torch.nn.Module:
    """The frozen MLP pair h -> ffn -> h (ffn 0: 4h) over `tp` ranks, weights in `dtype`, on the CPU; with
    `rank` > 0 the `lora_linear` patch's adapters on both (DoRA ones with `dora`)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_lora_patch.lora.config import LoraConfig
    from megatron_lora_patch.lora.layers.attach import attach_adapters

    torch.manual_seed(0)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=dtype)
    ffn = ffn or 4 * hidden
    init, group = torch.nn.init.xavier_normal_, parallel_state.get_tensor_model_parallel_group()
    pair = torch.nn.Module()
    pair.linear_fc1 = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=False,
                                           gather_output=False, tp_group=group)
    pair.linear_fc2 = RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=False,
                                        input_is_parallel=True, skip_bias_add=False, tp_group=group)
    for param in pair.parameters():
        param.requires_grad_(False)
    if rank:
        attach_adapters(pair, LoraConfig(rank=rank, alpha=2.0 * rank, b_init="nonzero", sp_input=sp_input,
                                             dora=dora))
    return pair


def step(pair: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    """Forward + backward of the pair; the input grad and any adapter grads are dropped after."""
    hidden, _ = pair.linear_fc1(x)
    output, _ = pair.linear_fc2(hidden)
    torch.autograd.backward(output, grad)
    x.grad = None
    for param in pair.parameters():
        param.grad = None


def _count_in_place_addmm() -> None:
    """FlopCounterMode counts `addmm` but not the in-place `addmm_` the LoRA epilogues use: same FLOPs."""
    from torch.utils import flop_counter

    registry = flop_counter.flop_registry
    registry.setdefault(torch.ops.aten.addmm_, registry[torch.ops.aten.addmm])


def measure(pairs: dict, x: torch.Tensor, grad: torch.Tensor, reps: int, variants: tuple = VARIANTS) -> dict:
    """On one rank: per variant, the clocks of every repetition (ABBA; repetition 0 warms up) and the FLOP ratio
    of the second variant over the first, minus 1."""
    from torch.utils.flop_counter import FlopCounterMode

    _count_in_place_addmm()
    flops = {}
    for name, pair in pairs.items():
        with FlopCounterMode(display=False) as counter:
            step(pair, x, grad)
        flops[name] = counter.get_total_flops()
    times = {name: [] for name in pairs}
    for repetition in range(reps + 1):
        for name in variants if repetition % 2 else variants[::-1]:
            start = [clock() for _, clock in CLOCKS]
            step(pairs[name], x, grad)
            times[name].append([clock() - begin for (_, clock), begin in zip(CLOCKS, start)])
    base, variant = variants
    return {"times": times, "flop_ratio": flops[variant] / flops[base] - 1.0}


def measure_all(rank: int, world_size: int, topology: str, sp_inputs: tuple, hiddens: list, ranks: list,
                tokens: int, reps: int, threads: int) -> list:
    """In each rank of the `topology` world: (sp_input, hidden, r, this rank's figures) per setting."""
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.topology import Topology

    torch.set_num_threads(threads)
    apply_only(("cpu_compat", "lora_linear"))
    rows = []
    with Topology.parse(topology).world() as world:
        local_tokens = tokens // world.tp if world.sp else tokens
        for sp_input in sp_inputs:
            for hidden in hiddens:
                torch.manual_seed(1)
                x = torch.randn(local_tokens, 1, hidden, requires_grad=True)
                grad = torch.randn(local_tokens, 1, hidden)
                frozen = build_pair(hidden, 0, world.tp, world.sp, sp_input)
                for r in ranks:
                    pairs = {"frozen": frozen, "lora": build_pair(hidden, r, world.tp, world.sp, sp_input)}
                    rows.append((sp_input, hidden, r, measure(pairs, x, grad, reps)))
    return rows


def summarize(per_rank: list, variants: tuple = VARIANTS) -> dict:
    """One setting over all ranks: per repetition and clock the slowest rank's time; the thread-time
    medians (ms) and, per clock, the second variant / first variant ratio's median, min and max over repetitions."""
    steps = {name: [[max(clock) for clock in zip(*ranks)]
                    for ranks in zip(*(figures["times"][name][1:] for figures in per_rank))]
             for name in variants}
    summary = {"median_ms": {name: statistics.median(times[0] for times in steps[name]) * 1e3 for name in variants},
               "flop_ratio": max(figures["flop_ratio"] for figures in per_rank)}
    base, variant = variants
    for index, (clock, _) in enumerate(CLOCKS):
        ratios = [new[index] / old[index] for new, old in zip(steps[variant], steps[base])]
        summary[clock] = (statistics.median(ratios), min(ratios), max(ratios))
    return summary


def worlds(parser: argparse.ArgumentParser, options) -> list:
    """(topology, world size, sp_inputs) of every world to run; a bad option combination stops the parser."""
    tps = [int(tp) for tp in options.tp.split(",")]
    sp_inputs = tuple(options.sp_input.split(","))
    if any(value not in ("keep", "regather") for value in sp_inputs):
        parser.error(f"--sp-input {options.sp_input!r}: give a comma list of keep, regather")
    if options.sp and max(tps) < 2:
        parser.error("--sp shards the sequence over TP ranks: give --tp 2 (or a list with a TP > 1)")
    if options.sp and any(options.tokens % tp for tp in tps):
        parser.error(f"--tokens {options.tokens} must be divisible by every --tp under --sp")
    return [("tp1", 1, ("keep",)) if tp == 1 else
            (f"tp{tp}-sp", tp, sp_inputs) if options.sp else (f"tp{tp}", tp, ("keep",)) for tp in tps]


def _ratio_text(figures: tuple) -> str:
    median, low, high = figures
    return f"{median:.3f} [{low:.3f}, {high:.3f}]"


def ratio_columns(figures: dict) -> str:
    """The thread-time ratio, FLOP ratio, bound (1 + 2 x FLOP ratio), verdict, process-CPU and wall ratios."""
    bound = 1.0 + 2.0 * figures["flop_ratio"]
    return (f"{_ratio_text(figures['thread']):>22} {figures['flop_ratio']:10.4f} {bound:6.3f} "
            f"{'yes' if figures['thread'][0] <= bound else 'NO':>3}  {_ratio_text(figures['process']):>22}  "
            f"{_ratio_text(figures['wall']):>22}")


def report(options, rows: list) -> None:
    print(f"MLP pair h -> 4h -> h, {options.tokens} tokens, fp32 CPU, {options.threads} thread(s) per rank, frozen "
          f"base, input requires grad; {options.reps} interleaved (ABBA) repetitions of forward + backward, per "
          f"repetition the slowest rank; ms and ratio: thread CPU time (collectives not counted)")
    print(f"{'setting':>16} {'hidden':>6} {'r':>3} {'frozen ms':>10} {'lora ms':>9} {'ratio [min, max]':>22} "
          f"{'FLOP ratio':>10} {'bound':>6} {'met':>3}  {'process CPU ratio':>22}  {'wall ratio':>22}")
    for setting, hidden, rank, figures in rows:
        print(f"{setting:>16} {hidden:6d} {rank:3d} {figures['median_ms']['frozen']:10.2f} "
              f"{figures['median_ms']['lora']:9.2f} {ratio_columns(figures)}")


def main() -> None:
    from megatron_lora_patch.proof.testbed.launcher import run_world

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", default="1", help="comma list of tensor-parallel sizes (one gloo world each)")
    parser.add_argument("--sp", action="store_true", help="sequence parallel at TP > 1")
    parser.add_argument("--sp-input", default="keep", help="comma list of LoRA sp_input values under --sp")
    parser.add_argument("--hidden", default="1024,2048", help="comma list of hidden sizes")
    parser.add_argument("--ranks", default="8,16,64", help="comma list of LoRA ranks")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=30, help="timed repetitions per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    options = parser.parse_args()
    hiddens = [int(h) for h in options.hidden.split(",")]
    ranks = [int(r) for r in options.ranks.split(",")]
    rows = []
    for topology, world_size, sp_inputs in worlds(parser, options):
        per_rank = run_world(measure_all, world_size, timeout=3000, name=f"lora-layer {topology}",
                             args=(topology, sp_inputs, hiddens, ranks, options.tokens, options.reps, options.threads))
        for settings in zip(*per_rank):
            sp_input, hidden, rank, _ = settings[0]
            setting = f"{topology} {sp_input}" if topology.endswith("-sp") else topology
            rows.append((setting, hidden, rank, summarize([figures for *_, figures in settings])))
    report(options, rows)


if __name__ == "__main__":
    main()
