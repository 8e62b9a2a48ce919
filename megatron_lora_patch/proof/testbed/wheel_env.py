"""A fresh interpreter with a freshly built wheel of this project installed, `.pth` included.

It stands on the current environment's packages (torch, megatron-core, ...) through a plain
path line, which does not run that environment's own `.pth` files, so what runs at start-up
is exactly what `pip install megatron-lora-patch` would leave (bytecode compiled, as pip does). Used by the bootstrap
tests and the start-up benchmark.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from typing import Optional


def _build_wheel(project: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """The project's wheel, built from a private copy of its tree: setuptools writes `build/` and `*.egg-info`
    into the tree it builds, so two builds of one checkout at once (the test legs run two at a time) would race
    there. A failed build raises with pip's own output."""
    source, wheel_dir = root / "source", root / "wheel"
    shutil.copytree(project, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir),
               str(source)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    (wheel,) = wheel_dir.glob("*.whl")
    return wheel


def create(root: pathlib.Path, project: Optional[pathlib.Path]) -> pathlib.Path:
    """Make an environment under `root`; with `project`, build and install its wheel there.

    Returns the environment's python. Without `project` it is the "not installed" baseline.
    """
    env_dir = root / ("with-wheel" if project else "without")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site_packages = pathlib.Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    if project is not None:
        wheel = _build_wheel(project, root)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site_packages)
            packages = sorted({name.split("/")[0] for name in archive.namelist() if name.endswith(".py")})
        # Compile the bytecode as `pip install` does, so a first import measures loading, not compiling.
        subprocess.run(
            [str(python), "-m", "compileall", "-q", *(str(site_packages / p) for p in packages)],
            check=True,
            capture_output=True,
        )
    # Every site directory of this interpreter, including those a `.pth` line added (an overlay
    # environment's base): a path line in a `.pth` file does not process that directory's own `.pth`s.
    dependencies = [sysconfig.get_paths()["purelib"]] + [p for p in sys.path if p.endswith("site-packages")]
    (site_packages / "zz_dependencies.pth").write_text("\n".join(dict.fromkeys(dependencies)) + "\n")
    return python
