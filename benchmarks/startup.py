"""Start-up cost of megatron-lora-patch (issue: plugin runtime).

Prints:
- interpreter start-up (`python -c pass`) with the wheel installed and MEGATRON_PLUGINS unset,
  versus the same environment without the package: medians of N runs and their ratio;
- the same with MEGATRON_PLUGINS=lora_correct (bootstrap armed, Megatron not imported);
- the time to load the plugin and apply every enabled patch when Megatron's targets are
  already imported (`megatron_lora_patch.apply`), median of in-process runs.

Usage: python benchmarks/startup.py [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

from megatron_lora_patch.proof.testbed import wheel_env

REPO = pathlib.Path(__file__).resolve().parent.parent

APPLY_TIMING = """
import time, importlib
import megatron_lora_patch
from megatron_lora_patch.plugins import lora_correct
for patch in lora_correct.PATCHES:
    for module in patch.SPEC.hooks:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
start = time.perf_counter()
megatron_lora_patch.apply(['lora_correct'])
applied = time.perf_counter() - start
count = sum(r.state == 'applied' for r in megatron_lora_patch.status())
start = time.perf_counter()
megatron_lora_patch.revert()
reverted = time.perf_counter() - start
print(applied, reverted, count)
"""


def start_medians(variants: dict, runs: int) -> dict:
    """Median `python -c pass` wall time per variant; variants alternate within each round so
    machine noise (other processes on 2 cores) hits all of them alike."""
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_")}
    samples: dict = {name: [] for name in variants}
    for _ in range(runs):
        for name, (python, env) in variants.items():
            start = time.perf_counter()
            subprocess.run([str(python), "-c", "pass"], env=base_env | env, check=True, cwd=python.parent)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        without = wheel_env.create(root, None)
        installed = wheel_env.create(root, REPO)
        medians = start_medians(
            {
                "not installed": (without, {}),
                "installed, MEGATRON_PLUGINS unset": (installed, {}),
                "installed, MEGATRON_PLUGINS=lora_correct": (installed, {"MEGATRON_PLUGINS": "lora_correct"}),
            },
            args.runs,
        )
        base = medians["not installed"]
        for name, value in medians.items():
            print(
                f"python -c pass, {name:<42} {value * 1e3:7.2f} ms  ratio {value / base:.3f}  (median of {args.runs})"
            )
        samples = []
        for _ in range(5):
            out = subprocess.run([str(installed), "-c", APPLY_TIMING], capture_output=True, text=True, cwd=tmp)
            if out.returncode:
                raise SystemExit(f"apply timing failed:\n{out.stderr}")
            samples.append(
                [float(x) for x in out.stdout.splitlines()[-1].split()]
            )  # the last line: log lines may precede
        apply_ms = statistics.median(s[0] for s in samples) * 1e3
        revert_ms = statistics.median(s[1] for s in samples) * 1e3
        print(
            f"apply all lora_correct patches (targets already imported): {apply_ms:.2f} ms, "
            f"revert: {revert_ms:.2f} ms, patches applied: {int(samples[0][2])} (median of 5 processes)"
        )


if __name__ == "__main__":
    main()
