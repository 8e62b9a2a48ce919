"""The registry in-process: apply / revert / idempotence / atomic failure / gates / precedence.

Each test uses a fresh `Runtime`, so the process-wide one stays untouched. Import-order
and fresh-interpreter behaviour are in test_bootstrap.py.
"""

import logging

import pytest

from megatron_lora_patch.runtime import registry


@pytest.fixture
def target(demo_plugins):
    import demo_target

    return demo_target


@pytest.fixture
def fresh():
    runtime = registry.Runtime()
    yield runtime
    runtime.revert()


def states(rows):
    return {row.patch: row.state for row in rows}


def test_apply_wraps_once_and_revert_restores_identity(target, fresh):
    original = target.greet
    fresh.apply(["demo"])
    assert target.greet() == "HELLO"
    assert target.greet.__wrapped__ is original
    fresh.apply(["demo"])  # idempotent: never double wrapped
    assert target.greet.__wrapped__ is original
    fresh.revert()
    assert target.greet is original
    fresh.apply(["demo"])  # re-apply after revert
    assert target.greet() == "HELLO" and target.greet.__wrapped__ is original


def test_default_off_patch_is_disabled_until_enabled(target, fresh):
    original = target.farewell
    assert states(fresh.apply(["demo"]))["demo_optional"] == "disabled"
    assert target.farewell is original
    rows = fresh.apply(["demo"], enable={"demo_optional": True})
    assert states(rows)["demo_optional"] == "applied"
    assert target.farewell() == "BYE"
    fresh.apply(["demo"])  # explicit choices stick: a plain apply keeps it on
    assert target.farewell() == "BYE"
    fresh.apply(["demo"], enable={"demo_optional": False})  # turned off again: reverted
    assert target.farewell is original


def test_failure_half_way_stops_and_leaves_nothing_applied(target, fresh, caplog):
    original = target.Greeter.__dict__["hello"]
    with caplog.at_level(logging.DEBUG, logger="megatron_lora_patch"), pytest.raises(registry.PatchError) as raised:
        fresh.apply(["demo"], enable={"demo_broken": True})
    assert str(raised.value) == (
        "patch demo_broken failed on demo_target, nothing of it is applied: RuntimeError: boom half way; "
        "fix the cause, or set MEGATRON_LORA_DISABLED_PATCHES=demo_broken to knowingly train without it"
    )
    assert target.Greeter.__dict__["hello"] is original
    rows = {row.patch: row for row in fresh.status()}
    assert (rows["demo_broken"].state, rows["demo_broken"].detail) == ("failed", "RuntimeError: boom half way")
    assert rows["demo_shout"].state == "applied"  # the other patches of the module had their turn
    debug = [record for record in caplog.records if record.levelno == logging.DEBUG and record.exc_info]
    assert "boom half way" in str(debug[0].exc_info[1])  # the root cause's traceback, at DEBUG only


def test_failure_stops_whatever_strict_says(target, fresh):
    with pytest.raises(registry.PatchError, match="patch demo_broken failed on demo_target"):
        fresh.apply(["demo"], enable={"demo_broken": True}, strict=False)


def test_skip_patch_reverts_and_reports_reason(target, fresh):
    original = target.Greeter.__dict__["hello"]
    row = next(r for r in fresh.apply(["demo"], enable={"demo_upstream": True}) if r.patch == "demo_upstream")
    assert (row.state, row.detail) == ("skipped", "already upstream")
    assert target.Greeter.__dict__["hello"] is original


def test_version_gate_refuses_untested_version(target, fresh):
    original = target.farewell
    with pytest.raises(registry.PatchError) as raised:
        fresh.apply(["demo"], enable={"demo_future": True})
    row = next(r for r in fresh.status() if r.patch == "demo_future")
    reason = f"megatron-core {row.installed} is outside the tested range >=99 of patch demo_future"
    assert str(raised.value) == (
        f"{reason}; set MEGATRON_LORA_ALLOW_UNTESTED=1 to apply it anyway, "
        "or MEGATRON_LORA_DISABLED_PATCHES=demo_future to train without it"
    )
    assert (row.state, row.detail) == ("untested", reason)
    assert target.farewell is original


def test_allow_untested_applies_with_a_warning(target, fresh, monkeypatch, caplog):
    monkeypatch.setenv("MEGATRON_LORA_ALLOW_UNTESTED", "1")
    with caplog.at_level(logging.WARNING, logger="megatron_lora_patch"):
        row = next(r for r in fresh.apply(["demo"], enable={"demo_future": True}) if r.patch == "demo_future")
    note = (
        f"untested: megatron-core {row.installed} is outside the tested range >=99 of patch demo_future, "
        "applied because MEGATRON_LORA_ALLOW_UNTESTED is on"
    )
    assert (row.state, row.detail) == ("applied", note)
    assert note in caplog.text and target.farewell() == "BYE"


def test_precedence_argument_beats_env_beats_default(target, fresh, monkeypatch):
    monkeypatch.setenv("MEGATRON_LORA_PATCH_DEMO_OPTIONAL", "on")
    monkeypatch.setenv("MEGATRON_LORA_DISABLED_PATCHES", "demo_shout")
    rows = {r.patch: r for r in fresh.apply(["demo"])}
    assert (rows["demo_optional"].enabled, rows["demo_optional"].source) == (True, "env")
    assert (rows["demo_shout"].enabled, rows["demo_shout"].source) == (False, "env")
    rows = {r.patch: r for r in fresh.apply(["demo"], enable={"demo_shout": True, "demo_optional": False})}
    assert (rows["demo_shout"].enabled, rows["demo_shout"].source) == (True, "arg")
    assert (rows["demo_optional"].enabled, rows["demo_optional"].source) == (False, "arg")
    assert (rows["demo_broken"].enabled, rows["demo_broken"].source) == (False, "default")


def test_bad_flag_leaves_every_patch_not_configured(target, fresh, monkeypatch):
    monkeypatch.setenv("MEGATRON_LORA_PATCH_DEMO_SHOUT", "maybe")
    with pytest.raises(registry.flags.FlagError):
        fresh.apply(["demo"])
    assert set(states(fresh.status()).values()) == {"not configured"}  # never "not imported yet"


def test_plugins_see_resolved_settings(target, fresh):
    import demo_plugin

    fresh.apply(["demo"], enable={"demo_optional": True}, strict=False)
    settings = demo_plugin.CONFIGURED[-1]
    assert settings.plugins == ("demo",) and settings.strict is False
    assert settings.enabled["demo_optional"] is True and settings.enabled["demo_broken"] is False


def test_status_rows_describe_every_patch(target, fresh):
    import importlib.metadata

    row = next(r for r in fresh.apply(["demo"]) if r.patch == "demo_shout")
    assert row.as_dict() == {
        "plugin": "demo",
        "patch": "demo_shout",
        "target": "demo_target:greet",  # what its patcher recorded, not a declaration
        "tested": ">=0.13",
        "installed": importlib.metadata.version("megatron-core"),  # package_info agrees with it here
        "enabled": True,
        "source": "default",
        "state": "applied",
        "detail": "",
        "absent": (),
    }


def test_an_applied_patch_names_its_absent_optional_targets(target, fresh):
    """A target module that does not import here (Transformer Engine's extensions without TE, a model family an
    older Megatron-Core lacks) leaves the patch applied; status says how many optional targets are absent."""
    from megatron_lora_patch.cli.status import format_table
    from megatron_lora_patch.runtime.patching import PatchSpec

    fresh.apply(["demo"])
    record = fresh._records["demo_shout"]
    record.spec = PatchSpec("demo_shout", "upper-cases greet()", {"demo_target": None, "demo_absent": None},
                            ">=0.13", True)
    assert fresh.import_targets() is None
    row = {row.patch: row for row in fresh.status()}["demo_shout"]
    assert (row.state, row.detail) == ("applied", "")
    assert row.absent == ("demo_absent (No module named 'demo_absent')",)
    text = format_table([row], ["applied"], {"installed": True, "path": "x", "ran_here": True})
    assert "  applied (1 optional target absent: demo_absent (No module named 'demo_absent'))" in text
    assert "unavailable" not in text


def test_wrap_points_the_modules_that_imported_the_function_at_the_wrapper(monkeypatch, caplog):
    """`Patcher.wrap(..., reexported_by=...)`: an earlier `from x import f` copy gets the wrapper, a later one
    copies it, a copy someone else replaced is left alone with a warning; revert gives every copy the original."""
    import sys
    import types

    from megatron_lora_patch.runtime.patching import Patcher, is_wrapped_by_us

    def original():
        return "original"

    owner, earlier, later, foreign = (types.ModuleType(name) for name in ("owner", "earlier", "later", "foreign"))
    owner.f = earlier.f = original
    foreign.f = lambda: "someone else's"
    for module in (owner, earlier, later, foreign):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    patcher = Patcher()
    with caplog.at_level(logging.WARNING, logger="megatron_lora_patch"):
        proxy = patcher.wrap(owner, "f", lambda wrapped, instance, args, kwargs: "patched",
                             reexported_by=("earlier", "later", "foreign", "not_imported"))
    later.f = owner.f  # imported while patched
    assert owner.f is proxy and earlier.f is proxy and later.f is proxy and earlier.f() == "patched"
    assert foreign.f() == "someone else's" and not is_wrapped_by_us(foreign.f)
    assert ["foreign.f was replaced by someone else; only owner.f is patched" in record.getMessage()
            for record in caplog.records] == [True]
    patcher.revert()
    assert owner.f is original and earlier.f is original and later.f is original
