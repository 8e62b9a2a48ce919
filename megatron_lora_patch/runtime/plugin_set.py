"""The plugins of this process: exactly those named (entry-point group `megatron_lora_patch.plugins`,
never "all installed"), registered on one pluggy manager, and the patches and variables they declare
(docs/architecture.md section 1, step 3)."""

from __future__ import annotations

import importlib
import importlib.metadata

import pluggy

from megatron_lora_patch.runtime import flags, hookspecs, versions
from megatron_lora_patch.runtime.hookspecs import Settings
from megatron_lora_patch.runtime.outcomes import PluginError
from megatron_lora_patch.runtime.records import PatchRecord

#: The plugins this distribution ships, by name -> module (also its entry points in pyproject.toml, which
#: tests/test_packaging.py keeps equal): found without reading any metadata, so they load from a bare
#: checkout too, and in no time (scanning every distribution's entry points costs ~10 ms).
OWN_PLUGINS = {
    "lora_correct": "megatron_lora_patch.plugins.lora_correct",
    "cpu_testbed": "megatron_lora_patch.plugins.cpu_testbed",
}


class PluginSet:
    """The loaded plugins and the hooks through which they contribute patches and variables."""

    def __init__(self) -> None:
        self._manager = pluggy.PluginManager(hookspecs.PROJECT)
        self._manager.add_hookspecs(hookspecs)

    def names(self) -> list[str]:
        return [name for name, _ in self._manager.list_name_plugin()]

    def load(self, name: str) -> None:
        """Register plugin `name` (once); an unknown or broken plugin is a one-line `PluginError`."""
        if self._manager.has_plugin(name):
            return
        entry_point = None if name in OWN_PLUGINS else installed_plugins().get(name)
        if name not in OWN_PLUGINS and entry_point is None:
            problem = f"{flags.PLUGINS_VARIABLE} names unknown plugin {name!r}"
            raise PluginError(flags.unknown_name(problem, name, {**OWN_PLUGINS, **installed_plugins()}))
        try:
            plugin = importlib.import_module(OWN_PLUGINS[name]) if entry_point is None else entry_point.load()
        except Exception as error:
            raise PluginError(f"plugin {name!r} failed to load: {type(error).__name__}: {error}") from error
        self._manager.register(plugin, name=name)
        self._manager.check_pending()

    def collect_patches(self, records: dict[str, PatchRecord]) -> None:
        """Add a record for every patch of a plugin not collected yet; a name declared twice is refused."""
        collected = {record.plugin for record in records.values()}
        for hookimpl in self._manager.hook.megatron_lora_patch_patches.get_hookimpls():
            if hookimpl.plugin_name in collected:
                continue
            for spec in hookimpl.function():
                if spec.name in records:
                    raise PluginError(
                        f"patch {spec.name!r} is declared by both {records[spec.name].plugin!r} "
                        f"and {hookimpl.plugin_name!r}"
                    )
                versions.parse_range(spec.versions, spec.name)  # a bad declaration fails now
                records[spec.name] = PatchRecord(spec=spec, plugin=hookimpl.plugin_name)

    def declared_variables(self) -> set[str]:
        """The MEGATRON_LORA_* variables the loaded plugins read (hook `megatron_lora_patch_env_variables`)."""
        return {name for names in self._manager.hook.megatron_lora_patch_env_variables() for name in names}

    def configure(self, settings: Settings) -> None:
        """Let every plugin validate its own variables (a `UsageError` stops the apply)."""
        self._manager.hook.megatron_lora_patch_configure(settings=settings)


def installed_plugins() -> dict[str, importlib.metadata.EntryPoint]:
    """Entry points of the plugin group by name. Listing them imports nothing."""
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)}
