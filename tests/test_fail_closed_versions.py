"""Fail closed (issue 12, docs/fail-closed.md), continued from tests/test_fail_closed_runtime.py: an enabled
patch that fails to apply and an untested Megatron-Core version stop a fresh process at `import megatron...` with
ONE line, and `status` reports them with exit 1 and names the Megatron-Core a run imports. A fake Megatron-Core
source checkout (`conftest.fake_megatron`) on PYTHONPATH stands in for a checkout or an untested release.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import subprocess
import sys

from conftest import PLUGIN_FIXTURES, assert_one_line_error, clean_environ, fake_megatron, run_fresh

IMPORT = ["-c", "import megatron.core; print('imported')"]
STATUS = ["-m", "megatron_lora_patch", "status"]
from megatron_lora_patch.patches.lora_linear import SPEC as LORA_LINEAR

TESTED = LORA_LINEAR.versions  # the range the patch declares (and CI tests)
UNTESTED = (
    "megatron-core {version} is outside the tested range " + TESTED + " of patch lora_linear; "
    "set MEGATRON_LORA_ALLOW_UNTESTED=1 to apply it anyway, or MEGATRON_LORA_DISABLED_PATCHES=lora_linear "
    "to train without it"
)
INSTALLED = importlib.metadata.version("megatron-core")
#: The patches `lora_correct` turns on by default, in the order it applies them.
DEFAULT_ON = ("lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization", "lora_plus")


# -- a patch that cannot be delivered: stop when its target is imported -------------------------------

def test_failing_demo_patch_stops_its_import():
    result = run_fresh(
        ["-c", "import megatron, demo_target; print('imported')"],
        MEGATRON_PLUGINS="demo",
        MEGATRON_LORA_PATCH_DEMO_BROKEN="1",
        PYTHONPATH=str(PLUGIN_FIXTURES),
    )
    assert_one_line_error(
        result,
        "patch demo_broken failed on demo_target, nothing of it is applied: RuntimeError: boom half way; "
        "fix the cause, or set MEGATRON_LORA_DISABLED_PATCHES=demo_broken to knowingly train without it",
    )
    assert result.stdout == ""


def test_failing_lora_linear_stops_import_of_megatron_core(tmp_path):
    checkout = fake_megatron(tmp_path, INSTALLED, layers=True)
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct", PYTHONPATH=checkout)
    assert_one_line_error(
        result,
        "patch lora_linear failed on megatron.core.tensor_parallel.layers, nothing of it is applied: "
        "AttributeError: partially initialized module 'megatron.core.tensor_parallel.layers' has no attribute "
        "'linear_with_frozen_weight' (most likely due to a circular import); fix the cause, or set "
        "MEGATRON_LORA_DISABLED_PATCHES=lora_linear to knowingly train without it",
    )
    assert result.stdout == ""


def test_disabling_the_failing_patch_by_name_runs(tmp_path):
    checkout = fake_megatron(tmp_path, INSTALLED, layers=True)
    result = run_fresh(
        IMPORT,
        MEGATRON_PLUGINS="lora_correct",
        PYTHONPATH=checkout,
        MEGATRON_LORA_DISABLED_PATCHES="lora_linear,lora_checkpoint,finalize_grads",
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "imported\n", "")


# -- versions: the imported megatron.core decides, untested stops unless allowed ----------------------
def test_untested_release_stops_import(tmp_path):
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct", PYTHONPATH=fake_megatron(tmp_path, "0.12.0"))
    assert_one_line_error(result, UNTESTED.format(version="0.12.0"))


def test_checkout_over_an_installed_wheel_is_detected_when_activated_first(tmp_path):
    """The .pth activates on `import megatron`, then megatron.core comes from the checkout (0.99), not the wheel."""
    assert INSTALLED != "0.99.0"
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct", PYTHONPATH=fake_megatron(tmp_path, "0.99.0"))
    assert_one_line_error(result, UNTESTED.format(version="0.99.0"))


def test_checkout_over_an_installed_wheel_is_detected_when_imported_first(tmp_path):
    code = (
        "import megatron.core, megatron_lora_patch, megatron_lora_patch.runtime.errors as errors\n"
        "errors.install_excepthook()\n"
        "megatron_lora_patch.apply(['lora_correct'])\n"
    )
    result = run_fresh(["-c", code], PYTHONPATH=fake_megatron(tmp_path, "0.99.0"))
    assert_one_line_error(result, UNTESTED.format(version="0.99.0"))


def test_allow_untested_applies_with_one_warning_per_patch(tmp_path):
    result = run_fresh(
        IMPORT,
        MEGATRON_PLUGINS="lora_correct",
        MEGATRON_LORA_ALLOW_UNTESTED="1",
        PYTHONPATH=fake_megatron(tmp_path, "0.99.0"),
    )
    assert (result.returncode, result.stdout) == (0, "imported\n"), result.stderr
    assert result.stderr.splitlines() == [
        f"megatron-lora-patch: untested: megatron-core 0.99.0 is outside the tested range {TESTED} of patch "
        f"{name}, applied because MEGATRON_LORA_ALLOW_UNTESTED is on"
        for name in DEFAULT_ON
    ]


# -- status tells the truth -------------------------------------------------------------------------
def status_json(*args: str, **env: str) -> tuple[int, dict]:
    result = run_fresh([*STATUS, "--json", *args], **env)
    return result.returncode, json.loads(result.stdout)


def test_status_shows_an_untested_checkout_and_exits_1(tmp_path):
    result = run_fresh(STATUS, MEGATRON_PLUGINS="lora_correct", PYTHONPATH=fake_megatron(tmp_path, "0.12.0"))
    assert_one_line_error(result, UNTESTED.format(version="0.12.0"), returncode=1)
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("lora_correct  lora_linear"))
    assert row[:7] == ["lora_correct", "lora_linear", TESTED, "0.12.0", "on", "(default)", "untested"]


def test_status_shows_a_failing_patch_and_exits_1():
    code, document = status_json(
        MEGATRON_PLUGINS="demo", MEGATRON_LORA_PATCH_DEMO_BROKEN="1", PYTHONPATH=str(PLUGIN_FIXTURES)
    )
    rows = {row["patch"]: row for row in document["patches"]}
    assert code == 1
    assert (rows["demo_broken"]["state"], rows["demo_broken"]["detail"]) == ("failed", "RuntimeError: boom half way")
    assert document["error"].startswith("patch demo_broken failed on demo_target")


def test_status_separates_this_process_from_a_fresh_one():
    """`--plugins demo` previews in this process; a fresh process (MEGATRON_PLUGINS unset) gets nothing."""
    code, document = status_json("--plugins", "demo", PYTHONPATH=str(PLUGIN_FIXTURES))
    shout = next(row for row in document["patches"] if row["patch"] == "demo_shout")
    assert code == 0
    assert (shout["state"], shout["fresh_process"]) == ("applied", "nothing: MEGATRON_PLUGINS does not name demo")
    assert document["startup_hook"]["installed"] is True and document["startup_hook"]["ran_here"] is False


def test_status_of_lora_correct_on_the_installed_megatron():
    code, document = status_json(MEGATRON_PLUGINS="lora_correct")
    rows = {row["patch"]: row for row in document["patches"]}
    assert (code, document["error"], document["startup_hook"]["ran_here"]) == (0, None, True)
    assert {rows[name]["installed"] for name in rows} == {INSTALLED}
    for name in DEFAULT_ON:
        assert (rows[name]["state"], rows[name]["fresh_process"]) == ("applied", "applied"), rows[name]


def test_status_names_the_megatron_core_a_run_imports_and_where_from(tmp_path):
    """Was: without importing (--no-import) the installed wheel's version, while a checkout on the path supplies
    another; and nothing said which Megatron-Core a script started in a Megatron-LM checkout imports."""
    checkout = fake_megatron(tmp_path / "path", "0.12.0")
    code, document = status_json("--no-import", MEGATRON_PLUGINS="lora_correct", PYTHONPATH=checkout)
    assert document["megatron_core"] == {"version": "0.12.0", "path": str(tmp_path / "path" / "megatron" / "core"),
                                         "wheel": INSTALLED, "working_directory": None}
    assert {row["installed"] for row in document["patches"]} == {"0.12.0"}
    here = fake_megatron(tmp_path / "cwd", "0.13.0")
    result = subprocess.run([sys.executable, "-P", *STATUS], env=clean_environ(MEGATRON_PLUGINS="lora_correct"),
                            capture_output=True, text=True, timeout=300, cwd=here)
    installed = pathlib.Path(importlib.util.find_spec("megatron.core").origin).parent
    assert result.stdout.splitlines()[-1] == (
        f"megatron-core: {INSTALLED} imported from {installed}; a script started in this directory (such as "
        f"pretrain_gpt.py) imports megatron-core 0.13.0 from {here}/megatron/core instead"
    ), result.stderr[-3000:]
