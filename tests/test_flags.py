"""Bad input: each gives one line naming the variable (or argument) and what is accepted."""

import pytest

from megatron_lora_patch.runtime import flags, registry, versions
from megatron_lora_patch.runtime.flags import FlagError

KNOWN = "demo_broken, demo_future, demo_optional, demo_shout, demo_upstream"
BOOLEANS = "1, true, yes, on, 0, false, no, off"


@pytest.mark.parametrize(
    "environ, plugins, enable, error, message",
    [
        (
            {"MEGATRON_LORA_PATCH_DEMO_SHOUT": "maybe"},
            ["demo"],
            None,
            FlagError,
            f"MEGATRON_LORA_PATCH_DEMO_SHOUT must be one of {BOOLEANS}; got 'maybe'",
        ),
        (
            {"MEGATRON_LORA_STRICT": "2"},
            ["demo"],
            None,
            FlagError,
            f"MEGATRON_LORA_STRICT must be one of {BOOLEANS}; got '2'",
        ),
        (
            {"MEGATRON_LORA_DISABLED_PATCHES": "nope"},
            ["demo"],
            None,
            FlagError,
            f"MEGATRON_LORA_DISABLED_PATCHES names unknown patch 'nope'; known: {KNOWN}",
        ),
        (
            {"MEGATRON_LORA_DISABLED_PATCHES": "demo_shout demo_optional"},
            ["demo"],
            None,
            FlagError,
            "MEGATRON_LORA_DISABLED_PATCHES names unknown patch 'demo_shout demo_optional' (separate names with "
            "commas); did you mean 'demo_optional'?",
        ),
        (
            {"MEGATRON_LORA_PATCH_DEMO_SHOUTT": "1"},
            ["demo"],
            None,
            FlagError,
            "MEGATRON_LORA_PATCH_DEMO_SHOUTT names no known patch; did you mean MEGATRON_LORA_PATCH_DEMO_SHOUT?",
        ),
        (
            {"MEGATRON_LORA_PATCH_XYZZY": "1"},
            ["demo"],
            None,
            FlagError,
            "MEGATRON_LORA_PATCH_XYZZY names no known patch; known: MEGATRON_LORA_PATCH_DEMO_BROKEN, "
            "MEGATRON_LORA_PATCH_DEMO_FUTURE, MEGATRON_LORA_PATCH_DEMO_OPTIONAL, MEGATRON_LORA_PATCH_DEMO_SHOUT, "
            "MEGATRON_LORA_PATCH_DEMO_UPSTREAM",
        ),
        (
            {"MEGATRON_LORA_STRCT": "1"},
            ["demo"],
            None,
            FlagError,
            "MEGATRON_LORA_STRCT is not a variable megatron-lora-patch reads; did you mean MEGATRON_LORA_STRICT?",
        ),
        (
            {"MEGATRON_LORA_ALLOW_UNTESTED": "perhaps"},
            ["demo"],
            None,
            FlagError,
            f"MEGATRON_LORA_ALLOW_UNTESTED must be one of {BOOLEANS}; got 'perhaps'",
        ),
        (
            {"MEGATRON_LORA_PATCH_DEMO_SHOUT": "1", "MEGATRON_LORA_DISABLED_PATCHES": "demo_shout"},
            ["demo"],
            None,
            FlagError,
            "MEGATRON_LORA_PATCH_DEMO_SHOUT turns demo_shout on but MEGATRON_LORA_DISABLED_PATCHES lists it; "
            "remove one of the two",
        ),
        (
            {},
            ["demo"],
            {"demo_shot": True},
            FlagError,
            "the `enable` argument names unknown patch 'demo_shot'; did you mean 'demo_shout'?",
        ),
        (
            {"MEGATRON_PLUGINS": "nope"},
            None,
            None,
            registry.PluginError,
            "MEGATRON_PLUGINS names unknown plugin 'nope'; known: canary, cpu_testbed, demo, lora_correct",
        ),
        (
            {"MEGATRON_PLUGINS": "lora-correct"},
            None,
            None,
            registry.PluginError,
            "MEGATRON_PLUGINS names unknown plugin 'lora-correct'; did you mean 'lora_correct'?",
        ),
        (
            {"MEGATRON_PLUGINS": " , "},
            None,
            None,
            FlagError,
            "no plugin requested: set MEGATRON_PLUGINS=lora_correct or pass plugins=['lora_correct']",
        ),
        (
            {},
            ["canary"],
            None,
            registry.PluginError,
            "plugin 'canary' failed to load: RuntimeError: canary plugin imported",
        ),
    ],
)
def test_bad_flags_give_one_exact_line(demo_plugins, monkeypatch, environ, plugins, enable, error, message):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    runtime = registry.Runtime()
    with pytest.raises(error) as raised:
        runtime.apply(plugins, enable)
    assert str(raised.value) == message
    runtime.revert()


def test_revert_of_unknown_patch(demo_plugins):
    runtime = registry.Runtime()
    runtime.apply(["demo"])
    with pytest.raises(FlagError) as raised:
        runtime.revert(["demo_shot"])
    assert str(raised.value) == f"cannot revert unknown patch 'demo_shot'; known patches: {KNOWN}"
    runtime.revert()


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: versions.parse_range("0.13+", "lora_linear"),
            "patch 'lora_linear' declares tested range '0.13+', "
            "which is not a PEP 440 specifier (example: '>=0.13,<0.17')",
        ),
        (
            lambda: versions.parse_version("main-branch", "megatron-core"),
            "megatron-core has version 'main-branch', which is not a PEP 440 version",
        ),
        (lambda: versions.out_of_range_reason("lora_linear", ">=0.13,<0.17", versions.Version("0.12.3")), None),
    ],
)
def test_version_strings(call, message):
    if message is None:  # a valid call: returns the refusal reason rather than raising
        assert call() == "megatron-core 0.12.3 is outside the tested range >=0.13,<0.17 of patch lora_linear"
        return
    with pytest.raises(versions.VersionError) as raised:
        call()
    assert str(raised.value) == message


@pytest.fixture
def no_megatron_core_metadata(monkeypatch):
    """A source checkout without dist-info: the distribution metadata knows no megatron-core."""
    import importlib.metadata

    real = importlib.metadata.version

    def version(name):
        if name == versions.DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def test_version_is_read_from_the_imported_package_info_not_cached(no_megatron_core_metadata, monkeypatch):
    import sys
    import types

    for name in ("megatron.core", "megatron.core.package_info"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    on_path = versions.resolved_megatron_core()  # before import: the package_info.py an import would load
    assert on_path is not None and versions.installed_megatron_core() == on_path[0] is not None
    assert "megatron.core" not in sys.modules  # read without importing Megatron
    monkeypatch.setattr(versions, "resolved_megatron_core", lambda: None)
    assert versions.installed_megatron_core() is None  # no metadata and none on the path: nothing to read
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", types.SimpleNamespace(__version__="0.19.2"))
    assert str(versions.installed_megatron_core()) == "0.19.2"  # after import: the imported module's


def test_imported_package_info_beats_the_metadata(monkeypatch):
    import importlib.metadata
    import sys
    import types

    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    monkeypatch.setitem(sys.modules, "megatron.core.package_info", types.SimpleNamespace(__version__="0.99.0"))
    assert importlib.metadata.version("megatron-core") != "0.99.0"
    assert str(versions.installed_megatron_core()) == "0.99.0"


def test_boolean_parsing_forgives_case_and_blanks():
    assert flags.parse_bool("X", " ON ") is True and flags.parse_bool("X", "Off") is False
