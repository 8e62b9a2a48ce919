"""Shared fixtures: the demo/canary plugin directory and fresh-interpreter runners."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from megatron_lora_patch.proof.testbed import wheel_env

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


def run_python(
    python: pathlib.Path, code: str, *, plugins: bool = True, args=(), **env: str
) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter with the test plugins on PYTHONPATH."""
    environ = clean_environ(**env)
    if plugins:
        environ["PYTHONPATH"] = str(PLUGIN_FIXTURES)
    return subprocess.run(
        [str(python), *args, "-c", code],
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(PLUGIN_FIXTURES.parent),
    )


def assert_one_line_error(result: subprocess.CompletedProcess, message: str, returncode: int = 1) -> None:
    """The process stopped with exactly one `megatron-lora-patch: error: <message>` line (its last
    stderr line), no traceback, and `returncode` (1: uncaught UsageError; 2: CLI usage error)."""
    from megatron_lora_patch.runtime.errors import PREFIX

    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == returncode, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines and lines[-1] == PREFIX + message, result.stderr[-3000:]
    assert sum(line.startswith(PREFIX) for line in lines) == 1, result.stderr[-3000:]


def run_fresh(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run `sys.executable -P <args>` (this environment, its installed wheel and .pth hook) with
    only `env` as runtime flags; `args` is e.g. ['-c', 'import megatron.core'] or ['-m', 'megatron_lora_patch',
    'status']."""
    return subprocess.run(
        [sys.executable, "-P", *args],
        env=clean_environ(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(PLUGIN_FIXTURES.parent),
    )


def run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    """`megatron-lora-patch <args>` through `cli.main` in this process, its exit status and output as a
    CompletedProcess: what `run_fresh(["-m", "megatron_lora_patch", *args])` checks of a CLI mistake, without a
    fresh interpreter's start-up (seconds per case). Each test file keeps a fresh-process case of its own."""
    import contextlib
    import io

    from megatron_lora_patch import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(args)
        except SystemExit as stop:  # argparse's usage errors (2) and --help (0)
            code = stop.code if isinstance(stop.code, int) else 1
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


#: The only reasons a test may skip when LORA_PATCH_TEST_STRICT_SKIPS=1 (scripts/run-tests.sh):
#: a skipped test proves nothing, so anything else that skips fails the run. "Not applicable to this
#: Megatron-Core" is allowed only for test files that scripts/run-tests.sh also runs on the minors
#: where they apply (VERSIONED_TESTS there).
ALLOWED_SKIP_REASONS = ("CUDA", "Transformer Engine", "not applicable to this Megatron-Core")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and os.environ.get("LORA_PATCH_TEST_STRICT_SKIPS") == "1" and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(word in reason for word in ALLOWED_SKIP_REASONS):
            report.outcome = "failed"
            report.longrepr = f"skipped without needing CUDA / Transformer Engine (proves nothing): {reason}"
    return report


def fake_megatron(root: pathlib.Path, version: str, layers: bool = False) -> str:
    """A minimal Megatron-Core source checkout (no dist-info) under `root`; returns its path."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "package_info.py").write_text(f"__version__ = {version!r}\n")
    (core / "__init__.py").write_text("import megatron.core.tensor_parallel\n" if layers else "")
    if layers:  # a tensor_parallel without what lora_linear and finalize_grads wrap: both fail
        (core / "tensor_parallel").mkdir()
        (core / "tensor_parallel" / "__init__.py").write_text("from megatron.core.tensor_parallel import layers\n")
        (core / "tensor_parallel" / "layers.py").write_text("RENAMED_UPSTREAM = True\n")
    return str(root)
