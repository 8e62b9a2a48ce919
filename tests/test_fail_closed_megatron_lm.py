"""Fail closed where a LoRA run of Megatron-LM's training loop resumes and loads (issue 35): one line, a
non-zero exit, no step and every file as it was (docs/checkpoints.md sections 3-4).

Megatron-LM's own loop (`megatron_lm_gpt.py`, one process): one tiny base (pretrained without LoRA) and
one LoRA run on it with the README's `--load BASE --finetune --save LORA` (adapter-sized checkpoint of
iteration 4), shared by every case. The guards' decisions themselves are checked in-process first, the checkpoint
formats a LoRA run cannot save or load by too (a legacy `torch`-format base, another `--ckpt-format`, local
non-persistent checkpoints); the legacy base then also through the loop, with the conversion its line names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys
import types

import pytest
from conftest import run_fresh

if importlib.util.find_spec("megatron.training") is None:
    pytest.skip("megatron.training is absent: megatron-core < 0.17 ships no training loop", allow_module_level=True)

from megatron_lm_runs import LORA_ENV, TESTBED_ENV, _launch, assert_stops_before_training, one_rank  # noqa: E402

from megatron_lora_patch.lora.checkpoints import guards  # noqa: E402
from megatron_lora_patch.lora.checkpoints.workflow import BaseCheckpointError  # noqa: E402

ENV = {key: value for key, value in LORA_ENV.items() if key != "MEGATRON_LORA_FULL_CHECKPOINTS"}
FIX = "pass the directory the base checkpoint was saved to (--save)"


def _args(**given) -> types.SimpleNamespace:
    """Megatron-LM arguments as the guards read them (after the load: `iteration` is where the run starts)."""
    values = {"load": None, "save": None, "pretrained_checkpoint": None, "finetune": False, "iteration": 0,
              "ckpt_format": "torch_dist", "non_persistent_ckpt_type": None}
    return types.SimpleNamespace(**{**values, **given})


def _save_dir(root: pathlib.Path, latest: str = "4") -> pathlib.Path:
    (root / "lora").mkdir()
    (root / "lora" / "latest_checkpointed_iteration.txt").write_text(latest + "\n")
    return root / "lora"


def test_a_save_directory_is_accepted_only_when_the_run_resumed_from_it(tmp_path):
    lora = _save_dir(tmp_path)
    guards.check_save_directory(_args(load=str(lora), save=str(lora), iteration=4))  # the resume
    guards.check_save_directory(_args(load=str(tmp_path / "base"), finetune=True, save=str(tmp_path / "new")))
    refused = (  # (the run, the iteration it starts at)
        (_args(load=str(tmp_path), finetune=True, save=str(lora)), 1),  # fine-tuned from a base again
        (_args(load=str(lora), finetune=True, save=str(lora)), 1),  # --finetune from its own checkpoint
        (_args(load=str(lora), save=str(lora), iteration=2), 3),  # an older iteration (--ckpt-step 2)
        (_args(load=str(tmp_path), save=str(lora), iteration=4), 5),  # another run's iteration 4
    )
    for args, start in refused:
        with pytest.raises(BaseCheckpointError, match=rf"iteration 4, which this run \(starting at iteration {start}"):
            guards.check_save_directory(args)


def test_the_refusal_names_the_resume_command_with_the_base_it_was_given(tmp_path):
    lora = _save_dir(tmp_path)
    for args, base in (
        (_args(load=str(tmp_path), finetune=True, save=str(lora)), str(tmp_path)),
        (_args(pretrained_checkpoint="/b", save=str(lora)), "/b"),
        (_args(load=str(lora), finetune=True, save=str(lora)), "BASE_DIR"),
    ):
        with pytest.raises(BaseCheckpointError) as caught:
            guards.check_save_directory(args)
        assert str(caught.value).endswith(
            f"to resume it pass --pretrained-checkpoint {base} --load {lora}, to start over pass a new --save directory"
        )


def test_a_pretrained_checkpoint_must_hold_a_checkpoint(tmp_path):
    saved = _save_dir(tmp_path)
    iteration = saved / "iter_0000004"
    iteration.mkdir()
    (iteration / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (tmp_path / "file").write_text("")
    guards.check_pretrained(_args(pretrained_checkpoint=str(saved)))
    guards.check_pretrained(_args(pretrained_checkpoint=str(iteration), load=str(saved)))  # on resume
    refused = {
        str(tmp_path / "missing"): "does not exist",
        str(tmp_path / "file"): "is a file, not a checkpoint directory",
        str(tmp_path): "holds no checkpoint (no latest_checkpointed_iteration.txt)",
        str(iteration): f"is an iteration directory; Megatron-LM starts from its --save directory {saved}",
    }
    for path, problem in refused.items():
        with pytest.raises(BaseCheckpointError) as caught:
            guards.check_pretrained(_args(pretrained_checkpoint=path))
        assert str(caught.value) == f"--pretrained-checkpoint {path} {problem}; {FIX}"


def _checkpoint(root: pathlib.Path, latest: str, legacy: bool) -> pathlib.Path:
    """A checkpoint directory whose iteration `latest` is a torch-format (legacy) or a distributed checkpoint."""
    root.mkdir()
    saved = _save_dir(root, latest)
    iteration = saved / ("release" if latest == "release" else f"iter_{int(latest):07d}")
    if legacy:
        (iteration / "mp_rank_00").mkdir(parents=True)
        (iteration / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    else:
        iteration.mkdir()
        (iteration / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    return saved


def _legacy_refusal(flag: str, path, iteration) -> str:
    return (
        f"{flag} {path} holds a torch-format checkpoint ({iteration}), which a LoRA run cannot take its base from; "
        f"convert it once without MEGATRON_PLUGINS (your model's arguments and --load {path} --ckpt-format torch "
        "--ckpt-convert-format torch_dist --ckpt-convert-save NEW_DIR) and pass NEW_DIR/torch_dist"
    )


@pytest.mark.parametrize("latest", ["4", "release"])
def test_a_base_in_the_legacy_torch_format_is_refused_naming_the_conversion(tmp_path, latest):
    legacy = _checkpoint(tmp_path / "legacy", latest, legacy=True)
    distributed = _checkpoint(tmp_path / "dist", latest, legacy=False)
    iteration = legacy / ("release" if latest == "release" else "iter_0000004")
    guards.check_checkpoint_formats(_args(load=str(distributed), finetune=True, save=str(tmp_path / "new")))
    for flag, args in (("--load", _args(load=str(legacy), finetune=True)),
                       ("--pretrained-checkpoint", _args(load=str(distributed), pretrained_checkpoint=str(legacy)))):
        with pytest.raises(BaseCheckpointError) as caught:
            guards.check_checkpoint_formats(args)
        assert str(caught.value) == _legacy_refusal(flag, legacy, iteration)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dcp", "fsdp_dtensor"])
def test_a_save_in_another_format_than_torch_dist_is_refused(tmp_path, ckpt_format):
    guards.check_checkpoint_formats(_args(ckpt_format=ckpt_format))  # no --save: the format writes nothing
    with pytest.raises(BaseCheckpointError) as caught:
        guards.check_checkpoint_formats(_args(save=str(tmp_path), ckpt_format=ckpt_format))
    assert str(caught.value) == (
        f"--ckpt-format {ckpt_format} cannot save a LoRA run: its checkpoints are distributed ones, adapter-sized "
        "and loadable on any topology; pass --ckpt-format torch_dist (the default)"
    )


@pytest.mark.parametrize("linear", [True, False])
def test_the_formats_are_checked_only_for_a_run_that_builds_adapters(linear):
    """With `lora_linear` off the plugin builds no adapters, and the checkpoint formats are the user's own business."""
    script = (
        "import megatron_lora_patch; "
        f"megatron_lora_patch.apply(plugins=['lora_correct'], enable={{'lora_linear': {linear}}}); "
        "from megatron_lora_patch.lora.checkpoints import guards; print(guards._adapters_requested())"
    )
    done = run_fresh(["-c", script])
    assert done.returncode == 0 and done.stdout.split() == [str(linear)], done.stderr[-3000:]


@pytest.mark.parametrize("adapters", [True, False])
def test_setup_checks_the_formats_only_when_adapters_are_built(monkeypatch, tmp_path, adapters):
    """The wiring of `setup_model_and_optimizer`: a `--ckpt-format torch` save stops the LoRA run before the model is
    built, and is left to Megatron-LM in a run whose plugin builds no adapters (`lora_linear` off)."""
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "get_args", lambda: _args(save=str(tmp_path), ckpt_format="torch"))
    monkeypatch.setattr(guards, "_adapters_requested", lambda: adapters)
    built = []

    def build():  # Megatron-LM's setup_model_and_optimizer, as wrapt hands it over
        built.append("model")
        return "built"

    if adapters:
        with pytest.raises(BaseCheckpointError, match=r"^--ckpt-format torch cannot save a LoRA run"):
            guards.setup_model_and_optimizer(build, None, (), {})
    else:
        assert guards.setup_model_and_optimizer(build, None, (), {}) == "built"
    assert built == ([] if adapters else ["model"])


def test_local_non_persistent_checkpoints_are_refused():
    guards.check_checkpoint_formats(_args(non_persistent_ckpt_type="global"))
    with pytest.raises(BaseCheckpointError, match=r"^--non-persistent-ckpt-type local is not supported for a LoRA run"):
        guards.check_checkpoint_formats(_args(non_persistent_ckpt_type="local"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base and the README's first fine-tune on it: `--load BASE --finetune --save LORA` (iteration 4)."""
    root = tmp_path_factory.mktemp("fail-closed-mlm")
    _launch(sys.executable, 1, ["--save", str(root / "base"), "--save-interval", "4"], TESTBED_ENV, root / "rec-base")
    _launch(sys.executable, 1, _finetune(root), ENV, root / "rec-lora")
    return root


def _finetune(root: pathlib.Path, base="base", save: str = "lora") -> list:
    """The README's first fine-tune: `--load BASE --finetune --save LORA` (directories under `root`)."""
    return ["--load", str(root / base), "--finetune", "--save", str(root / save), "--save-interval", "4"]


def _tree(directory: pathlib.Path) -> dict:
    """Every path under `directory` and, for files, their bytes and modification time."""
    return {
        path.relative_to(directory): (path.read_bytes(), path.stat().st_mtime_ns) if path.is_file() else None
        for path in directory.rglob("*")
    }


def test_rerunning_the_finetune_command_stops_and_leaves_its_checkpoint_as_it_was(runs):
    lora, base = runs / "lora", runs / "base"
    before = _tree(lora)
    assert any(path.suffix == ".distcp" for path in before), sorted(before)  # the tensors of iteration 4
    done = one_rank(_finetune(runs), ENV, runs)
    assert_stops_before_training(
        done,
        f"--save {lora} already holds the checkpoint of iteration 4, which this run (starting at iteration 1) would "
        f"overwrite; to resume it pass --pretrained-checkpoint {base} --load {lora}, to start over pass a new "
        "--save directory",
    )
    assert _tree(lora) == before  # the same files, byte for byte, never rewritten, and nothing new


def _resume(runs: pathlib.Path, base: pathlib.Path):
    """Resume the fine-tune (iteration 4 of 4: no step is left) naming `base` as its base."""
    return one_rank(["--pretrained-checkpoint", str(base), "--load", str(runs / "lora")], ENV, runs)


def test_a_mistyped_pretrained_checkpoint_stops_the_resume(runs):
    wrong = runs / "bsae"
    assert_stops_before_training(_resume(runs, wrong), f"--pretrained-checkpoint {wrong} does not exist; {FIX}")


def test_another_base_than_the_recorded_one_stops_the_resume_naming_both(runs):
    copy, recorded = runs / "base-copy", runs / "base" / "iter_0000004"
    shutil.copytree(runs / "base", copy)
    assert_stops_before_training(
        _resume(runs, copy),
        f"--pretrained-checkpoint {copy} ({copy / 'iter_0000004'}) is not the base {runs / 'lora' / 'iter_0000004'} "
        f"was trained on ({recorded}, recorded in the checkpoint); pass --pretrained-checkpoint {recorded} or "
        "leave it out",
    )


def test_the_recorded_base_spelled_another_way_resumes(runs):
    """A symlink to the recorded base is the same checkpoint: the run loads the base through it."""
    link = runs / "base-link"
    os.symlink(runs / "base", link)
    done = _resume(runs, link)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"its 9 frozen base tensors load from {link / 'iter_0000004'}" in done.stdout + done.stderr


def test_a_pretrained_checkpoint_that_does_not_exist_stops_a_fresh_start(runs):
    wrong = runs / "nonexistent"
    done = one_rank(["--pretrained-checkpoint", str(wrong), "--save", str(runs / "new"), "--save-interval", "4"],
                    ENV, runs)
    assert_stops_before_training(done, f"--pretrained-checkpoint {wrong} does not exist; {FIX}")
    assert not (runs / "new").exists()


@pytest.mark.parametrize("start", ["fresh", "resume"])
def test_a_base_of_another_hidden_size_stops_with_the_shapes(runs, start):
    args = ["--load", str(runs / "base"), "--finetune"] if start == "fresh" else ["--load", str(runs / "lora")]
    done = one_rank(args, ENV, runs, overrides=("--hidden-size", "32"))
    assert_stops_before_training(
        done,
        f"the base weights in {runs / 'base' / 'iter_0000004'} do not fit this model: embedding.word_embeddings.weight "
        "has shape (128, 64) there but (128, 32) here (13 tensors differ); build the model with the arguments the "
        "base was saved with (--hidden-size, --num-layers, ...)",
    )


def test_a_layout_invariant_refusal_is_one_line(runs):
    """Megatron-LM's default --hidden-dropout 0.1 under the layout-invariant mode."""
    env = {**ENV, "MEGATRON_LORA_PATCH_LAYOUT_INVARIANT": "1"}
    done = one_rank(["--load", str(runs / "base"), "--finetune"], env, runs, overrides=("--hidden-dropout", "0.1"))
    assert_stops_before_training(
        done,
        "layout_invariant: dropout draws its masks per rank and per local microbatch; set hidden_dropout=0 and "
        "attention_dropout=0",
    )


def test_full_checkpoints_with_trainable_only_stop_before_any_step_and_any_save(runs):
    save = runs / "full"
    args = ["--load", str(runs / "base"), "--finetune", "--save", str(save), "--save-interval", "4",
            "--save-trainable-params-only"]
    done = one_rank(args, {**ENV, "MEGATRON_LORA_FULL_CHECKPOINTS": "1"}, runs)
    assert_stops_before_training(
        done,
        "MEGATRON_LORA_FULL_CHECKPOINTS=1 keeps full checkpoints but --save-trainable-params-only asks for "
        "adapter-only ones; drop one of them",
    )
    assert not save.exists()


def test_a_legacy_base_stops_the_finetune_and_its_conversion_trains_as_the_distributed_base(runs):
    """The base in Megatron-LM's legacy `torch` format (what its HF converter writes by default) stops the
    README's first fine-tune with one line; the conversion that line names (one run without the plugin) gives a base
    whose fine-tune logs the same losses, bit for bit, as the fine-tune of the same base saved as `torch_dist`."""
    legacy, converted = runs / "legacy", runs / "converted"
    _launch(sys.executable, 1, ["--save", str(legacy), "--save-interval", "4"], TESTBED_ENV, runs / "rec-legacy",
            overrides=("--ckpt-format", "torch"))
    refused = one_rank(_finetune(runs, "legacy", "from-legacy"), ENV, runs)
    assert_stops_before_training(refused, _legacy_refusal("--load", legacy, legacy / "iter_0000004"))
    assert not (runs / "from-legacy").exists()
    conversion = ["--load", str(legacy), "--ckpt-format", "torch", "--ckpt-convert-format", "torch_dist",
                  "--ckpt-convert-save", str(converted)]
    done = one_rank([], TESTBED_ENV, runs, overrides=tuple(conversion))
    assert done.returncode == 0, done.stderr[-3000:]
    _launch(sys.executable, 1, _finetune(runs, "converted/torch_dist", "from-converted"), ENV, runs / "rec-converted")
    assert json.loads((runs / "rec-converted" / "dp0.json").read_text()) == json.loads(
        (runs / "rec-lora" / "dp0.json").read_text()
    )


def test_fsdp2_stops_the_finetune_before_its_first_step(runs):
    """Megatron-LM's `--use-torch-fsdp2` wraps the model chunks in PyTorch FSDP2: refused while the wrapper is built."""
    env = {**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "8"}  # Megatron-LM's FSDP asks for more than one
    done = one_rank(["--load", str(runs / "base"), "--finetune"], env, runs, overrides=("--use-torch-fsdp2",))
    assert_stops_before_training(
        done,
        "LoRA is not supported with TorchFullyShardedDataParallel (--use-torch-fsdp2): the adapters' grad sync, grad "
        "norm and checkpoints are proven with Megatron's DistributedDataParallel only; leave out --use-torch-fsdp2 "
        "(--use-distributed-optimizer shards the optimizer state)",
    )
