"""The production path on one GPU (issue 34's device script): Megatron-LM's own loop with the plugin alone.

`tests/megatron_lm_gpt.py` (the shape of `pretrain_gpt.py`) under `torchrun`, world size 1, on CUDA + NCCL, the
local layer spec, bf16, with `MEGATRON_PLUGINS=lora_correct` and nothing else of this project. Megatron-LM's GPU
defaults stay on except four the test machine cannot run, each named: `--no-gradient-accumulation-fusion`
(APEX's fused weight-grad kernel is not installed; `tests/test_gpu_defaults_on_cpu.py` runs that path on CPU with
the kernel's definition), `--no-persist-layer-norm` (APEX's; without it Megatron's torch norm asserts),
`--no-rope-fusion` (needs Transformer Engine) and `--no-masked-softmax-fusion` (needs Megatron's legacy CUDA
kernels, built from a source tree). The LoRA runs add the distributed optimizer with
overlapped grad reduction and param gather.

Runs: a base without the plugin (`--save`), then LoRA fine-tunes of it, one with full checkpoints (base weights
included) and one with adapter-sized checkpoints. Checks, each printed as PASS / FAIL (exit 1 on any FAIL):
- the LoRA run's loss falls: over the iterations after the first it lies below a run with the adapters frozen
  (`--lr 0`) on the same samples (paired per iteration: mock samples differ in loss by more than a few steps
  of training change it);
- the base weights in the full LoRA checkpoint are bit-identical to the base checkpoint's;
- the adapter-sized checkpoint holds adapter tensors and no base weight (its bytes against the base's printed);
- `megatron-lora-patch export` of the full LoRA checkpoint loads in peft onto the base weights and gives
  Megatron's logits (recomputed in fp32 from the stored weights, tests/megatron_lm_checkpoints.py) and not the
  base's.
`--dry-run`: the same on CPU with gloo (adding the `cpu_testbed` plugin), a few iterations.

The checks run after the launches in a child process that sees no GPU (`CUDA_VISIBLE_DEVICES=`): they read the
runs on CPU. `--checks-only OUT_DIR`: the checks alone, on the runs a GPU left in OUT_DIR.

Usage: python benchmarks/gpu/megatron_lm_cuda.py OUT_DIR [--iterations 20] [--dry-run | --checks-only]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import megatron_lm_checkpoints as checkpoints  # noqa: E402
import megatron_lm_runs as runs  # noqa: E402

from megatron_lora_patch.proof.testbed.launcher import WorldError  # noqa: E402

GPU_ARGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
            "--no-rope-fusion", "--no-masked-softmax-fusion", "--eval-iters", "0", "--eval-interval", "1000"]
LORA_ARGS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _launch(out: pathlib.Path, name: str, args: list, env: dict, options) -> None:
    """One torchrun of the launch script with the tiny model, bf16, `options.iterations` iterations."""
    device_args = runs.HOST_ARGS if options.dry_run else GPU_ARGS
    train = runs.TRAIN_ARGS + ["--bf16", "--train-iters", str(options.iterations), "--save-interval",
                               str(options.iterations)]
    record = out / f"rec-{name}"
    record.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               str(runs.SCRIPT)] + runs.MODEL_ARGS + device_args + train + args
    environ = runs.clean_environ(CUDA_DEVICE_MAX_CONNECTIONS="1", LOOP_RECORD_DIR=str(record), **env)
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=600, cwd=str(out))
    (out / f"{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{name}: the run failed (exit {done.returncode}); its log: {out / f'{name}.log'}\n"
                         + done.stderr[-3000:])


def _size(directory: pathlib.Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _checks(out: pathlib.Path) -> dict:
    """Each check's (passed, figure)."""
    losses = checkpoints._step_losses(out / "rec-lora-full", 1)
    frozen = checkpoints._step_losses(out / "rec-lora-frozen", 1)
    later = len(losses) - 1  # the iterations after the first update (the first is the same model in both runs)
    trained, untrained = sum(losses[1:]) / later, sum(frozen[1:]) / later
    base = checkpoints._model_tensors(out / "base")
    tuned = checkpoints._model_tensors(out / "lora-full")
    changed = sorted(key for key, value in base.items() if not value.equal(tuned[key]))
    adapters = sum(".lora." in key for key in tuned)
    sized = checkpoints._model_tensors(out / "lora")
    base_held = sorted(key for key in sized if ".lora." not in key)
    ratio = _size(out / "lora") / _size(out / "base")
    results = {
        "loss falls": (trained < untrained, f"mean of iterations 2-{later + 1}: {trained:.4f} trained, {untrained:.4f} "
                                            "with the adapters frozen (same samples)"),
        "base bit-identical": (not changed and adapters > 0, f"{len(changed)} base tensors changed, {adapters} "
                                                            "adapter tensors"),
        "adapter-sized checkpoint": (bool(sized) and not base_held, f"{len(sized)} tensors, {len(base_held)} of them "
                                     f"base weights; {ratio:.3f} of the base checkpoint's bytes (metadata included)"),
    }
    try:
        checkpoints.export_matches_megatron(out, out / "lora-full", out / "base")
        results["export in peft = Megatron"] = (True, "max |peft - megatron| / max |megatron| <= 1e-5")
    except AssertionError as error:
        results["export in peft = Megatron"] = (False, str(error)[:300])
    except WorldError as error:  # the recompute is a CPU testbed world: it fails where Megatron sees a GPU
        first = str(error).splitlines()[-1][:200]
        results["export in peft = Megatron"] = (False, f"not checked here ({first}); run this script with "
                                                       "--checks-only on the runs' directory, GPUs hidden "
                                                       "(CUDA_VISIBLE_DEVICES=)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=pathlib.Path, help="an empty or new directory for the runs and their logs")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="on CPU with gloo (cpu_testbed), to check the script")
    parser.add_argument("--checks-only", action="store_true", help="only the checks, on the runs already in OUT_DIR")
    options = parser.parse_args()
    if not options.checks_only:
        _launch_all(parser, options)
        # The checks read the runs on CPU, in a process that sees no GPU: the export check's Megatron recompute is a
        # CPU testbed world, in which Megatron on a machine with CUDA puts RoPE's frequencies on the GPU.
        command = [sys.executable, "-P", str(pathlib.Path(__file__).resolve()), str(options.out), "--checks-only"]
        raise SystemExit(subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).returncode)
    shutil.rmtree(options.out / "peft-lora-full", ignore_errors=True)  # an earlier check's export: written anew
    results = _checks(options.out)
    for name, (passed, figure) in results.items():
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {figure}")
    raise SystemExit(0 if all(passed for passed, _ in results.values()) else 1)


def _launch_all(parser: argparse.ArgumentParser, options) -> None:
    """The base run, then the three LoRA fine-tunes of it (full checkpoints, adapter-sized, adapters frozen)."""
    if options.out.exists() and any(options.out.iterdir()):
        parser.error(f"{options.out} is not empty; name a new directory")
    options.out.mkdir(parents=True, exist_ok=True)
    plugins = "lora_correct,cpu_testbed" if options.dry_run else "lora_correct"
    base_env = runs.TESTBED_ENV if options.dry_run else {}
    lora_env = {"MEGATRON_PLUGINS": plugins, "MEGATRON_LORA_RANK": str(runs.LORA_RANK)}
    load = ["--load", str(options.out / "base"), "--finetune"]
    _launch(options.out, "base", ["--save", str(options.out / "base")], base_env, options)
    _launch(options.out, "lora-full", LORA_ARGS + load + ["--save", str(options.out / "lora-full")],
            {**lora_env, "MEGATRON_LORA_FULL_CHECKPOINTS": "1"}, options)
    _launch(options.out, "lora", LORA_ARGS + load + ["--save", str(options.out / "lora")], lora_env, options)
    _launch(options.out, "lora-frozen", LORA_ARGS + load + ["--lr", "0"], lora_env, options)


if __name__ == "__main__":
    main()
