"""The real Megatron-LM training loop, end to end (issue 15): pretrained base -> LoRA fine-tune
on five topologies -> resume on another TP -> export -> peft.

`megatron_lm_gpt.py` calls `megatron.training.pretrain` as `pretrain_gpt.py` does and is
started with `torchrun` and Megatron-LM's own arguments; only the environment differs
between runs. A base is pretrained without the LoRA plugin (the CPU testbed alone, from
`loop_testbed/sitecustomize.py`), then fine-tuned from that checkpoint with
`MEGATRON_PLUGINS=lora_correct,cpu_testbed` (the CPU testbed plugin runs Megatron on CPU). Tolerances are the oracle's
fp32 thresholds (`oracle.thresholds`), the negative control is one training step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv

import pytest
import torch

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is absent: megatron-core < 0.17 ships no training loop", allow_module_level=True)

from conftest import clean_environ  # noqa: E402

from megatron_lora_patch.lora.adapters.init import logical_factors
from megatron_lora_patch.lora.checkpoints import source as checkpoint_source
from megatron_lora_patch.lora.config import LoraConfig
from megatron_lora_patch.proof.oracle.thresholds import threshold

# The runs take several optimizer steps: the oracle's thresholds for steps after the first.
LOSS_LIMIT = threshold("fp32", "loss", step=1)
DELTAS_LIMIT = threshold("fp32", "deltas", step=1)
from megatron_lora_patch.proof.testbed.launcher import run_world
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
MOE_ARGS = ["--num-experts", "2", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "allgather"]
TOPOLOGIES = {  # name -> (extra arguments, ranks, data-parallel size)
    "tp1": ([], 1, 1),
    "tp2": (["--tensor-model-parallel-size", "2"], 2, 1),
    "tp2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, 1),
    "pp2": (["--pipeline-model-parallel-size", "2"], 2, 1),
    "dp2-distopt": (["--use-distributed-optimizer"], 2, 2),
}
LORA_ENV = {
    "MEGATRON_PLUGINS": "lora_correct,cpu_testbed",  # cpu_testbed: its cpu_compat patch, Megatron on CPU
    "MEGATRON_LORA_RANK": str(LORA_RANK),
    # Full checkpoints (base included), so the tests below read the base back from every fine-tune;
    # adapter-sized checkpoints, the default, are tests/test_adapter_checkpoints.py's.
    "MEGATRON_LORA_FULL_CHECKPOINTS": "1",
}
TESTBED_ENV = {"PYTHONPATH": str(TESTBED)}
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


def _run(command: list, env: dict, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    environ = clean_environ(CUDA_DEVICE_MAX_CONNECTIONS="1", **env)
    return subprocess.run(
        command + MODEL_ARGS + HOST_ARGS + TRAIN_ARGS,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(cwd),
    )


def _launch(python, ranks: int, args: list, env: dict, record: pathlib.Path) -> subprocess.CompletedProcess:
    """`torchrun` the launch script; each loss-holding rank records its microbatch losses in `record`."""
    record.mkdir()
    command = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(SCRIPT)]
    done = _run(command + args, {**env, "LOOP_RECORD_DIR": str(record)}, record.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _step_losses(record: pathlib.Path, data_parallel: int) -> list:
    """Per-iteration loss (summed loss / tokens over the global batch) from the ranks' records."""
    per_rank = [json.loads((record / f"dp{rank}.json").read_text()) for rank in range(data_parallel)]
    per_step = GLOBAL_BATCH // data_parallel
    steps = len(per_rank[0]) // per_step
    losses = []
    for step in range(steps):
        parts = [entry for rank in per_rank for entry in rank[step * per_step : (step + 1) * per_step]]
        losses.append(sum(loss for loss, _ in parts) / sum(tokens for _, tokens in parts))
    return losses


def _model_tensors(directory) -> dict:
    """The model tensors (full logical, no optimizer state) of a checkpoint directory."""
    from megatron.core import dist_checkpointing

    path = checkpoint_source.resolve(str(directory))
    with checkpoint_source.process_group():
        wanted = {
            k: v for k, v in dist_checkpointing.load_tensors_metadata(path).items() if not k.startswith("optimizer.")
        }
        loaded = dist_checkpointing.load(wanted, path, validate_access_integrity=False)
    return {key: loaded[key] for key in wanted}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    norm = expected.norm().item()
    return (actual - expected).norm().item() / (norm if norm else 1.0)


_FAILED: list = []  # a failing module fixture would run again for every test: fail them at once


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """Every run of the module, once: bases, fine-tunes, resume, --pretrained-checkpoint, MoE."""
    if _FAILED:
        pytest.fail(f"the runs failed (see the first error): {_FAILED[0]}")
    try:
        return _all_runs(tmp_path_factory.mktemp("loop"))
    except BaseException as error:
        _FAILED.append(str(error).splitlines()[0] if str(error) else type(error).__name__)
        raise


def _all_runs(root: pathlib.Path):
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
    for name, (args, ranks, _) in TOPOLOGIES.items():
        runs[name] = _launch(
            sys.executable,
            ranks,
            args + ["--load", str(base), "--finetune", "--save", str(root / name), "--save-interval", "2"],
            LORA_ENV,
            root / f"rec-{name}",
        )
    resumed = root / "resumed"
    shutil.copytree(root / "tp1" / "iter_0000002", resumed / "iter_0000002")
    (resumed / "latest_checkpointed_iteration.txt").write_text("2")
    runs["resumed"] = _launch(
        sys.executable,
        2,
        TOPOLOGIES["tp2"][0] + ["--load", str(resumed), "--save", str(resumed), "--save-interval", "2"],
        LORA_ENV,
        root / "rec-resumed",
    )
    runs["pretrained"] = _launch(
        sys.executable,
        1,
        ["--pretrained-checkpoint", str(base), "--dist-ckpt-strictness", "log_all"],
        LORA_ENV,
        root / "rec-pretrained",
    )
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
    return root, runs


def _initial_adapter(key: str, shape: tuple) -> torch.Tensor:
    """The logical init of a stacked adapter tensor (`lora.init`, default configuration at LORA_RANK):
    axis 0 the layer, for experts axis 1 the expert."""
    module, factor = key.rsplit(".lora.", 1)
    config = LoraConfig(rank=LORA_RANK)
    in_features, out_features = (shape[-1], 1) if factor == "A" else (1, shape[-2])

    def init(name, expert):
        return logical_factors(config, name, expert, in_features, out_features)[0 if factor == "A" else 1]

    layers = []
    for layer in range(shape[0]):
        name = module.replace("decoder.layers.", f"decoder.layers.{layer}.", 1)
        if len(shape) == 4:  # the stacked key's expert path differs between versions; the name does not
            linear = name.rsplit(".", 1)[1]
            experts = [f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}" for e in range(shape[1])]
            layers.append(torch.stack([init(expert, e) for e, expert in enumerate(experts)]))
        else:
            layers.append(init(name, None))
    return torch.stack(layers)


def _deltas(tensors: dict) -> dict:
    """Adapter tensor -> its change from the logical init (what training did)."""
    return {key: value - _initial_adapter(key, tuple(value.shape)) for key, value in tensors.items() if ".lora." in key}


def _output(done: subprocess.CompletedProcess) -> str:
    return done.stdout + done.stderr


def test_plugin_unset_equals_the_package_not_installed(loop):
    root, runs = loop
    assert _step_losses(root / "rec-base", 1) == _step_losses(root / "rec-base-not-installed", 1)
    installed, absent = _model_tensors(root / "base"), _model_tensors(root / "base-not-installed")
    assert installed.keys() == absent.keys() and not any(".lora." in key for key in installed)
    assert all(torch.equal(installed[key], absent[key]) for key in installed)


@pytest.mark.parametrize("name", [*TOPOLOGIES, "moe"])
def test_only_adapters_train_and_the_base_stays_as_saved(loop, name):
    root, runs = loop
    base = _model_tensors(root / ("moe-base" if name == "moe" else "base"))
    tuned = _model_tensors(root / name)
    adapters = {key: value for key, value in tuned.items() if ".lora." in key}
    assert {key: tuned[key] for key in tuned if key not in adapters}.keys() == base.keys()
    assert all(torch.equal(tuned[key], base[key]) for key in base), "a base weight changed"
    modules = {key.rsplit(".lora.", 1)[0].rsplit(".", 1)[-1] for key in adapters}
    assert modules == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    assert all(value.abs().max() > 0 for key, value in _deltas(adapters).items()), "an adapter did not train"
    if name == "moe":
        assert any(".experts." in key for key in adapters)
    assert _output(runs[name]).count(BASE_INFO) == 1


@pytest.mark.parametrize("name", [name for name in TOPOLOGIES if name != "tp1"])
def test_topologies_agree_with_tp1(loop, name):
    root, runs = loop
    reference = _step_losses(root / "rec-tp1", 1)
    losses = _step_losses(root / f"rec-{name}", TOPOLOGIES[name][2])
    assert len(losses) == ITERATIONS
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) <= LOSS_LIMIT
    expected, actual = _deltas(_model_tensors(root / "tp1")), _deltas(_model_tensors(root / name))
    assert expected.keys() == actual.keys()
    assert max(_relative(actual[key], expected[key]) for key in expected) <= DELTAS_LIMIT


def test_one_step_of_training_is_far_outside_the_tolerance(loop):
    """Negative control: the adapters after 2 and 4 steps differ by >= 100x the delta threshold."""
    root, _ = loop
    early = _deltas(_model_tensors(root / "tp1" / "iter_0000002"))
    final = _deltas(_model_tensors(root / "tp1"))
    assert max(_relative(early[key], final[key]) for key in final) >= 100 * DELTAS_LIMIT


def test_resume_on_tp2_equals_the_uninterrupted_tp1_run(loop):
    root, runs = loop
    reference = _step_losses(root / "rec-tp1", 1)[2:]
    losses = _step_losses(root / "rec-resumed", 1)
    assert len(losses) == 2
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) <= LOSS_LIMIT
    expected, actual = _deltas(_model_tensors(root / "tp1")), _deltas(_model_tensors(root / "resumed"))
    assert max(_relative(actual[key], expected[key]) for key in expected) <= DELTAS_LIMIT
    assert BASE_INFO not in _output(runs["resumed"])


def test_pretrained_checkpoint_at_log_all_strictness_equals_load_finetune(loop):
    root, runs = loop
    assert _step_losses(root / "rec-pretrained", 1) == _step_losses(root / "rec-tp1", 1)
    assert _output(runs["pretrained"]).count(BASE_INFO) == 1


def one_rank(args: list, env: dict, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """The launch script as one plain process (no torchrun), with the world variables torchrun sets."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return _run([sys.executable, str(SCRIPT), *args], {**env, **world}, cwd)


def assert_stops_before_training(done: subprocess.CompletedProcess, message: str) -> None:
    """The process stopped before any step with this one message (torch.distributed prefixes "[rank0]: ")."""
    assert done.returncode == 1, done.stderr[-3000:]
    assert sum(line.endswith(message) for line in done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert "iteration        1/" not in done.stdout


def test_adapters_of_another_rank_stop_the_load_with_one_line(loop):
    root, _ = loop
    done = one_rank(["--load", str(root / "tp1"), "--finetune"], {**LORA_ENV, "MEGATRON_LORA_RANK": "8"}, root)
    mine = "rank 8 on linear_fc1, linear_fc2, linear_proj, linear_qkv"
    theirs = "rank 4 on linear_fc1, linear_fc2, linear_proj, linear_qkv"
    message = (
        f"the LoRA adapters in {root / 'tp1' / 'iter_0000004'} ({theirs}) do not match this run's ({mine}); "
        "set MEGATRON_LORA_RANK and MEGATRON_LORA_TARGETS as when it was saved, "
        "or fine-tune from a base checkpoint without adapters"
    )
    assert_stops_before_training(done, message)


def export_matches_megatron(root: pathlib.Path, checkpoint: pathlib.Path, base: pathlib.Path) -> None:
    """`megatron-lora-patch export` of `checkpoint` (a --save directory) loads in peft onto the base
    weights of `base` and gives Megatron's logits (and not the base's)."""
    import hf_llama
    import loop_worker
    import persistence_worker
    from peft import PeftModel

    peft_dir = root / f"peft-{checkpoint.name}"
    command = [
        sys.executable,
        "-m",
        "megatron_lora_patch",
        "export",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(peft_dir),
    ]
    done = subprocess.run(command, cwd=str(root), capture_output=True, text=True, env=clean_environ())
    assert done.returncode == 0, done.stderr
    weights = loop_worker.testbed_weights(_model_tensors(base), SPEC)
    (megatron,) = run_world(
        loop_worker.logits_world,
        1,
        args=(SPEC, weights, checkpoint_source.resolve(str(checkpoint)), LORA_RANK),
        name="tp1",
    )
    tokens, _ = persistence_worker.batch(SPEC)
    base_model = hf_llama.llama_for(SPEC, 0, weights)
    with torch.no_grad():
        base_logits = base_model(tokens).logits
        peft_logits = PeftModel.from_pretrained(base_model, str(peft_dir)).eval()(tokens).logits
    tolerance = 1e-5  # max-abs error relative to the largest logit, fp32 (as tests/test_persistence_peft.py)
    assert ((peft_logits - megatron).abs().max() / megatron.abs().max()).item() <= tolerance
    assert ((base_logits - megatron).abs().max() / megatron.abs().max()).item() > 100 * tolerance


def test_export_of_the_final_checkpoint_loads_in_peft_and_matches_megatron(loop):
    root, _ = loop
    export_matches_megatron(root, root / "tp1", root / "tp1")
