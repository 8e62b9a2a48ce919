"""Megatron-LM's own training loop under `torchrun`, as tests/test_megatron_lm_loop.py runs it: the tiny model's
arguments, the topologies, the LoRA environment, the launchers and the loop test's runs (shared by other tests).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

from conftest import clean_environ

from megatron_lora_patch.proof.testbed.models import TinyGPTSpec

TESTS = pathlib.Path(__file__).parent
SCRIPT = TESTS / "megatron_lm_gpt.py"
TESTBED = TESTS / "loop_testbed"
SPEC = TinyGPTSpec()
LORA_RANK = 4
ITERATIONS, GLOBAL_BATCH = 4, 4
MODEL_ARGS = [
    "--num-layers",
    str(SPEC.num_layers),
    "--hidden-size",
    str(SPEC.hidden_size),
    "--num-attention-heads",
    str(SPEC.num_attention_heads),
    "--group-query-attention",
    "--num-query-groups",
    str(SPEC.num_query_groups),
    "--ffn-hidden-size",
    str(SPEC.ffn_hidden_size),
    "--swiglu",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--seq-length",
    str(SPEC.seq_length),
    "--max-position-embeddings",
    str(SPEC.seq_length),
    "--vocab-size",
    str(SPEC.vocab_size),
    "--make-vocab-size-divisible-by",
    "1",
]
# What a CPU / non-TE run needs beyond the usual arguments (the README's "Fine-tune with Megatron-LM").
HOST_ARGS = [
    "--transformer-impl",
    "local",
    "--no-rope-fusion",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--distributed-backend",
    "gloo",
    "--use-cpu-initialization",
    "--eval-iters",
    "0",
    "--eval-interval",
    "1000",
]
TRAIN_ARGS = [
    "--tokenizer-type",
    "NullTokenizer",
    "--mock-data",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    str(GLOBAL_BATCH),
    "--train-iters",
    str(ITERATIONS),
    "--lr",
    "1e-2",
    "--lr-decay-style",
    "constant",
    "--weight-decay",
    "0",
    "--clip-grad",
    "1.0",
    "--seed",
    "1234",
    "--ckpt-format",
    "torch_dist",
    "--log-interval",
    "1",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]
SFT_DOCUMENTS = 64  # documents of 2 to 12 tokens: about 450 tokens, reused over the epochs GPTDataset needs
SFT_DATA_FLAGS = ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
MOE_ARGS = ["--num-experts", "2", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"]
#: Megatron-LM's asynchronous save: its persistent worker writes while the next steps run (without
#: nvidia-resiliency-ext, the `mcore` strategy; on the host, `cpu_testbed/async_save.py`)
ASYNC_SAVE = ["--async-save", "--use-persistent-ckpt-worker", "--async-strategy", "mcore"]
#: what Megatron-LM logs for each save it hands to the worker (a run without it saved synchronously)
ASYNC_SAVED = "an async checkpoint save at iteration"
TOPOLOGIES = {  # name -> (extra arguments, ranks, data-parallel size)
    "tp1": ([], 1, 1),
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 1),
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2, 1),
    # the testbed's CP core attention stands in for TE's (`megatron_lm_gpt_steps.layer_spec`)
    "cp2": (["--context-parallel-size", "2"], 2, 1),
    # with the overlap options GPU users run it with (the adapters' param gather: lora/training/param_sync.py) and
    # their asynchronous save (each DP rank's worker writes its part of the fully parallel save)
    "dp2-distopt": (
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", *ASYNC_SAVE], 2, 2
    ),
}
LORA_ENV = {
    "MEGATRON_PLUGINS": "lora_correct,cpu_testbed",  # cpu_testbed: its cpu_compat patch, Megatron on CPU
    "MEGATRON_LORA_RANK": str(LORA_RANK),
    # Full checkpoints (base included), so the loop tests read the base back from every fine-tune;
    # adapter-sized checkpoints, the default, are tests/test_adapter_checkpoints.py's.
    "MEGATRON_LORA_FULL_CHECKPOINTS": "1",
}
TESTBED_ENV = {"PYTHONPATH": str(TESTBED)}
# Megatron-LM's fused element-wise functions (bias-dropout-add, SwiGLU: `megatron.core.jit.jit_fuser`, which is
# torch.compile) cost every rank process about 6.5 s of dynamo + inductor tracing on this CPU, half a short launch.
# The launches run them eagerly (the same functions on the same path, torch.compile skipped) unless `env` says
# otherwise; the loop's tp1 fine-tune keeps them compiled, as users run them (`COMPILED_FUSIONS`).
EAGER_FUSIONS = {"TORCH_COMPILE_DISABLE": "1"}
COMPILED_FUSIONS = {"TORCH_COMPILE_DISABLE": "0"}
BASE_INFO = "holds no adapters (a base checkpoint): the base weights load as saved"


def _python_without_the_package(root: pathlib.Path) -> pathlib.Path:
    """An interpreter that sees this environment's packages as plain paths: the package's `.pth`
    start-up hook never runs, which is what "not installed" means for a Megatron process."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
    python = root / "bin" / "python"
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    )
    stdlib = sysconfig.get_paths()["stdlib"]
    paths = [p for p in sys.path if p and "site-packages" in p and os.path.isdir(p) and not p.startswith(stdlib)]
    (pathlib.Path(purelib.strip()) / "zz_dependencies.pth").write_text("\n".join(paths) + "\n")
    return python


def _run(
    command: list, env: dict, cwd: pathlib.Path, overrides: tuple = (), model: tuple = tuple(MODEL_ARGS)
) -> subprocess.CompletedProcess:
    """`command` with the model's Megatron-LM arguments (`model`: the tiny GPT's unless given; then `overrides`,
    which replace them), in a clean environment plus `env` (fusions eager unless `env` says: `EAGER_FUSIONS`)."""
    environ = clean_environ(**{"CUDA_DEVICE_MAX_CONNECTIONS": "1", **EAGER_FUSIONS, **env})
    train = TRAIN_ARGS
    if "--data-path" in command + list(overrides):  # documents instead of mock data (`sft_data_args`)
        train = [argument for argument in TRAIN_ARGS if argument != "--mock-data"]
    return subprocess.run(
        command + list(model) + HOST_ARGS + train + list(overrides),
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(cwd),
    )


def _launch(
    python,
    ranks: int,
    args: list,
    env: dict,
    record: pathlib.Path,
    overrides: tuple = (),
    model: tuple = tuple(MODEL_ARGS),
) -> subprocess.CompletedProcess:
    """`torchrun` the launch script (`model`: the model's arguments, the tiny GPT's unless given); each loss-holding
    rank records its microbatch losses in `record`."""
    record.mkdir()
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(SCRIPT)]
    done = _run(command + args, {**env, "LOOP_RECORD_DIR": str(record)}, record.parent, overrides, model)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def one_rank(args: list, env: dict, cwd: pathlib.Path, overrides: tuple = ()) -> subprocess.CompletedProcess:
    """The launch script as one plain process (no torchrun), with the world variables torchrun sets; `overrides`
    come after the tiny model's arguments (e.g. `("--hidden-dropout", "0.1")`)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return _run([sys.executable, str(SCRIPT), *args], {**env, **world}, cwd, overrides)


def assert_stops_before_training(done: subprocess.CompletedProcess, message: str) -> None:
    """The process stopped before any step with this one message (torch.distributed prefixes "[rank0]: ")."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert sum(line.endswith(message) for line in done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert "iteration        1/" not in done.stdout


def _all_runs(root: pathlib.Path):
    """Every run of the loop tests, in order: bases, fine-tunes, resume, --pretrained-checkpoint, MoE."""
    runs = _base_runs(root)
    runs.update(_fine_tune_runs(root, root / "base"))
    runs.update(_moe_runs(root))
    return root, runs


def _base_runs(root: pathlib.Path) -> dict:
    """The base without LoRA, twice: with the package installed (plugin unset) and with it not installed."""
    runs = {}
    base = root / "base"
    runs["base"] = _launch(
        sys.executable, 1, ["--save", str(base), "--save-interval", str(ITERATIONS)], TESTBED_ENV, root / "rec-base"
    )
    not_installed = _python_without_the_package(root / "not-installed")
    runs["base-not-installed"] = _launch(
        not_installed,
        1,
        ["--save", str(root / "base-not-installed"), "--save-interval", str(ITERATIONS)],
        TESTBED_ENV,
        root / "rec-base-not-installed",
    )
    return runs


def sft_data_args(root: pathlib.Path) -> list:
    """Fine-tuning data as SFT users feed Megatron-LM today: an indexed dataset of short documents (2 to 12 tokens,
    each ending in EOD) that GPTDataset packs into every row, with `--reset-position-ids --reset-attention-mask
    --eod-mask-loss` (attention restarts at each document, EOD leaves the loss): the valid tokens differ per
    microbatch and per DP rank, so only a global token normalization makes the topologies agree."""
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = root / "sft-documents"
    eod = SPEC.vocab_size - 1  # the core NullTokenizer (0.17+) counts EOD in `--vocab-size` (the test sees masks act)
    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=numpy.int32)
    for length in rng.integers(2, 13, size=SFT_DOCUMENTS):
        builder.add_document(numpy.append(rng.integers(0, eod, size=length - 1), eod).astype(numpy.int32), [length])
    builder.finalize(f"{prefix}.idx")
    return ["--data-path", str(prefix), "--split", "100,0,0", *SFT_DATA_FLAGS]


def _fine_tune_runs(root: pathlib.Path, base: pathlib.Path) -> dict:
    """LoRA on `base` on every topology, tp1's iteration 2 resumed on TP2, and --pretrained-checkpoint, all on the
    SFT data of `sft_data_args`."""
    runs = {}
    data = sft_data_args(root)
    for name, (args, ranks, _) in TOPOLOGIES.items():
        runs[name] = _launch(
            sys.executable,
            ranks,
            args + data + ["--load", str(base), "--finetune", "--save", str(root / name), "--save-interval", "2"],
            {**LORA_ENV, **(COMPILED_FUSIONS if name == "tp1" else {})},
            root / f"rec-{name}",
        )
    # The control: tp1's first two steps with Megatron-LM's own normalization (each microbatch by its own tokens)
    runs["per-microbatch"] = _launch(
        sys.executable,
        1,
        data + ["--load", str(base), "--finetune", "--save", str(root / "per-microbatch"), "--save-interval", "2"],
        {**LORA_ENV, "MEGATRON_LORA_DISABLED_PATCHES": "loss_normalization"},
        root / "rec-per-microbatch",
        overrides=("--train-iters", "2"),
    )
    resumed = root / "resumed"
    shutil.copytree(root / "tp1" / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    runs["resumed"] = _launch(
        sys.executable,
        2,
        TOPOLOGIES["tp2"][0] + data + ["--load", str(resumed), "--save", str(resumed), "--save-interval", "2"],
        LORA_ENV,
        root / "rec-resumed",
    )
    runs["pretrained"] = _launch(
        sys.executable,
        1,
        data + ["--pretrained-checkpoint", str(base), "--dist-ckpt-strictness", "log_all"],
        LORA_ENV,
        root / "rec-pretrained",
    )
    return runs


def _moe_runs(root: pathlib.Path) -> dict:
    """A MoE base without LoRA, then LoRA (experts included) fine-tuned on it."""
    runs = {}
    runs["moe-base"] = _launch(
        sys.executable,
        1,
        MOE_ARGS + ["--save", str(root / "moe-base"), "--save-interval", str(ITERATIONS)],
        TESTBED_ENV,
        root / "rec-moe-base",
    )
    runs["moe"] = _launch(
        sys.executable,
        1,
        MOE_ARGS
        + [
            "--load",
            str(root / "moe-base"),
            "--finetune",
            "--save",
            str(root / "moe"),
            "--save-interval",
            str(ITERATIONS),
        ],
        LORA_ENV,
        root / "rec-moe",
    )
    return runs
