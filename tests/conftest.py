"""Shared fixtures: the demo/canary plugin directory and fresh-interpreter runners."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from megatron_lora_patch.testing import wheel_env

PLUGIN_FIXTURES = pathlib.Path(__file__).parent / "plugin_fixtures"
REPO = pathlib.Path(__file__).parent.parent
RUNTIME_VARIABLES = ("MEGATRON_PLUGINS", "MEGATRON_LORA_STRICT", "MEGATRON_LORA_DISABLED_PATCHES")


def clean_environ(**overrides: str) -> dict[str, str]:
    """os.environ without any runtime flag, plus `overrides`."""
    environ = {
        key: value
        for key, value in os.environ.items()
        if key not in RUNTIME_VARIABLES and not key.startswith("MEGATRON_LORA_")
    }
    environ.update(overrides)
    return environ


@pytest.fixture
def demo_plugins(monkeypatch):
    """Put the demo and canary plugins (with their entry points) on sys.path, flags cleared."""
    for key in list(os.environ):
        if key in RUNTIME_VARIABLES or key.startswith("MEGATRON_LORA_"):
            monkeypatch.delenv(key)
    monkeypatch.syspath_prepend(str(PLUGIN_FIXTURES))
    yield
    for name in ("demo_target", "demo_plugin", "canary_plugin"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="session")
def installed_python(tmp_path_factory) -> pathlib.Path:
    """A fresh interpreter with this checkout's wheel installed, `.pth` start-up hook included."""
    return wheel_env.create(tmp_path_factory.mktemp("installed"), REPO)


def run_python(python: pathlib.Path, code: str, *, plugins: bool = True, args=(), **env: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the test plugins on PYTHONPATH."""
    environ = clean_environ(**env)
    if plugins:
        environ["PYTHONPATH"] = str(PLUGIN_FIXTURES)
    return subprocess.run(
        [str(python), *args, "-c", code], env=environ, capture_output=True, text=True, timeout=120, cwd=str(PLUGIN_FIXTURES.parent)
    )
