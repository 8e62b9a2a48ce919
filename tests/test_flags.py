"""Bad input: each gives one line naming the variable (or argument) and what is accepted."""

import pytest

from megatron_lora_patch import flags, runtime, versions
from megatron_lora_patch.flags import FlagError

KNOWN = "demo_broken, demo_future, demo_optional, demo_shout, demo_upstream"
BOOLEANS = "1, true, yes, on, 0, false, no, off"


@pytest.mark.parametrize(
    "environ, plugins, enable, error, message",
    [
        ({"MEGATRON_LORA_PATCH_DEMO_SHOUT": "maybe"}, ["demo"], None, FlagError,
         f"MEGATRON_LORA_PATCH_DEMO_SHOUT must be one of {BOOLEANS}; got 'maybe'"),
        ({"MEGATRON_LORA_STRICT": "2"}, ["demo"], None, FlagError,
         f"MEGATRON_LORA_STRICT must be one of {BOOLEANS}; got '2'"),
        ({"MEGATRON_LORA_DISABLED_PATCHES": "nope"}, ["demo"], None, FlagError,
         f"MEGATRON_LORA_DISABLED_PATCHES names unknown patch 'nope'; known patches: {KNOWN}"),
        ({"MEGATRON_LORA_DISABLED_PATCHES": "demo_shout demo_optional"}, ["demo"], None, FlagError,
         "MEGATRON_LORA_DISABLED_PATCHES must be a comma-separated list of names like 'lora_correct'; "
         "got 'demo_shout demo_optional'"),
        ({"MEGATRON_LORA_PATCH_DEMO_SHOUTT": "1"}, ["demo"], None, FlagError,
         "MEGATRON_LORA_PATCH_DEMO_SHOUTT names no known patch; use one of MEGATRON_LORA_PATCH_DEMO_BROKEN, "
         "MEGATRON_LORA_PATCH_DEMO_FUTURE, MEGATRON_LORA_PATCH_DEMO_OPTIONAL, MEGATRON_LORA_PATCH_DEMO_SHOUT, "
         "MEGATRON_LORA_PATCH_DEMO_UPSTREAM"),
        ({"MEGATRON_LORA_PATCH_DEMO_SHOUT": "1", "MEGATRON_LORA_DISABLED_PATCHES": "demo_shout"}, ["demo"], None,
         FlagError,
         "MEGATRON_LORA_PATCH_DEMO_SHOUT turns demo_shout on but MEGATRON_LORA_DISABLED_PATCHES lists it; "
         "remove one of the two"),
        ({}, ["demo"], {"demo_shot": True}, FlagError,
         f"the `enable` argument names unknown patch 'demo_shot'; known patches: {KNOWN}"),
        ({"MEGATRON_PLUGINS": "nope"}, None, None, runtime.PluginError,
         "MEGATRON_PLUGINS names unknown plugin 'nope'; installed plugins: canary, demo, lora_correct"),
        ({"MEGATRON_PLUGINS": "lora-correct"}, None, None, FlagError,
         "MEGATRON_PLUGINS must be a comma-separated list of names like 'lora_correct'; got 'lora-correct'"),
        ({"MEGATRON_PLUGINS": " , "}, None, None, FlagError,
         "no plugin requested: set MEGATRON_PLUGINS=lora_correct or pass plugins=['lora_correct']"),
        ({}, ["canary"], None, runtime.PluginError,
         "plugin 'canary' failed to load: RuntimeError: canary plugin imported"),
    ],
)
def test_bad_flags_give_one_exact_line(demo_plugins, monkeypatch, environ, plugins, enable, error, message):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    registry = runtime.Runtime()
    with pytest.raises(error) as raised:
        registry.apply(plugins, enable)
    assert str(raised.value) == message
    registry.revert()


def test_revert_of_unknown_patch(demo_plugins):
    registry = runtime.Runtime()
    registry.apply(["demo"])
    with pytest.raises(FlagError) as raised:
        registry.revert(["demo_shot"])
    assert str(raised.value) == f"cannot revert unknown patch 'demo_shot'; known patches: {KNOWN}"
    registry.revert()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: versions.parse_range("0.13+", "lora_linear"),
         "patch 'lora_linear' declares tested range '0.13+', which is not a PEP 440 specifier (example: '>=0.13,<0.17')"),
        (lambda: versions.parse_version("main-branch", "megatron-core"),
         "megatron-core has version 'main-branch', which is not a PEP 440 version"),
        (lambda: versions.out_of_range_reason("lora_linear", ">=0.13,<0.17", versions.Version("0.12.3")),
         None),
    ],
)
def test_version_strings(call, message):
    if message is None:  # a valid call: returns the skip reason rather than raising
        assert call() == "lora_linear: megatron-core 0.12.3 is outside the tested range >=0.13,<0.17"
        return
    with pytest.raises(versions.VersionError) as raised:
        call()
    assert str(raised.value) == message


def test_installed_version_falls_back_to_package_info(monkeypatch):
    import importlib.metadata
    import sys
    import types

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", types.SimpleNamespace(__version__="0.15.3"))
    versions.installed_megatron_core.cache_clear()
    try:
        assert str(versions.installed_megatron_core()) == "0.15.3"
    finally:
        versions.installed_megatron_core.cache_clear()
    assert flags.parse_bool("X", " ON ") is True
