"""Step time and peak memory of the layout-invariant mode vs the default mode (issues 7 and 28).

One gloo world (`--topology`: tp2, tp2-sp, dp2, pp2, tp2-dp2, ...) runs Megatron training steps of a
GQA GPT with LoRA on every linear (the testbed driver: DDP, schedule, finalize, Adam with clipping)
in both modes, alternating
run by run (ABBA; the patches applied and reverted around each run), so machine drift hits
both modes alike. Per step it records the wall time and the process CPU time (all threads of
the rank, gloo's included; waiting descheduled is not counted, so it is the stable figure on a
loaded machine) of the whole step (forward + backward + optimizer) and of the model forwards
alone (forward pre/post hooks on the model), after
`--warmup` untimed steps; medians over the timed steps of rank 0, and the spread of the
per-run step-time and forward-time ratios, are reported.

Memory (one world per mode: the peak is per process): the growth of the process's peak resident set size
(`resource.getrusage` ru_maxrss)
over the resident size right after the model is built, max over ranks. tracemalloc is not used
because torch's CPU allocator bypasses Python's allocator (it would see none of the tensors).
RSS growth counts activations, gathered partials and temporaries, plus allocator slack. The
state the mode keeps between steps (the microbatch lanes, `layout_invariant.lanes`: adapter-sized grad
buffers; no weight is cached) is reported separately, next to the rank's own
parameter bytes.

`--device cuda` (issue 34's device script: world size 1, `--topology tp1`): the ranks on GPUs with NCCL, each clock
read after a device synchronize, and memory as the growth of CUDA's peak allocation over the allocation right
after the model is built (the process's CPU time is then host time only: read the wall figures).

Anchor: Megatron-LM #4740 reports +70 % forward and +163 % end-to-end on GPU (TE kernels,
real sizes); on 2 CPU cores with gloo the ratios are only indicative.

Usage: python benchmarks/tp_invariant.py [--topology tp2] [--steps 4] [--warmup 1] [--rounds 4] [--hidden 256]
    [--seq 128] [--global-batch 8] [--device cpu]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from megatron_lora_patch.proof.testbed.launcher import run_world

PATCHES = ("cpu_compat", "lora_linear", "finalize_grads", "loss_normalization")
MODES = (("default", False), ("layout_invariant", True))
#: Wall time, and the CPU time of the rank's process (all its threads): CPU time leaves out the time
#: the process waits descheduled on a loaded machine, so its ratios stay stable under load.
CLOCKS = (("s", time.perf_counter), ("cpu_s", time.process_time))
_FORWARD: dict = {"started": None, "seconds": (0.0, 0.0), "device": "cpu"}
_STEP_ENDS: list = []


def _current_bytes() -> int:
    """The resident set size; on CUDA the bytes CUDA's allocator holds for tensors (its peak counted from here)."""
    if _FORWARD["device"] == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    if _FORWARD["device"] == "cuda":
        import torch

        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _now() -> tuple:
    if _FORWARD["device"] == "cuda":  # device work is asynchronous: the clocks are read once it is done
        import torch

        torch.cuda.synchronize()
    return tuple(clock() for _, clock in CLOCKS)


def _forward_started(module, args, kwargs):
    _FORWARD["started"] = _now()


def _forward_finished(module, args, kwargs, output):
    _FORWARD["seconds"] = tuple(
        total + end - begin for total, begin, end in zip(_FORWARD["seconds"], _FORWARD["started"], _now())
    )


def _time_forwards(chunks) -> None:
    chunks[0].register_forward_pre_hook(_forward_started, with_kwargs=True)
    chunks[0].register_forward_hook(_forward_finished, with_kwargs=True)
    _FORWARD["memory_before"] = _current_bytes()
    _FORWARD["param_bytes"] = sum(param.nbytes for chunk in chunks for param in chunk.parameters())


def _step_end(step, record, chunks) -> None:
    _STEP_ENDS.append(_now())
    record["extra"]["forward_s"] = _FORWARD["seconds"]
    _FORWARD["seconds"] = (0.0, 0.0)


def _train(spec, topology_text, invariant, steps, global_batch, device) -> tuple:
    """One training run of `steps` steps in one mode: (record, time the run started)."""
    import megatron_lora_patch
    from megatron_lora_patch.layout_invariant import lanes
    from megatron_lora_patch.lora.config import LoraConfig, set_active
    from megatron_lora_patch.proof.testbed.driver import train_steps
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.proof.testbed.settings import Capture, TrainSettings
    from megatron_lora_patch.proof.testbed.topology import Topology

    _FORWARD["device"] = device
    wanted = (set(PATCHES) - ({"cpu_compat"} if device == "cuda" else set())) | (
        {"layout_invariant"} if invariant else set()
    )
    apply_only(wanted)
    set_active(LoraConfig(rank=16, alpha=32.0, b_init="nonzero"))
    settings = TrainSettings(
        steps=steps,
        global_batch_size=global_batch,
        on_model_built=_time_forwards,
        capture=Capture(params=None, on_step_end=_step_end),
        device=device,
    )
    topology = Topology.parse(topology_text)
    _STEP_ENDS.clear()
    try:
        with topology.world(seed=settings.seed, device=device):
            started = _now()
            record = train_steps(spec, topology, settings)
            record["state_bytes"] = lanes.lane_bytes() if invariant else 0
            record["param_bytes"] = _FORWARD["param_bytes"]
            return record, started
    finally:
        set_active(None)
        megatron_lora_patch.revert()


def _step_times(record, started) -> dict:
    ends = [started] + _STEP_ENDS
    times = {"state_bytes": record["state_bytes"], "param_bytes": record["param_bytes"]}
    for index, (suffix, _) in enumerate(CLOCKS):
        times[f"step_{suffix}"] = [end[index] - begin[index] for begin, end in zip(ends, ends[1:])]
        times[f"forward_{suffix}"] = [step["extra"]["forward_s"][index] for step in record["steps"]]
    return times


def _measure_memory(rank, world_size, spec, topology_text, invariant, steps, global_batch, device) -> float:
    """Peak memory growth of one mode: its own world, since the peak is per process."""
    _train(spec, topology_text, invariant, steps, global_batch, device)
    return _peak_bytes() - _FORWARD["memory_before"]


def _measure_times(rank, world_size, spec, topology_text, steps, rounds, global_batch, device) -> list:
    """Both modes in ONE world, alternating run by run (ABBA), so machine drift hits both alike."""
    runs = []
    for round_index in range(rounds):
        modes = MODES if round_index % 2 == 0 else MODES[::-1]
        runs.append(
            {
                mode: _step_times(*_train(spec, topology_text, invariant, steps, global_batch, device))
                for mode, invariant in modes
            }
        )
    return runs


TIMES = tuple(f"{part}_{suffix}" for suffix, _ in CLOCKS for part in ("step", "forward"))


def _summary(runs: list, warmup: int) -> dict:
    """Per mode: medians over every timed step of every round; per-round ratios (median, min, max)."""
    figures = {}
    for mode, _ in MODES:
        figures[mode] = {
            key: statistics.median(value for run in runs for value in run[mode][key][warmup:]) for key in TIMES
        }
    for key in TIMES:
        ratios = [
            statistics.median(run["layout_invariant"][key][warmup:]) / statistics.median(run["default"][key][warmup:])
            for run in runs
        ]
        figures[f"{key}_ratio"] = (statistics.median(ratios), min(ratios), max(ratios))
    figures["state_mib"] = {key: runs[-1]["layout_invariant"][key] / 2**20 for key in ("state_bytes", "param_bytes")}
    return figures


def _report(options, topology: str, figures: dict, peak_mib: dict) -> None:
    print(
        f"{topology}, GQA GPT hidden {options.hidden}, seq {options.seq}, LoRA r16 on all linears, global batch "
        f"{options.global_batch}; "
        f"{options.rounds} alternating runs per mode of {options.steps} timed steps (medians, rank 0; "
        f"wall time and process CPU time)"
    )
    print(f"{'mode':14s} " + " ".join(f"{key:>14s}" for key in TIMES) + f" {'peak memory growth MiB':>20s}")
    for mode, _ in MODES:
        print(f"{mode:14s} " + " ".join(f"{figures[mode][key]:14.4f}" for key in TIMES) + f" {peak_mib[mode]:20.1f}")
    for key in TIMES:
        median, low, high = figures[f"{key}_ratio"]
        print(
            f"ratio layout_invariant / default, {key}: {median:.2f}x (per-round median; min {low:.2f}, max {high:.2f})"
        )
    print(
        f"peak memory growth ratio {peak_mib['layout_invariant'] / max(peak_mib['default'], 1e-9):.2f}x; state kept "
        f"by layout_invariant between steps (microbatch lanes, rank 0): "
        f"{figures['state_mib']['state_bytes']:.1f} MiB "
        f"on top of the rank's {figures['state_mib']['param_bytes']:.1f} MiB of parameters"
    )


def main() -> None:
    from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
    from megatron_lora_patch.proof.testbed.topology import Topology

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per run")
    parser.add_argument("--rounds", type=int, default=4, help="runs per mode, alternating")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--topology", default="tp2", help="tp2, tp2-sp, dp2, pp2, tp2-dp2, ... (testbed spec)")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step (micro batch 1)")
    parser.add_argument("--experts", type=int, default=0, help="MoE: routed experts per layer, top-2 (0: dense)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank, NCCL")
    options = parser.parse_args()
    spec = TinyGPTSpec(
        hidden_size=options.hidden,
        ffn_hidden_size=2 * options.hidden,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=512,
        seq_length=options.seq,
        num_experts=options.experts or None,
    )
    topology, world = options.topology, Topology.parse(options.topology).world_size
    steps = options.warmup + options.steps
    runs = run_world(
        _measure_times,
        world,
        args=(spec, topology, steps, options.rounds, options.global_batch, options.device),
        timeout=3000,
        name=f"{topology} both modes",
    )[0]
    figures = _summary(runs, options.warmup)
    memory_args = (spec, topology, steps, options.global_batch, options.device)
    peak_mib = {
        mode: max(
            run_world(
                _measure_memory,
                world,
                args=(*memory_args[:2], invariant, *memory_args[2:]),
                timeout=1200,
                name=f"{topology} {mode} memory",
            )
        )
        / 2**20
        for mode, invariant in MODES
    }
    _report(options, topology, figures, peak_mib)


if __name__ == "__main__":
    main()
