"""Installing megatron-lora-patch never downgrades or replaces the user's Megatron-Core or torch.

Each case is a real `pip install --dry-run` (offline, against stub distributions that carry only
metadata) into an environment that already holds the user's packages; the resolver's report must
install nothing but this project. The negative control resolves the old requirements
(`torch>=2.6`, `megatron-core<0.17`) the same way and must change the environment.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import venv
import zipfile

import pytest

REPO = pathlib.Path(__file__).parent.parent
NVIDIA_TORCH = "2.6.0a0+ecf3bae40a.nv25.01"
OUR_DEPENDENCIES = [
    ("wrapt", "1.17.0"),
    ("pluggy", "1.6.0"),
    ("packaging", "25.0"),
    ("safetensors", "0.5.0"),
    ("psutil", "6.0.0"),
    ("numpy", "2.0.0"),
]


def stub_wheel(directory: pathlib.Path, name: str, version: str, requires: tuple[str, ...] = ()) -> pathlib.Path:
    """A wheel holding only metadata (enough for the resolver)."""

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = (
        "".join(f"{p},sha256={digest(c)},{len(c)}\n" for p, c in files.items()) + f"{info}/RECORD,,\n"
    )
    path = directory / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def pip(python: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def our_wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("ours")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    return next(out.glob("*.whl"))


def would_install(tmp_path: pathlib.Path, installed: list, wheel: pathlib.Path, on_index: tuple = ()) -> dict[str, str]:
    """name -> version of everything a dry-run install of `wheel` would install or replace, in an
    environment holding `installed` (name, version, requires); `on_index` are other releases pip can pick."""
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    stubs = [stub_wheel(wheelhouse, name, version, requires) for name, version, requires in installed]
    held = {entry[0] for entry in installed}
    stubs += [stub_wheel(wheelhouse, name, version) for name, version in OUR_DEPENDENCIES if name not in held]
    for name, version in on_index:
        stub_wheel(wheelhouse, name, version)
    venv.EnvBuilder(with_pip=False).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    setup = pip(python, "install", "-q", "--no-deps", "--find-links", str(wheelhouse), *map(str, stubs))
    assert setup.returncode == 0, setup.stderr
    report = tmp_path / "report.json"
    result = pip(
        python, "install", "--dry-run", "-q", "--find-links", str(wheelhouse), "--report", str(report), str(wheel)
    )
    assert result.returncode == 0, result.stderr
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}


#: Older and newer releases on the index, as on PyPI, that a bad requirement would pick.
ON_INDEX = (("megatron-core", "0.16.1"), ("torch", "2.13.0"))


def test_megatron_core_0_19_is_kept(tmp_path, our_wheel):
    installed = [("torch", "2.13.0", ()), ("megatron-core", "0.19.2", ("torch>=2.6.0", "numpy", "packaging>=24.2"))]
    assert would_install(tmp_path, installed, our_wheel, ON_INDEX) == {"megatron-lora-patch": "0.1.0"}


def test_nvidia_container_torch_prerelease_is_kept(tmp_path, our_wheel):
    # A container's megatron-core built against its own torch (a bare `torch` requirement). Note that
    # megatron-core's own PyPI metadata (`torch>=2.6.0`) rejects such a pre-release by itself (README).
    installed = [("torch", NVIDIA_TORCH, ()), ("megatron-core", "0.19.2", ("torch", "numpy", "packaging>=24.2"))]
    assert would_install(tmp_path, installed, our_wheel, ON_INDEX) == {"megatron-lora-patch": "0.1.0"}


def test_negative_control_old_requirements_change_the_environment(tmp_path):
    old = stub_wheel(tmp_path, "megatron-lora-patch", "0.0.9", ("torch>=2.6", "megatron-core>=0.13,<0.17"))
    installed = [("torch", NVIDIA_TORCH, ()), ("megatron-core", "0.19.2", ("torch", "numpy", "packaging>=24.2"))]
    changed = would_install(tmp_path, installed, old, ON_INDEX)
    assert changed.get("megatron-core") == "0.16.1" and changed.get("torch") == "2.13.0", changed
