"""What the preflight tests share: Megatron-LM-style argument lists (tiny widths), the CLI and
`make_plan` entry points, the user's environment without LoRA flags, and the PASS checks."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
from conftest import clean_environ

DENSE = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 128 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--untie-embeddings-and-output-weights --seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 "
    "--global-batch-size 64 --lr 1e-4 --train-iters 100 --mock-data --tokenizer-type NullTokenizer --vocab-size 128"
).split()
#: First layer dense, the other three MoE (4 experts, top-2): the preflight keeps one of each.
MOE = DENSE + "--num-experts 4 --moe-router-topk 2 --moe-layer-freq ([0]+[1]*3) --moe-ffn-hidden-size 64".split()
TP2_SP = "--tensor-model-parallel-size 2 --sequence-parallel".split()
PHASES = {"forward", "loss", "grads", "grad_norm", "deltas"}


def preflight_environ() -> dict:
    """No user LoRA / patch flags, except the untested-version override where the run sets it."""
    keep = {key: os.environ[key] for key in ("MEGATRON_LORA_ALLOW_UNTESTED",) if key in os.environ}
    return clean_environ(**keep)


def cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-P", "-m", "megatron_lora_patch", "preflight", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=preflight_environ())


def options(megatron_args, **overrides) -> argparse.Namespace:
    values = dict(json=None, steps=2, layers=None, seq_length=None, micro_batches=2, data_parallel_size=None,
                  mutation=None, max_memory_gib=None, max_parameters=None, timeout=600.0)
    values.update(overrides)
    return argparse.Namespace(megatron_args=["--", *megatron_args], **values)


@pytest.fixture
def user_environ(monkeypatch):
    """The training job's environment without LoRA / patch flags: `preflight_environ`, in this process."""
    kept = preflight_environ()
    for key in list(os.environ):
        if key not in kept:
            monkeypatch.delenv(key)


def assert_passed(report, topology: str, kinds: list) -> None:
    (row,) = report.topologies
    assert report.passed, report.table()
    assert row.topology == topology and row.world_size == 2
    assert set(row.phases) == PHASES
    for metrics in row.phases.values():
        assert metrics.rel_l2 <= metrics.threshold and metrics.per_layer
    assert report.preflight["layers"]["kinds"] == kinds
