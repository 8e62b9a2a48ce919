"""The registry in-process: apply / revert / idempotence / atomic failure / gates / precedence.

Each test uses a fresh `Runtime`, so the process-wide one stays untouched. Import-order
and fresh-interpreter behaviour are in test_bootstrap.py.
"""

import logging

import pytest

from megatron_lora_patch import runtime


@pytest.fixture
def target(demo_plugins):
    import demo_target

    return demo_target


@pytest.fixture
def fresh():
    registry = runtime.Runtime()
    yield registry
    registry.revert()


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


def test_failure_half_way_leaves_nothing_applied(target, fresh, caplog):
    original = target.Greeter.__dict__["hello"]
    with caplog.at_level(logging.ERROR, logger="megatron_lora_patch"):
        rows = fresh.apply(["demo"], enable={"demo_broken": True})
    row = next(r for r in rows if r.patch == "demo_broken")
    assert row.state == "failed" and "RuntimeError: boom half way" in row.detail
    assert target.Greeter.__dict__["hello"] is original
    assert "patch demo_broken failed on demo_target, nothing of it is applied" in caplog.text
    assert states(rows)["demo_shout"] == "applied"  # one broken patch does not stop the others


def test_failure_raises_in_strict_mode(target, fresh):
    original = target.Greeter.__dict__["hello"]
    with pytest.raises(runtime.PatchError, match="patch demo_broken failed on demo_target.*strict mode"):
        fresh.apply(["demo"], enable={"demo_broken": True}, strict=True)
    assert target.Greeter.__dict__["hello"] is original


def test_skip_patch_reverts_and_reports_reason(target, fresh):
    original = target.Greeter.__dict__["hello"]
    row = next(r for r in fresh.apply(["demo"], enable={"demo_upstream": True}) if r.patch == "demo_upstream")
    assert (row.state, row.detail) == ("skipped", "already upstream")
    assert target.Greeter.__dict__["hello"] is original


def test_version_gate_warns_and_skips(target, fresh, caplog):
    original = target.farewell
    with caplog.at_level(logging.WARNING, logger="megatron_lora_patch"):
        rows = fresh.apply(["demo"], enable={"demo_future": True})
    row = next(r for r in rows if r.patch == "demo_future")
    assert row.state == "skipped"
    assert row.detail == f"demo_future: megatron-core {row.installed} is outside the tested range >=99"
    assert f"skipped demo_future: megatron-core {row.installed} is outside the tested range >=99" in caplog.text
    assert target.farewell is original


def test_version_gate_raises_in_strict_mode(target, fresh, monkeypatch):
    monkeypatch.setenv("MEGATRON_LORA_STRICT", "1")
    with pytest.raises(runtime.PatchError, match=r"outside the tested range >=99 \(strict mode\)"):
        fresh.apply(["demo"], enable={"demo_future": True})


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


def test_plugins_see_resolved_settings(target, fresh):
    import demo_plugin

    fresh.apply(["demo"], enable={"demo_optional": True}, strict=False)
    settings = demo_plugin.CONFIGURED[-1]
    assert settings.plugins == ("demo",) and settings.strict is False
    assert settings.enabled["demo_optional"] is True and settings.enabled["demo_broken"] is False


def test_status_rows_describe_every_patch(target, fresh):
    row = next(r for r in fresh.apply(["demo"]) if r.patch == "demo_shout")
    assert row.as_dict() == {
        "plugin": "demo",
        "patch": "demo_shout",
        "target": "demo_target",
        "tested": ">=0.13",
        "installed": row.installed,
        "enabled": True,
        "source": "default",
        "state": "applied",
        "detail": "",
    }
