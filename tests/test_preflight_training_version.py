"""Preflight against a Megatron-LM source tree older than 0.17 first on the path: one line naming the tree,
its version and the fix, instead of a traceback from a parser that differs (issue 26, docs/fail-closed.md)."""

from __future__ import annotations

import pathlib

import pytest

from megatron_lora_patch.proof.testbed.args_parse import check_training_version, tree_version
from megatron_lora_patch.runtime.errors import UsageError


def _tree(root: pathlib.Path, minor: int) -> pathlib.Path:
    """A Megatron-LM tree's version file and training arguments module (their contents do not matter here)."""
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 3\n")
    (root / "megatron" / "training").mkdir()
    arguments = root / "megatron" / "training" / "arguments.py"
    arguments.write_text("")
    return arguments


def test_a_tree_older_than_0_17_is_one_line_naming_it(tmp_path):
    with pytest.raises(UsageError) as error:
        check_training_version(str(_tree(tmp_path, 16)))
    message = str(error.value)
    assert "\n" not in message and str(tmp_path) in message and "(0.16.3)" in message and "PYTHONPATH" in message


def test_negative_control_0_17_and_the_installed_parser_pass(tmp_path):
    check_training_version(str(_tree(tmp_path, 17)))
    from megatron.training import arguments  # megatron-core >= 0.17 ships it (this suite runs on the newest)

    check_training_version(arguments.__file__)
    assert tree_version(pathlib.Path(arguments.__file__).resolve().parents[2]) >= (0, 17)


def test_an_unreadable_version_is_not_guessed(tmp_path):
    assert tree_version(tmp_path) is None
    check_training_version(str(tmp_path / "megatron" / "training" / "arguments.py"))
