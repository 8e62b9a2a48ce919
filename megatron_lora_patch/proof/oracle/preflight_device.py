"""Where a preflight's ranks run (docs/preflight.md, "On GPUs"): on CPU with gloo and the CPU stand-ins (what CI
runs), or on this node's GPUs with NCCL, one rank per GPU, with your kernels, fusion flags and layer spec. The code
path is the same; only device and backend differ. What a CUDA preflight cannot run on this node is refused in one
line before any rank starts."""

from __future__ import annotations

import argparse
import importlib.util

from megatron_lora_patch.runtime.errors import UsageError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(choice: str) -> str:
    """"cpu" or "cuda" for `--device` auto | cpu | cuda (auto: cuda where torch sees a GPU)."""
    if choice not in DEVICES:
        raise UsageError(f"--device {choice!r}: use one of {', '.join(DEVICES)}")
    if choice == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if choice == "cuda":
        raise UsageError(
            "--device cuda: torch sees no CUDA device on this node; run on a GPU node, or use --device cpu"
        )
    return "cpu"


def check_world(world_size: int, device: str, mutation, args: argparse.Namespace) -> None:
    """One UsageError for a world this device cannot run or compare: one rank on CPU compares nothing (a mutation
    aside); on CUDA every rank needs its own GPU and the kernels your arguments ask for."""
    if device == "cpu":
        if world_size == 1 and mutation is None:
            raise UsageError(
                "your arguments run on one rank, so there is nothing to compare with world size 1; pass your "
                "parallel sizes (--tensor-model-parallel-size, --pipeline-model-parallel-size, ...) or "
                "--data-parallel-size N before -- (on a GPU node, --device cuda also checks one rank's kernels)"
            )
        return
    import torch

    gpus = torch.cuda.device_count()
    if world_size > gpus:
        raise UsageError(
            f"your topology runs {world_size} ranks and this node has {gpus} GPU(s) (one rank per GPU: NCCL refuses "
            f"two ranks on one device); run the preflight on a node with {world_size} GPUs, or with --device cpu"
        )
    _check_kernels(args)


#: (does the run need it, module, what needs it, the fix): kernels your arguments ask for that a node may lack.
KERNELS = (
    (
        lambda args: args.transformer_impl == "transformer_engine",
        "transformer_engine",
        "Transformer Engine's layers (--transformer-impl transformer_engine, Megatron-LM's default)",
        "install it, or add --transformer-impl local",
    ),
    (
        lambda args: args.gradient_accumulation_fusion and args.transformer_impl == "local",
        "fused_weight_gradient_mlp_cuda",
        "--gradient-accumulation-fusion (Megatron-LM's default) with --transformer-impl local: APEX's kernel",
        "install APEX, or add --no-gradient-accumulation-fusion",
    ),
    (
        lambda args: not args.no_persist_layer_norm and args.transformer_impl == "local",
        "apex",
        "the persistent layer norm (Megatron-LM's default) with --transformer-impl local: APEX's kernel",
        "install APEX, or add --no-persist-layer-norm",
    ),
    (
        lambda args: args.masked_softmax_fusion and args.transformer_impl == "local",
        "scaled_masked_softmax_cuda",
        "--masked-softmax-fusion (Megatron-LM's default) with --transformer-impl local: Megatron's legacy kernels",
        "build them from Megatron-LM's source tree, or add --no-masked-softmax-fusion",
    ),
)


def _check_kernels(args: argparse.Namespace) -> None:
    """Refuse, naming the flag, what your arguments ask of kernels this node lacks (Megatron would fail later,
    inside a rank, with a traceback)."""
    for needed, module, what, fix in KERNELS:
        if needed(args) and not _importable(module):
            raise UsageError(f"your arguments use {what}, and {module} is not installed on this node; {fix}")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
