"""Every patch loads from where an install puts it: a fresh interpreter imports each patch module and applies
both shipped plugins (tests/test_bootstrap.py: the wheel; tests/test_editable_install.py: `pip install -e`)."""

from __future__ import annotations

import json
import pathlib

EVERY_PATCH = (
    "import importlib, json, sys, megatron_lora_patch\n"
    "checkout_finder = 'megatron_lora_patch._checkout' in sys.modules\n"
    "if {setuptools_only}:  # leave megatron_lora_patch.patches to the install's own mapping\n"
    "    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != 'CheckoutPatchesFinder']\n"
    "names = {names!r}\n"
    "files = {{n: importlib.import_module('megatron_lora_patch.patches.' + n).__file__ for n in names}}\n"
    "megatron_lora_patch.apply(plugins=['lora_correct', 'cpu_testbed'])\n"
    "rows = sorted(row.patch for row in megatron_lora_patch.status())\n"
    "print(json.dumps([megatron_lora_patch.__file__, checkout_finder, files, rows]))\n"
)


def every_patch_loads(python: pathlib.Path, cwd: pathlib.Path, setuptools_only: bool = False) -> tuple:
    """In a fresh `python -P` without runtime flags: import every patch module of the checkout's `patches/` as
    `megatron_lora_patch.patches.<name>` and apply both shipped plugins (`setuptools_only`: with the checkout
    finder of `megatron_lora_patch._checkout` removed first). Returns the package's `__file__`, whether that
    finder was installed, and the directory every patch module came from; checks that `status` lists them all."""
    import subprocess

    from conftest import REPO, clean_environ

    names = sorted(path.stem for path in (REPO / "patches").glob("*.py") if path.stem != "__init__")
    code = EVERY_PATCH.format(names=names, setuptools_only=setuptools_only)
    result = subprocess.run(
        [str(python), "-P", "-c", code], env=clean_environ(), capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-2000:]
    package_file, checkout_finder, files, rows = json.loads(result.stdout.splitlines()[-1])
    assert rows == names  # every patch module is found by the plugins (its SPEC named as the module)
    (directory,) = {pathlib.Path(path).parent for path in files.values()}
    assert files == {name: str(directory / f"{name}.py") for name in names}
    return pathlib.Path(package_file), checkout_finder, directory
