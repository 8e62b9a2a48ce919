"""Fail closed (issue 12, docs/fail-closed.md): with MEGATRON_PLUGINS set, every configuration
mistake, every enabled patch that fails to apply and every untested Megatron-Core version stops a
fresh process at `import megatron...` with ONE line and no traceback; `status` reports the same
mistakes with exit 2 (configuration) or 1 (a patch not delivered), and tells the truth about
what a fresh process gets. Each case asserts the exit code and the exact line.

A fake Megatron-Core source checkout (`megatron/core/package_info.py` and what a case needs) on
PYTHONPATH stands in for a checkout or for an untested release; it wins over the installed wheel,
as a `cd Megatron-LM; torchrun pretrain_gpt.py` checkout does.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
from conftest import PLUGIN_FIXTURES, assert_one_line_error, clean_environ, run_fresh

BOOLEANS = "1, true, yes, on, 0, false, no, off"
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


# -- configuration mistakes: stop at `import megatron`, before Megatron runs ------------------------
CONFIGURATION = {
    "plugin typo": (
        {"MEGATRON_PLUGINS": "lora_corect"},
        "MEGATRON_PLUGINS names unknown plugin 'lora_corect'; did you mean 'lora_correct'?",
    ),
    "plugin with a dash": (
        {"MEGATRON_PLUGINS": "lora-correct"},
        "MEGATRON_PLUGINS names unknown plugin 'lora-correct'; did you mean 'lora_correct'?",
    ),
    "plugin in capitals": (
        {"MEGATRON_PLUGINS": "LORA_CORRECT"},
        "MEGATRON_PLUGINS names unknown plugin 'LORA_CORRECT'; did you mean 'lora_correct'?",
    ),
    "plugins separated by a blank": (
        {"MEGATRON_PLUGINS": "lora_correct other"},
        "MEGATRON_PLUGINS names unknown plugin 'lora_correct other' (separate names with commas); "
        "did you mean 'lora_correct'?",
    ),
    "patch flag not a boolean": (
        {"MEGATRON_LORA_PATCH_LORA_LINEAR": "maybe"},
        f"MEGATRON_LORA_PATCH_LORA_LINEAR must be one of {BOOLEANS}; got 'maybe'",
    ),
    "strict not a boolean": (
        {"MEGATRON_LORA_STRICT": "maybe"},
        f"MEGATRON_LORA_STRICT must be one of {BOOLEANS}; got 'maybe'",
    ),
    "allow-untested not a boolean": (
        {"MEGATRON_LORA_ALLOW_UNTESTED": "sometimes"},
        f"MEGATRON_LORA_ALLOW_UNTESTED must be one of {BOOLEANS}; got 'sometimes'",
    ),
    "force flag not a boolean": (
        {"MEGATRON_LORA_CPU_COMPAT_FORCE": "maybe"},
        f"MEGATRON_LORA_CPU_COMPAT_FORCE must be one of {BOOLEANS}; got 'maybe'",
    ),
    "old force flag name": (
        {"MEGATRON_LORA_PATCH_CPU_COMPAT_FORCE": "1"},
        "MEGATRON_LORA_PATCH_CPU_COMPAT_FORCE was renamed MEGATRON_LORA_CPU_COMPAT_FORCE; set that instead",
    ),
    "disabled patch typo": (
        {"MEGATRON_LORA_DISABLED_PATCHES": "lora_linaer"},
        "MEGATRON_LORA_DISABLED_PATCHES names unknown patch 'lora_linaer'; did you mean 'lora_linear'?",
    ),
    "disabled patches separated by a blank": (
        {"MEGATRON_LORA_DISABLED_PATCHES": "finalize_grads loss_normalization"},
        "MEGATRON_LORA_DISABLED_PATCHES names unknown patch 'finalize_grads loss_normalization' "
        "(separate names with commas); did you mean 'loss_normalization'?",
    ),
    "patch flag names no patch": (
        {"MEGATRON_LORA_PATCH_LORA_LINAER": "0"},
        "MEGATRON_LORA_PATCH_LORA_LINAER names no known patch; did you mean MEGATRON_LORA_PATCH_LORA_LINEAR?",
    ),
    "cpu_compat flag without its plugin": (  # the CPU support is the cpu_testbed plugin (issue 27)
        {"MEGATRON_LORA_PATCH_CPU_COMPAT": "1"},
        "MEGATRON_LORA_PATCH_CPU_COMPAT names cpu_compat, a patch of the cpu_testbed plugin, which MEGATRON_PLUGINS "
        "does not name; add the plugin (MEGATRON_PLUGINS=lora_correct,cpu_testbed turns cpu_compat on) or unset "
        "MEGATRON_LORA_PATCH_CPU_COMPAT",
    ),
    "cpu_compat disabled without its plugin": (
        {"MEGATRON_LORA_DISABLED_PATCHES": "cpu_compat"},
        "MEGATRON_LORA_DISABLED_PATCHES names cpu_compat, a patch of the cpu_testbed plugin, which MEGATRON_PLUGINS "
        "does not name; add the plugin (MEGATRON_PLUGINS=lora_correct,cpu_testbed turns cpu_compat on) or drop "
        "cpu_compat from MEGATRON_LORA_DISABLED_PATCHES",
    ),
    "runtime variable typo": (
        {"MEGATRON_LORA_STRCT": "1"},
        "MEGATRON_LORA_STRCT is not a variable megatron-lora-patch reads; did you mean MEGATRON_LORA_STRICT?",
    ),
    "disabled variable typo": (
        {"MEGATRON_LORA_DISABLED_PATCHS": "lora_linear"},
        "MEGATRON_LORA_DISABLED_PATCHS is not a variable megatron-lora-patch reads; "
        "did you mean MEGATRON_LORA_DISABLED_PATCHES?",
    ),
    "forced on and disabled": (
        {"MEGATRON_LORA_PATCH_LORA_LINEAR": "1", "MEGATRON_LORA_DISABLED_PATCHES": "lora_linear"},
        "MEGATRON_LORA_PATCH_LORA_LINEAR turns lora_linear on but MEGATRON_LORA_DISABLED_PATCHES lists it; "
        "remove one of the two",
    ),
    "former name on, new name off": (  # was silent: the mode stayed off
        {"MEGATRON_LORA_PATCH_TP_INVARIANT": "1", "MEGATRON_LORA_PATCH_LAYOUT_INVARIANT": "0"},
        "MEGATRON_LORA_PATCH_TP_INVARIANT turns layout_invariant on but MEGATRON_LORA_PATCH_LAYOUT_INVARIANT turns "
        "it off; remove one of the two (MEGATRON_LORA_PATCH_TP_INVARIANT is its former name)",
    ),
}


@pytest.mark.parametrize("case", CONFIGURATION)
def test_configuration_mistake_stops_import(case):
    env, message = CONFIGURATION[case]
    result = run_fresh(IMPORT, **{"MEGATRON_PLUGINS": "lora_correct", **env})
    assert_one_line_error(result, message)
    assert result.stdout == ""


@pytest.mark.parametrize(
    "case",
    [
        "plugin typo",
        "patch flag not a boolean",
        "runtime variable typo",
        "old force flag name",
        "disabled patch typo",
        "cpu_compat flag without its plugin",
    ],
)
def test_status_reports_the_same_mistake_with_exit_2(case):
    env, message = CONFIGURATION[case]
    result = run_fresh(STATUS, **{"MEGATRON_PLUGINS": "lora_correct", **env})
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""  # no table that could be read as "applied"


def test_status_prints_its_table_without_megatron_or_torch_warnings_unless_verbose():
    quiet = run_fresh(STATUS, MEGATRON_PLUGINS="lora_correct,cpu_testbed")
    verbose = run_fresh(STATUS + ["-v"], MEGATRON_PLUGINS="lora_correct,cpu_testbed")
    assert quiet.returncode == verbose.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr == "" and quiet.stdout == verbose.stdout
    assert "UserWarning" in verbose.stderr or importlib.util.find_spec("transformer_engine"), verbose.stderr


def test_unknown_variable_without_a_close_name_lists_the_known_ones():
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct", MEGATRON_LORA_XYZZY="1")
    lines = result.stderr.strip().splitlines()
    assert (result.returncode, len(lines), "Traceback" in result.stderr) == (1, 1, False), result.stderr
    head = "megatron-lora-patch: error: MEGATRON_LORA_XYZZY is not a variable megatron-lora-patch reads; known: "
    assert lines[0].startswith(head)
    assert {
        "MEGATRON_LORA_ALLOW_UNTESTED",
        "MEGATRON_LORA_CPU_COMPAT_FORCE",
        "MEGATRON_LORA_STRICT",
        "MEGATRON_LORA_PATCH_LORA_LINEAR",
    } <= set(lines[0][len(head) :].split(", "))


def test_lora_variable_typo_suggests_the_lora_variable():
    from megatron_lora_patch.runtime.plugin_set import PluginSet

    plugins = PluginSet()
    plugins.load("lora_correct")
    assert "MEGATRON_LORA_RANK" in plugins.declared_variables()
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct", MEGATRON_LORA_RNAK="8")
    assert_one_line_error(
        result, "MEGATRON_LORA_RNAK is not a variable megatron-lora-patch reads; did you mean MEGATRON_LORA_RANK?"
    )


def test_unknown_plugin_without_a_close_name_lists_the_installed_ones():
    from megatron_lora_patch.runtime.registry import installed_plugins

    result = run_fresh(IMPORT, MEGATRON_PLUGINS="lora_correct,zzz")
    assert_one_line_error(
        result, f"MEGATRON_PLUGINS names unknown plugin 'zzz'; known: {', '.join(sorted(installed_plugins()))}"
    )


def test_broken_requested_plugin_stops_import():
    result = run_fresh(IMPORT, MEGATRON_PLUGINS="canary", PYTHONPATH=str(PLUGIN_FIXTURES))
    assert_one_line_error(result, "plugin 'canary' failed to load: RuntimeError: canary plugin imported")


def test_empty_means_unset_and_the_patches_apply():
    code = (
        "import megatron.core.tensor_parallel.layers as layers, wrapt; "
        "print(isinstance(layers.linear_with_frozen_weight, wrapt.FunctionWrapper))"
    )
    empty = dict.fromkeys(
        (
            "MEGATRON_LORA_STRICT",
            "MEGATRON_LORA_PATCH_LORA_LINEAR",
            "MEGATRON_LORA_DISABLED_PATCHES",
            "MEGATRON_LORA_XYZZY",
            "MEGATRON_LORA_ALLOW_UNTESTED",
        ),
        "",
    )
    result = run_fresh(["-c", code], MEGATRON_PLUGINS="lora_correct", **empty)
    assert (result.returncode, result.stdout.strip()) == (0, "True"), result.stderr[-2000:]


def test_without_megatron_plugins_nothing_is_read(tmp_path):
    """Nothing is validated or patched; the start-up hook only warns that LoRA is off (docs/fail-closed.md)."""
    from megatron_lora_patch.runtime.bootstrap import WARNING

    checkout = fake_megatron(tmp_path, "0.16.1")
    result = run_fresh(IMPORT, MEGATRON_LORA_STRICT="maybe", MEGATRON_LORA_XYZZY="1", PYTHONPATH=checkout)
    warning = (
        f"{WARNING}MEGATRON_LORA_STRICT is set but MEGATRON_PLUGINS is not, so no LoRA is applied and training "
        "updates every weight; set MEGATRON_PLUGINS=lora_correct (or call megatron_lora_patch.apply() in code)\n"
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "imported\n", warning)


@pytest.mark.parametrize("environ", [{}, {"MEGATRON_PLUGINS": "lora_correct"}])
def test_status_with_an_empty_plugins_option_is_one_line_exit_2(environ):
    """`--plugins ''` previews nothing: it must not be answered as if MEGATRON_PLUGINS were unset."""
    result = run_fresh([*STATUS, "--plugins", ""], **environ)
    message = (
        "--plugins '' names no plugin; give a comma list such as --plugins lora_correct, "
        "or leave --plugins out to show what MEGATRON_PLUGINS selects"
    )
    assert_one_line_error(result, message, returncode=2)
    assert result.stdout == ""


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
        for name in ("lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization")
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
    for name in ("lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization"):
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
