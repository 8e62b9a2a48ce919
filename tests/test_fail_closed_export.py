"""`export` and `load_adapters` fail closed on damaged inputs and awkward outputs: one line, a non-zero exit,
nothing left behind (issue 35). The checkpoints come from `test_fail_closed_cli`'s module fixture (one
world-1 run); each CLI case runs `python -m megatron_lora_patch export` in a fresh process.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import persistence_worker as worker
import pytest
from conftest import assert_one_line_error, clean_environ, run_fresh
from test_fail_closed_cli import PEFT_TENSORS, SPEC, export, no_staging_left, saved, tree  # noqa: F401 (fixture)

from megatron_lora_patch import cli
from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.runtime.errors import PREFIX

TRACKER = "latest_checkpointed_iteration.txt"


def _damaged(saved, directory: pathlib.Path, damage) -> pathlib.Path:
    shutil.copytree(saved["adapters"], directory)
    (tensor_file,) = directory.glob("*.distcp")
    tensor_file.write_bytes(damage(tensor_file.read_bytes()))
    return directory


def test_load_adapters_of_a_truncated_or_zero_filled_checkpoint_is_one_line(saved, tmp_path):
    """Was torch's CheckpointException with every rank's traceback (the export already said it in one line)."""
    truncated = _damaged(saved, tmp_path / "truncated", lambda data: data[: len(data) // 2])
    zeroed = _damaged(saved, tmp_path / "zeroed", lambda data: bytes(len(data)))
    outcomes = run_world(worker.damaged_load_world, 1, args=("tp1", SPEC, [str(truncated), str(zeroed)]), name="tp1")
    assert outcomes[0] == [
        f"{truncated} has an unreadable tensor file (RuntimeError: PytorchStreamReader failed reading zip archive: "
        "failed finding central directory): it is truncated or damaged; copy the checkpoint again from where it "
        "was saved",
        f"adapter checkpoint {zeroed} is an unreadable distributed checkpoint (UnpicklingError: invalid load key, "
        "'\\x00'.); save or copy it again",
    ]


@pytest.mark.parametrize("content", ["garbage\n", "-5\n", ""])
def test_save_directory_with_a_damaged_tracker_file_is_one_line_not_exit_0(saved, tmp_path, content):
    """Megatron-LM's tracker reader calls sys.exit() (status 0, as if the export had worked) or asserts."""
    save_dir = tmp_path / "run"
    shutil.copytree(saved["adapters"], save_dir / "iter_0000002")
    (save_dir / TRACKER).write_text(content)
    result = export(save_dir, tmp_path / "out")
    message = (
        f"{save_dir / TRACKER} names no checkpoint ({content.strip()!r}; Megatron-LM writes an iteration number or "
        "'release'): pass one of the iter_NNNNNNN directories beside it instead, or write the iteration to resume "
        "from into it"
    )
    assert_one_line_error(result, message, 2)
    assert result.stdout == "" and not (tmp_path / "out").exists()


def test_empty_out_is_called_empty_even_where_the_working_directory_holds_the_checkpoint(saved):
    """`--out ''` resolved to the working directory, which held the checkpoint: it was called an overlap."""
    result = subprocess.run(
        [sys.executable, "-P", "-m", "megatron_lora_patch", "export", "--checkpoint", "adapters", "--out", ""],
        env=clean_environ(), capture_output=True, text=True, timeout=300, cwd=saved["root"],
    )
    assert_one_line_error(result, "--out is empty; name an output directory", 2)


@pytest.mark.parametrize("target", ["empty", "missing"])
def test_out_that_is_a_symbolic_link_writes_into_the_directory_it_names(saved, tmp_path, target):
    """Was "(Is a directory)" after the whole export, with .partial-* and .replaced-* directories left behind."""
    (tmp_path / "links").mkdir()
    real, link = tmp_path / "real", tmp_path / "links" / "peft"
    if target == "empty":
        real.mkdir()
    link.symlink_to(real)
    done = export(saved["adapters"], link)
    assert done.returncode == 0 and done.stdout == f"wrote {PEFT_TENSORS} tensors to {link}\n", done.stderr[-3000:]
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert tree(real) == tree(saved["peft"])
    assert no_staging_left(tmp_path) and no_staging_left(tmp_path / "links")


def test_out_linked_to_a_non_empty_directory_is_refused_then_replaced_with_force(saved, tmp_path):
    real, link = tmp_path / "real", tmp_path / "peft"
    real.mkdir()
    (real / "old.txt").write_text("keep me")
    link.symlink_to(real)
    message = f"--out {link} is not empty; pass --force to replace it, or name a new directory"
    assert_one_line_error(export(saved["adapters"], link), message, 2)
    assert (real / "old.txt").read_text() == "keep me"
    done = export(saved["adapters"], link, "--force")
    assert done.returncode == 0, done.stderr[-3000:]
    assert link.is_symlink() and tree(real) == tree(saved["peft"]) and no_staging_left(tmp_path)


@pytest.mark.parametrize("existing", [False, True])
def test_a_full_disk_during_the_export_is_one_line_and_leaves_nothing(saved, tmp_path, monkeypatch, capsys,
                                                                      existing):
    """The weights write fails with ENOSPC (as safetensors reports it): was a 17-line SafetensorError."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
                              'left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "peft"
    if existing:
        out.mkdir()
        (out / "old.txt").write_text("keep me")
    options = ["--force"] if existing else []
    code = cli.main(["export", "--checkpoint", str(saved["adapters"]), "--out", str(out), *options])
    assert code == 2
    assert capsys.readouterr().err == (
        f"{PREFIX}--out {out} could not be written (Error while serializing: IoError(Os {{ code: 28, kind: "
        'StorageFull, message: "No space left on device" })); nothing was left behind: free space on its '
        "filesystem (or name another directory) and export again\n"
    )
    assert no_staging_left(tmp_path)
    assert (tree(out) == {"old.txt": b"keep me"}) if existing else not out.exists()


class _Code:
    """A pickle that runs code when loaded without weights_only: it makes the directory `marker`."""

    def __init__(self, marker: pathlib.Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_legacy_common_state_is_read_weights_only_whatever_torch_defaults_to(tmp_path):
    """A user's `common.pt` (Megatron-Core < 0.19) is read with weights_only=True said explicitly: with torch's
    default turned off (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1) the pickle's code still does not run."""
    import torch

    checkpoint, marker = tmp_path / "iter_0000002", tmp_path / "code-ran"
    checkpoint.mkdir()
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1}')
    torch.save({"megatron_lora_patch": _Code(marker)}, checkpoint / "common.pt")
    result = run_fresh(["-m", "megatron_lora_patch", "export", "--checkpoint", str(checkpoint), "--out",
                        str(tmp_path / "out")], TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
    message = (f"--checkpoint {checkpoint} is an unreadable distributed checkpoint (UnpicklingError: Weights only "
               "load failed); save or copy it again")
    assert_one_line_error(result, message, 2)
    assert not marker.exists() and not (tmp_path / "out").exists()
