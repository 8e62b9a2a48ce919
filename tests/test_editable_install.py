"""`pip install -e .` of a copy of the checkout: the start-up hook is installed and runs, and setuptools' editable
finder loads every patch from the checkout's top-level `patches/` (setup.py's package-dir mapping)."""

from __future__ import annotations

import json
import pathlib

import pytest
from patch_loading import every_patch_loads


def _without_this_package(site: pathlib.Path, shadow: pathlib.Path) -> str:
    """`site`, or where it holds an installed megatron-lora-patch (which would win over the editable
    finder), a directory of links to everything else in it (Megatron-Core may sit beside it)."""
    if not (site / "megatron_lora_patch").exists():
        return str(site)
    shadow.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("megatron_lora_patch"):
            (shadow / entry.name).symlink_to(entry)
    return str(shadow)


@pytest.fixture(scope="module")
def editable_install(tmp_path_factory) -> tuple:
    """`pip install -e` of a copy of the checkout's tracked files into a fresh venv that sees this
    environment's dependencies (without this package); returns (checkout, python, site-packages, its tmp dir)."""
    tmp_path = tmp_path_factory.mktemp("editable")
    import shutil
    import subprocess
    import sys
    import sysconfig

    from conftest import REPO, clean_environ

    source = tmp_path / "checkout"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    env_dir = tmp_path / "editable"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site_packages = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    dependencies = [sysconfig.get_paths()["purelib"]] + [p for p in sys.path if p.endswith("site-packages")]
    dependencies = [
        _without_this_package(pathlib.Path(p), tmp_path / f"deps{i}") for i, p in enumerate(dict.fromkeys(dependencies))
    ]
    (pathlib.Path(site_packages) / "zz_dependencies.pth").write_text("\n".join(dependencies) + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-e",
            str(source),
        ],
        check=True,
        capture_output=True,
        env=clean_environ(),
    )
    return source, python, site_packages, tmp_path


def test_editable_install_has_the_start_up_hook(editable_install):
    """`pip install -e .` writes the `.pth` too, and a plain `import megatron.core...` in a fresh
    process of that environment gets lora_correct; `status` finds the hook and says so."""
    import subprocess

    from conftest import clean_environ

    source, python, site_packages, tmp_path = editable_install
    assert (pathlib.Path(site_packages) / "megatron_lora_patch-init.pth").is_file()
    code = (
        "import json, megatron.core.tensor_parallel.layers, megatron_lora_patch\n"
        "print(json.dumps([megatron_lora_patch.__file__, {r.patch: r.state for r in megatron_lora_patch.status()}]))"
    )
    result = subprocess.run(
        [str(python), "-P", "-c", code],
        env=clean_environ(MEGATRON_PLUGINS="lora_correct"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    module_file, states = json.loads(result.stdout.splitlines()[-1])
    assert module_file == str(source / "megatron_lora_patch" / "__init__.py")  # the checkout, not a wheel
    assert states["lora_linear"] == "applied"
    result = subprocess.run(
        [str(python), "-P", "-m", "megatron_lora_patch", "status", "--json", "--no-import"],
        env=clean_environ(MEGATRON_PLUGINS="lora_correct"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["startup_hook"] == {
        "path": str(pathlib.Path(site_packages) / "megatron_lora_patch-init.pth"),
        "installed": True,
        "ran_here": True,
    }


def test_editable_install_loads_every_patch(editable_install):
    """setuptools' editable finder maps `megatron_lora_patch.patches` to the checkout's top-level `patches/` (the
    package-dir entry of setup.py) by itself: every patch module imports from there, and the plugins find them
    all, with the checkout finder (which maps the same name to the same directory) removed."""
    source, python, _, tmp_path = editable_install
    package_file, checkout_finder, directory = every_patch_loads(python, tmp_path, setuptools_only=True)
    assert package_file == source / "megatron_lora_patch" / "__init__.py"
    assert directory == source / "patches"
    assert checkout_finder  # a source checkout: it was installed, and removing it changed nothing
