"""Fail closed (issue 12, docs/fail-closed.md): with MEGATRON_PLUGINS set, every configuration
mistake, every enabled patch that fails to apply and every untested Megatron-Core version stops a
fresh process at `import megatron...` with ONE line and no traceback; `status` reports the same
mistakes with exit 2 (configuration) or 1 (a patch not delivered), and tells the truth about
what a fresh process gets. Each case asserts the exit code and the exact line.

A fake Megatron-Core source checkout (`megatron/core/package_info.py` and what a case needs) on
PYTHONPATH stands in for a checkout or for an untested release; it wins over the installed wheel,
as a `cd Megatron-LM; torchrun pretrain_gpt.py` checkout does. Patches that fail and untested versions:
tests/test_fail_closed_versions.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
from conftest import PLUGIN_FIXTURES, assert_one_line_error, fake_megatron, run_fresh

BOOLEANS = "1, true, yes, on, 0, false, no, off"
IMPORT = ["-c", "import megatron.core; print('imported')"]
STATUS = ["-m", "megatron_lora_patch", "status"]


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
