"""The plugins this distribution ships are found without package metadata (`plugin_set.OWN_PLUGINS`,
so they load from a bare checkout) and the table equals the entry points pyproject.toml declares
(docs/architecture.md section 1, step 3)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import tomllib

from megatron_lora_patch.runtime.plugin_set import OWN_PLUGINS

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_own_plugins_equal_the_declared_entry_points():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["megatron_lora_patch.plugins"] == OWN_PLUGINS


def test_apply_from_a_bare_checkout(tmp_path):
    """Run from the checkout root without installing: the checkout's package is imported and
    `apply(plugins=['lora_correct'])` finds its plugin and patches (issue: ModuleNotFoundError)."""
    code = (
        "import megatron_lora_patch, pathlib; megatron_lora_patch.apply(plugins=['lora_correct']);"
        "print(pathlib.Path(megatron_lora_patch.__file__).parent.parent)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert pathlib.Path(result.stdout.split()[-1]) == REPO
