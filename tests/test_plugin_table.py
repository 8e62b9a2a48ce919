"""The plugins this distribution ships are found without package metadata (`plugin_set.OWN_PLUGINS`,
so they load from a bare checkout) and the table equals the entry points pyproject.toml declares
(docs/architecture.md section 1, step 3)."""

from __future__ import annotations

import json
import pathlib
import re
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
    `apply(plugins=['lora_correct'])` finds its plugin and patches (issue: ModuleNotFoundError); the patches are
    the checkout's top-level `patches/`, mapped to `megatron_lora_patch.patches` (`megatron_lora_patch._checkout`)."""
    code = (
        "import json, sys, megatron_lora_patch; megatron_lora_patch.apply(plugins=['lora_correct']);"
        "rows = [row.patch for row in megatron_lora_patch.status()];"
        "files = {m: sys.modules[m].__file__ for m in sys.modules if m.startswith('megatron_lora_patch.patches')};"
        "print(json.dumps([megatron_lora_patch.__file__, rows, files]))"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    package_file, rows, files = json.loads(result.stdout.splitlines()[-1])
    assert pathlib.Path(package_file) == REPO / "megatron_lora_patch" / "__init__.py"
    from megatron_lora_patch.plugins import lora_correct

    assert rows == list(lora_correct.PATCH_NAMES)
    expected = {"megatron_lora_patch.patches": REPO / "patches" / "__init__.py"}
    expected.update({f"megatron_lora_patch.patches.{name}": REPO / "patches" / f"{name}.py" for name in rows})
    assert {name: pathlib.Path(path) for name, path in files.items()} == expected


def _ci_minors() -> list:
    """The Megatron-Core minors scripts/run-tests.sh runs: NEWEST (the whole suite) and SMOKE."""
    script = (REPO / "scripts" / "run-tests.sh").read_text()
    newest = re.search(r"^NEWEST=([\d.]+)$", script, re.M).group(1)
    smoke = re.search(r"^SMOKE=\(([^)]*)\)$", script, re.M).group(1).split()
    return sorted([newest, *smoke], key=lambda minor: tuple(map(int, minor.split("."))))


def test_every_declared_minor_is_run_by_ci_and_no_other():
    """The range the patches declare (one constant, `patches.tested_range`) is the range CI tests."""
    from megatron_lora_patch.patches import NEWEST_TESTED, OLDEST_TESTED, tested_range
    from megatron_lora_patch.plugins import cpu_testbed, lora_correct

    low, high = (tuple(map(int, minor.split("."))) for minor in (OLDEST_TESTED, NEWEST_TESTED))
    declared = [f"{low[0]}.{minor}" for minor in range(low[1], high[1] + 1)]
    assert _ci_minors() == declared
    ranges = {module.SPEC.versions for module in (*lora_correct.PATCHES, *cpu_testbed.PATCHES)}
    assert tested_range() in ranges and all(text.endswith(tested_range().split(",")[1]) for text in ranges), ranges
