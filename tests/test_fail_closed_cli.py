"""`export` and `save_adapters` fail closed: one line per user mistake, nothing overwritten, bugs keep tracebacks.

One world-1 run (module fixture) writes a base-model checkpoint and two adapter
checkpoints (`persistence_worker.overwrite_world`), and `python -m megatron_lora_patch export`
exports them in a fresh process; every CLI case then runs `megatron-lora-patch export ...` through
`cli.main` (`run_in_process`; an argparse error in a fresh process too) and asserts the exit status and
the exact one-line message, and that refused targets keep their bytes.
"""

from __future__ import annotations

import os
import pathlib
import shutil

import persistence_worker as worker
import pytest
from conftest import assert_one_line_error, run_fresh, run_in_process
from safetensors.torch import load_file

from megatron_lora_patch import cli
from megatron_lora_patch.lora.exchange import names as peft_names
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.models import TinyGPTSpec
from megatron_lora_patch.runtime.errors import PREFIX

SEED = 31
SPEC = TinyGPTSpec()
PEFT_TENSORS = 14 * SPEC.num_layers  # per layer: A and B of q, k, v, o, gate, up, down
FIX = "pass the directory save_adapters wrote"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Paths of a base checkpoint, an adapter checkpoint, a replaced one, and a PEFT export of the adapters."""
    root = tmp_path_factory.mktemp("fail-closed")
    result = run_world(worker.overwrite_world, 1, args=("tp1", SPEC, SEED, str(root)), name="tp1", timeout=240)[0]
    peft_dir = root / "peft"
    done = run_fresh(["-m", "megatron_lora_patch", "export", "--checkpoint", str(result["paths"]["adapters"]),
                      "--out", str(peft_dir)])
    assert done.returncode == 0 and done.stdout == f"wrote {PEFT_TENSORS} tensors to {peft_dir}\n", done.stderr[-3000:]
    return {
        "root": root,
        "peft": peft_dir,
        "result": result,
        **{k: pathlib.Path(v) for k, v in result["paths"].items()},
    }


def export(checkpoint, out, *options: str):
    return run_in_process(["export", "--checkpoint", str(checkpoint), "--out", str(out), *options])


def tree(directory: pathlib.Path) -> dict:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def no_staging_left(directory: pathlib.Path) -> bool:
    return not [name for name in os.listdir(directory) if ".partial-" in name or ".replaced-" in name]


def test_checkpoint_that_does_not_exist(tmp_path):
    missing = tmp_path / "nope"
    assert_one_line_error(export(missing, tmp_path / "out"), f"--checkpoint {missing} does not exist; {FIX}", 2)
    assert os.listdir(tmp_path) == []


def test_checkpoint_that_is_a_file(tmp_path):
    (tmp_path / "adapter.pt").write_text("x")
    result = export(tmp_path / "adapter.pt", tmp_path / "out")
    assert_one_line_error(result, f"--checkpoint {tmp_path / 'adapter.pt'} is a file, not a directory; {FIX}", 2)


def test_checkpoint_that_is_an_ordinary_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    message = f"--checkpoint {tmp_path} is not a Megatron distributed checkpoint (no metadata.json); {FIX}"
    assert_one_line_error(export(tmp_path, tmp_path.parent / f"{tmp_path.name}-out"), message, 2)


def test_empty_checkpoint_argument(tmp_path):
    assert_one_line_error(export("", tmp_path / "out"), f"--checkpoint is empty; {FIX}", 2)


def test_base_model_checkpoint_has_no_adapters(saved, tmp_path):
    message = (
        f"--checkpoint {saved['base']} holds no megatron-lora-patch adapters (a base-model checkpoint?); "
        "write one with megatron_lora_patch.lora.checkpoints.checkpoint.save_adapters"
    )
    assert_one_line_error(export(saved["base"], tmp_path / "out"), message, 2)


def test_unknown_family_lists_the_known_ones(saved, tmp_path):
    result = export(saved["adapters"], tmp_path / "out", "--family", "gpt2")
    known = "llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, qwen2_moe, deepseek_v3"
    assert_one_line_error(result, f"unknown --family 'gpt2'; known: {known}", 2)
    assert os.listdir(tmp_path) == []


def test_non_empty_out_is_refused_and_kept_byte_for_byte(saved):
    before = tree(saved["peft"])
    message = f"--out {saved['peft']} is not empty; pass --force to replace it, or name a new directory"
    assert_one_line_error(export(saved["adapters"], saved["peft"]), message, 2)
    assert tree(saved["peft"]) == before


def test_out_that_is_a_file(saved, tmp_path):
    (tmp_path / "adapter").write_text("keep me")
    message = f"--out {tmp_path / 'adapter'} is a file, not a directory; name a directory"
    assert_one_line_error(export(saved["adapters"], tmp_path / "adapter", "--force"), message, 2)
    assert (tmp_path / "adapter").read_text() == "keep me"


def test_out_under_a_file(saved, tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "peft"
    message = f"--out {out} cannot be created: {tmp_path / 'file'} is a file, not a directory"
    assert_one_line_error(export(saved["adapters"], out), message, 2)


@pytest.mark.skipif(os.geteuid() != 0, reason="as another user /sys is refused earlier, as not writable")
def test_out_where_no_directory_can_be_made(saved):
    out = "/sys/megatron-lora-patch-test/peft"
    message = f"--out {out} cannot be created in /sys/megatron-lora-patch-test: Operation not permitted"
    assert_one_line_error(export(saved["adapters"], out), message, 2)


def test_empty_out_argument(saved):
    assert_one_line_error(export(saved["adapters"], ""), "--out is empty; name an output directory", 2)


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_out_overlapping_the_checkpoint_is_refused_even_with_force(saved, where):
    checkpoint = saved["adapters"]
    out = {"same": checkpoint, "inside": checkpoint / "peft", "around": checkpoint.parent}[where]
    before = tree(checkpoint)
    message = (
        f"--out {out} overlaps --checkpoint {checkpoint}; write the PEFT adapter to a directory outside the checkpoint"
    )
    assert_one_line_error(export(checkpoint, out, "--force"), message, 2)
    assert tree(checkpoint) == before


def test_out_equal_to_the_checkpoint_says_they_overlap_not_pass_force(saved):
    """Without --force the answer must not be "pass --force" (which the overlap check then refuses anyway)."""
    checkpoint = saved["adapters"]
    message = (
        f"--out {checkpoint} overlaps --checkpoint {checkpoint}; write the PEFT adapter to a directory outside "
        "the checkpoint"
    )
    assert_one_line_error(export(checkpoint, checkpoint), message, 2)


def _damaged_copy(saved, tmp_path, damage) -> pathlib.Path:
    """A copy of the adapter checkpoint with its one tensor file passed through `damage(bytes) -> bytes`."""
    copy = tmp_path / "damaged"
    shutil.copytree(saved["adapters"], copy)
    (tensor_file,) = copy.glob("*.distcp")
    tensor_file.write_bytes(damage(tensor_file.read_bytes()))
    return copy


def test_truncated_tensor_file_is_one_line(saved, tmp_path):
    damaged = _damaged_copy(saved, tmp_path, lambda data: data[: len(data) // 2])
    message = (
        f"{damaged} has an unreadable tensor file (RuntimeError: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory): it is truncated or damaged; copy the checkpoint again from where "
        "it was saved"
    )
    assert_one_line_error(export(damaged, tmp_path / "out"), message, 2)
    assert not (tmp_path / "out").exists() and no_staging_left(tmp_path)


def test_zero_filled_tensor_file_is_one_line(saved, tmp_path):
    damaged = _damaged_copy(saved, tmp_path, lambda data: bytes(len(data)))
    message = (
        f"--checkpoint {damaged} is an unreadable distributed checkpoint (UnpicklingError: invalid load key, "
        "'\\x00'.); save or copy it again"
    )
    assert_one_line_error(export(damaged, tmp_path / "out"), message, 2)


def test_checkpoint_without_its_common_state_names_common_pt(tmp_path):
    """A torch_dist checkpoint whose common state is gone (an older Megatron-Core's common.pt not copied):
    was "'str' object has no attribute 'iterdir'" (< 0.19) or a rank traceback (0.19)."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "iter_0000002"
    dcp.save(
        {"decoder.layers.self_attention.linear_qkv.lora.A": torch.zeros(2, 4)}, checkpoint_id=checkpoint, no_dist=True
    )
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    message = (
        f"--checkpoint {checkpoint} has no common state: common.pt is missing (the checkpoint was copied or "
        "written incompletely); copy common.pt from where the checkpoint was saved"
    )
    assert_one_line_error(export(checkpoint, tmp_path / "out"), message, 2)


def test_missing_out_is_an_argparse_usage_error(saved):
    result = run_fresh(["-m", "megatron_lora_patch", "export", "--checkpoint", str(saved["adapters"])])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (
        result.stderr.splitlines()[-1]
        == "megatron-lora-patch export: error: the following arguments are required: --out"
    )


def test_force_replaces_a_non_empty_out_and_an_empty_out_is_used(saved, tmp_path):
    replaced, empty = tmp_path / "replaced", tmp_path / "empty"
    replaced.mkdir()
    (replaced / "old.txt").write_text("old")
    empty.mkdir()
    for out, options in ((replaced, ("--force",)), (empty, ())):
        done = export(saved["adapters"], out, *options)
        assert done.returncode == 0, done.stderr[-3000:]
        assert tree(out) == tree(saved["peft"])
    assert no_staging_left(tmp_path)


def test_save_adapters_refuses_a_base_checkpoint_and_leaves_it_intact(saved):
    result = saved["result"]
    assert result["refusal"] == (
        f"save_adapters: directory {saved['base']} is not empty; pass overwrite=True to replace it, "
        "or name a new directory"
    )
    assert len(result["base_before"]) >= 3  # metadata, common state and tensor files: a real checkpoint
    assert result["base_after"] == result["base_before"]
    assert tree(saved["base"]) == result["base_before"]
    assert no_staging_left(saved["root"])


def test_save_adapters_overwrite_replaces_the_old_checkpoint(saved, tmp_path):
    done = export(saved["replaced"], tmp_path / "peft")
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (
        load_file(saved["peft"] / peft_names.WEIGHTS_NAME),
        load_file(tmp_path / "peft" / peft_names.WEIGHTS_NAME),
    )
    assert first.keys() == second.keys() and len(first) == PEFT_TENSORS
    for key, value in first.items():
        factor = 2 if ".lora_B." in key else 1
        assert value.abs().max() > 0 and (second[key] == factor * value).all(), key


def test_user_error_in_process_is_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"{PREFIX}--checkpoint {tmp_path / 'nope'} does not exist; {FIX}\n"


@pytest.mark.parametrize("bug", [ValueError("bad value"), KeyError("layer"), RuntimeError("boom")])
def test_internal_bugs_keep_their_traceback(monkeypatch, tmp_path, bug):
    """Only UsageError becomes one line: a ValueError / KeyError raised by a bug propagates (was swallowed)."""
    from megatron_lora_patch.lora.exchange import transfer as peft_io

    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(peft_io, "export_peft", broken)
    with pytest.raises(type(bug)):
        cli.main(["export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out")])
