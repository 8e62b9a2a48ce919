"""Fresh interpreters with the wheel installed: the `.pth` start-up hook, both import orders,
every apply / revert / re-apply ordering, and a broken plugin never breaking start-up."""

import json

import pytest

from conftest import run_python

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
        "megatron_lora_patch._bootstrap",
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


def test_broken_plugin_reports_once_and_import_survives(installed_python):
    result = run_python(installed_python, "import megatron, demo_target; print(demo_target.greet())", MEGATRON_PLUGINS="canary")
    assert result.returncode == 0 and result.stdout.strip() == "hello"
    assert result.stderr == (
        "megatron-lora-patch: activation on `import megatron` failed, no patch applied: PluginError: "
        "plugin 'canary' failed to load: RuntimeError: canary plugin imported (set MEGATRON_LORA_STRICT=1 to raise instead)\n"
    )


def test_broken_plugin_raises_in_strict_mode(installed_python):
    result = run_python(installed_python, "import megatron", MEGATRON_PLUGINS="canary", MEGATRON_LORA_STRICT="1")
    assert result.returncode == 1
    assert "PluginError: plugin 'canary' failed to load" in result.stderr


def test_bad_flag_at_start_up_does_not_crash(installed_python):
    result = run_python(installed_python, "import megatron; print('ok')", MEGATRON_PLUGINS="lora-correct")
    assert result.returncode == 0 and result.stdout.strip() == "ok"
    assert "MEGATRON_PLUGINS must be a comma-separated list of names" in result.stderr


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
    code = "import megatron_lora_patch, wrapt\n" + "\n".join(STEPS[step] for step in steps) + "\nimport demo_target\n" + (
        "greet = demo_target.greet\n"
        "depth = 0\n"
        "while isinstance(greet, wrapt.FunctionWrapper):\n"
        "    greet, depth = greet.__wrapped__, depth + 1\n"
        "print(depth, demo_target.greet())\n"
    )
    result = run_python(installed_python, code)
    last_change = [step for step in steps if step != "import"][-1]
    expected = "1 HELLO" if last_change == "apply" else "0 hello"
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, expected, "")


def test_status_command_in_fresh_interpreter(installed_python):
    result = run_python(installed_python, "from megatron_lora_patch.cli import main; raise SystemExit(main(['status', '--json']))", MEGATRON_PLUGINS="demo")
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
        ["megatron_lora_patch." + ".".join(p.relative_to(REPO / "megatron_lora_patch").with_suffix("").parts)
         for p in (REPO / "megatron_lora_patch").rglob("*.py")]
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


def test_status_table_and_module_entry_point(installed_python):
    result = run_python(installed_python, "import runpy; runpy.run_module('megatron_lora_patch', run_name='__main__')",
                        args=(), MEGATRON_PLUGINS="demo")
    assert result.returncode == 2 and "the following arguments are required: command" in result.stderr
    code = "import sys; sys.argv = ['megatron-lora-patch', 'status']; import runpy; runpy.run_module('megatron_lora_patch', run_name='__main__')"
    result = run_python(installed_python, code, MEGATRON_PLUGINS="demo")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["plugin", "patch", "tested", "megatron-core", "enabled", "state"]
    shout = lines.index(next(line for line in lines if line.split()[:2] == ["demo", "demo_shout"]))
    assert lines[shout].split()[-3:] == ["on", "(default)", "applied"]
    assert lines[shout + 1].strip() == "target demo_target"


def test_status_when_plugins_unset(installed_python):
    code = "from megatron_lora_patch.cli import main; raise SystemExit(main(['status']))"
    result = run_python(installed_python, code)
    assert result.returncode == 0
    assert result.stdout.startswith("MEGATRON_PLUGINS is unset: no plugin is active and nothing is patched. Installed plugins: canary, demo, lora_correct.")


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
    assert rows["cpu_compat"] == rows["null_tokenizer"] == rows["tp_invariant"] == "disabled"  # opt-in patches
    assert rows["finalize_grads"] in ("applied", "not imported yet")
