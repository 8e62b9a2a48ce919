"""Fresh interpreters with the wheel installed: the `.pth` start-up hook, both import orders,
every apply / revert / re-apply ordering, a broken unrequested plugin never mattering, and a
requested one stopping the run (fail closed). Editable installs: tests/test_editable_install.py."""

import json
import pathlib

import pytest
from conftest import run_python
from patch_loading import every_patch_loads

LOADED = (
    "import sys; print(json.dumps(sorted(m for m in sys.modules "
    "if m.split('.')[0] in ('megatron', 'megatron_lora_patch', 'wrapt', 'pluggy', 'demo_plugin', 'canary_plugin'))))"
)


def loaded_modules(python, **env):
    result = run_python(python, "import json; " + LOADED, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_unset_means_nothing_imported(installed_python):
    assert loaded_modules(installed_python) == []
    assert loaded_modules(installed_python, MEGATRON_PLUGINS="") == []


def test_set_imports_only_the_stdlib_bootstrap_until_megatron(installed_python):
    assert loaded_modules(installed_python, MEGATRON_PLUGINS="demo") == [
        "megatron_lora_patch",
        "megatron_lora_patch.runtime",
        "megatron_lora_patch.runtime.bootstrap",
    ]


@pytest.mark.parametrize("first", ["megatron", "demo_target"])
def test_patch_applied_on_import_in_both_orders(installed_python, first):
    second = "demo_target" if first == "megatron" else "megatron"
    code = f"import {first}, {second}, demo_target; print(demo_target.greet(), demo_target.greet.__wrapped__.__name__)"
    result = run_python(installed_python, code, MEGATRON_PLUGINS="demo")
    assert (result.returncode, result.stdout.split(), result.stderr) == (0, ["HELLO", "greet"], "")


def test_unnamed_plugin_is_never_imported(installed_python):
    code = "import megatron, demo_target, json, sys; print(json.dumps('canary_plugin' in sys.modules))"
    result = run_python(installed_python, code, MEGATRON_PLUGINS="demo")
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "false", "")


def test_broken_requested_plugin_stops_the_import_with_one_line(installed_python):
    from conftest import assert_one_line_error

    result = run_python(
        installed_python, "import megatron, demo_target; print(demo_target.greet())", MEGATRON_PLUGINS="canary"
    )
    assert_one_line_error(result, "plugin 'canary' failed to load: RuntimeError: canary plugin imported")
    assert result.stdout == ""


def test_bad_flag_at_start_up_stops_the_import(installed_python):
    from conftest import assert_one_line_error

    result = run_python(installed_python, "import megatron; print('ok')", MEGATRON_PLUGINS="lora-correct")
    assert_one_line_error(result, "MEGATRON_PLUGINS names unknown plugin 'lora-correct'; did you mean 'lora_correct'?")
    assert result.stdout == ""


LORA_OFF = (
    "MEGATRON_LORA_RANK is set but MEGATRON_PLUGINS is not, so no LoRA is applied and training updates every weight; "
    "set MEGATRON_PLUGINS=lora_correct (or call megatron_lora_patch.apply() in code)"
)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"MEGATRON_LORA_RANK": "8"}, [LORA_OFF]),
        (
            {"MEGATRON_PLUGIN": "lora_correct"},
            ["MEGATRON_PLUGIN is not a variable megatron-lora-patch reads; did you mean MEGATRON_PLUGINS?"],
        ),
        (
            {"megatron_lora_rank": "8"},
            ["megatron_lora_rank is not read (variable names are case-sensitive); rename it MEGATRON_LORA_RANK"],
        ),
        (
            {"megatron_lora_rank": "8", "MEGATRON_PLUGINS": "demo"},
            ["megatron_lora_rank is not read (variable names are case-sensitive); rename it MEGATRON_LORA_RANK"],
        ),
    ],
)
def test_lora_meant_but_not_read_warns_once_at_import_megatron(installed_python, env, expected):
    """A forgotten or misspelled variable would turn a LoRA job into full fine-tuning without a word: the
    start-up hook names it and the fix, at `import megatron` only (a plain `python -c pass` stays silent)."""
    from megatron_lora_patch.runtime.bootstrap import WARNING

    result = run_python(installed_python, "import megatron; print('ok')", **env)
    assert (result.returncode, result.stdout) == (0, "ok\n"), result.stderr
    assert result.stderr.splitlines() == [WARNING + line for line in expected]
    quiet = run_python(installed_python, "print('ok')", **env)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "ok\n", "")


def test_lora_variables_without_plugins_are_quiet_when_used_from_code(installed_python):
    """Negative controls: `apply()` / the CLI configure LoRA in code, so MEGATRON_LORA_* without
    MEGATRON_PLUGINS is no mistake there; and without any MEGATRON_* variable no module is imported."""
    code = "import megatron_lora_patch.runtime.registry, megatron; print('ok')"
    result = run_python(installed_python, code, MEGATRON_LORA_RANK="8")
    assert (result.returncode, result.stdout, result.stderr) == (0, "ok\n", "")
    assert loaded_modules(installed_python, MEGATRON_LORA_RANK="") == []


def test_no_site_start_up_is_unaffected(installed_python):
    result = run_python(installed_python, "print('ok')", args=("-S",), MEGATRON_PLUGINS="demo")
    assert (result.returncode, result.stdout.strip()) == (0, "ok")


ORDERINGS = {
    "apply, import": ["apply", "import"],
    "import, apply": ["import", "apply"],
    "apply, apply, import": ["apply", "apply", "import"],
    "import, apply, revert": ["import", "apply", "revert"],
    "apply, revert, import": ["apply", "revert", "import"],
    "import, apply, revert, apply": ["import", "apply", "revert", "apply"],
    "apply, import, revert, apply, apply": ["apply", "import", "revert", "apply", "apply"],
}
STEPS = {
    "apply": "megatron_lora_patch.apply(['demo'])",
    "revert": "megatron_lora_patch.revert()",
    "import": "import demo_target",
}


@pytest.mark.parametrize("name", ORDERINGS)
def test_every_ordering_wraps_at_most_once(installed_python, name):
    steps = ORDERINGS[name]
    code = (
        "import megatron_lora_patch, wrapt\n"
        + "\n".join(STEPS[step] for step in steps)
        + "\nimport demo_target\n"
        + (
            "greet = demo_target.greet\n"
            "depth = 0\n"
            "while isinstance(greet, wrapt.FunctionWrapper):\n"
            "    greet, depth = greet.__wrapped__, depth + 1\n"
            "print(depth, demo_target.greet())\n"
        )
    )
    result = run_python(installed_python, code)
    last_change = [step for step in steps if step != "import"][-1]
    expected = "1 HELLO" if last_change == "apply" else "0 hello"
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, expected, "")


def test_status_command_in_fresh_interpreter(installed_python):
    result = run_python(
        installed_python,
        "from megatron_lora_patch.cli import main; raise SystemExit(main(['status', '--json']))",
        MEGATRON_PLUGINS="demo",
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    rows = {row["patch"]: row for row in document["patches"]}
    assert document["plugins"] == ["demo"]
    assert rows["demo_shout"]["state"] == "applied"
    assert rows["demo_optional"]["state"] == "disabled"


def test_wheel_ships_every_module_and_no_bare_patches(installed_python):
    """Every source module is importable from the installed wheel; `patches` only as a subpackage."""
    from conftest import REPO

    sources = sorted(
        [
            "megatron_lora_patch." + ".".join(p.relative_to(REPO / "megatron_lora_patch").with_suffix("").parts)
            for p in (REPO / "megatron_lora_patch").rglob("*.py")
        ]
        + ["megatron_lora_patch.patches." + p.stem for p in (REPO / "patches").glob("*.py")]
    )
    sources = [name.removesuffix(".__init__") for name in sources]
    code = (
        "import importlib.util, json, sys\n"
        f"names = {sources!r}\n"
        "missing = [n for n in names if importlib.util.find_spec(n) is None]\n"
        "print(json.dumps([missing, importlib.util.find_spec('patches') is None]))\n"
    )
    result = run_python(installed_python, code, plugins=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == [[], True]


def test_wheel_loads_every_patch(installed_python):
    """The wheel's `megatron_lora_patch/patches/` (the checkout's top-level `patches/`, mapped by setup.py)
    holds every patch, and the plugins find them all there; the checkout finder never installs in a wheel."""
    package_file, checkout_finder, directory = every_patch_loads(installed_python, pathlib.Path(__file__).parent)
    assert package_file.is_relative_to(installed_python.parent.parent)  # the wheel's environment, not the checkout
    assert directory == package_file.parent / "patches"
    assert not checkout_finder


def test_status_table_and_module_entry_point(installed_python):
    result = run_python(
        installed_python,
        "import runpy; runpy.run_module('megatron_lora_patch', run_name='__main__')",
        args=(),
        MEGATRON_PLUGINS="demo",
    )
    assert result.returncode == 2 and "the following arguments are required: command" in result.stderr
    code = (
        "import sys; sys.argv = ['megatron-lora-patch', 'status']; "
        "import runpy; runpy.run_module('megatron_lora_patch', run_name='__main__')"
    )
    result = run_python(installed_python, code, MEGATRON_PLUGINS="demo")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "plugin",
        "patch",
        "tested",
        "megatron-core",
        "enabled",
        "fresh",
        "process",
        "this",
        "process",
    ]
    shout = lines.index(next(line for line in lines if line.split()[:2] == ["demo", "demo_shout"]))
    assert lines[shout].split()[-4:] == ["on", "(default)", "applied", "applied"]
    assert lines[shout + 1].strip() == "target demo_target:greet"  # what its patcher recorded
    pth = installed_python.parent.parent / "lib"
    (hook_file,) = pth.glob("python3*/site-packages/megatron_lora_patch-init.pth")
    assert lines[-2] == f"start-up hook: installed at {hook_file} (ran in this process)"
    assert lines[-1].startswith("megatron-core: ") and " imported from " in lines[-1]  # which one the run imports


def test_status_when_plugins_unset(installed_python):
    code = "from megatron_lora_patch.cli import main; raise SystemExit(main(['status']))"
    result = run_python(installed_python, code)
    assert result.returncode == 0
    assert result.stdout.startswith(
        "MEGATRON_PLUGINS is unset: no plugin is active and nothing is patched. "
        "Installed plugins: canary, cpu_testbed, demo, lora_correct."
    )


def test_lora_correct_applied_on_plain_megatron_import(installed_python):
    """The issue's "done when": MEGATRON_PLUGINS=lora_correct + `import megatron.core.tensor_parallel.layers`."""
    code = (
        "import json, megatron.core.tensor_parallel.layers as layers, megatron_lora_patch, wrapt\n"
        "rows = {r.patch: r.state for r in megatron_lora_patch.status()}\n"
        "wrapped = isinstance(layers.linear_with_frozen_weight, wrapt.FunctionWrapper)\n"
        "print(json.dumps([rows, wrapped]))\n"
    )
    result = run_python(installed_python, code, plugins=False, MEGATRON_PLUGINS="lora_correct")
    assert result.returncode == 0, result.stderr[-2000:]
    rows, wrapped = json.loads(result.stdout.strip().splitlines()[-1])
    assert wrapped
    assert rows["lora_linear"] == "applied" and rows["lora_checkpoint"] == "applied"
    assert rows["null_tokenizer"] == rows["layout_invariant"] == "disabled"  # opt-in patches
    assert "cpu_compat" not in rows  # the CPU host support is the cpu_testbed plugin, never production
    assert rows["finalize_grads"] in ("applied", "not imported yet")
