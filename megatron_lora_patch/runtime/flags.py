"""Environment flags of the runtime, parsed strictly: a bad value or an unknown name is one clear
error (docs/fail-closed.md). An empty value means unset, for every variable.

Precedence (docs/architecture.md section 3): explicit API argument > environment > patch default.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Iterable, Mapping, Optional

from megatron_lora_patch.runtime.errors import UsageError

PLUGINS_VARIABLE = "MEGATRON_PLUGINS"
VARIABLE_PREFIX = "MEGATRON_LORA_"
DISABLED_VARIABLE = "MEGATRON_LORA_DISABLED_PATCHES"
STRICT_VARIABLE = "MEGATRON_LORA_STRICT"
ALLOW_UNTESTED_VARIABLE = "MEGATRON_LORA_ALLOW_UNTESTED"
CPU_COMPAT_FORCE_VARIABLE = "MEGATRON_LORA_CPU_COMPAT_FORCE"
#: Megatron-LM checkpoints of a LoRA run (`lora.checkpoints.workflow`): keep full checkpoints instead of
#: adapter-sized ones; let a LoRA run start from a randomly initialised base (tests).
FULL_CHECKPOINTS_VARIABLE = "MEGATRON_LORA_FULL_CHECKPOINTS"
ALLOW_RANDOM_BASE_VARIABLE = "MEGATRON_LORA_ALLOW_RANDOM_BASE"
PATCH_VARIABLE_PREFIX = "MEGATRON_LORA_PATCH_"

#: Variables that were renamed: the old name fails with the new one.
RENAMED = {"MEGATRON_LORA_PATCH_CPU_COMPAT_FORCE": CPU_COMPAT_FORCE_VARIABLE}

#: Patches that were renamed: the old name (argument, `MEGATRON_LORA_PATCH_<OLD>`, disabled list)
#: still works for the new one, with a one-line deprecation warning.
RENAMED_PATCHES = {"tp_invariant": "layout_invariant"}
_warned_renames: set = set()

#: Patches of a plugin that a run may forget to name: an unknown patch name found here names its plugin.
PLUGIN_OF_PATCH = {"cpu_compat": "cpu_testbed"}

#: The runtime's own boolean variables (each validated at activation).
BOOLEAN_VARIABLES = (
    STRICT_VARIABLE, ALLOW_UNTESTED_VARIABLE, CPU_COMPAT_FORCE_VARIABLE, FULL_CHECKPOINTS_VARIABLE,
    ALLOW_RANDOM_BASE_VARIABLE,
)
RUNTIME_VARIABLES = (DISABLED_VARIABLE, *BOOLEAN_VARIABLES)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
ACCEPTED_BOOLEANS = ", ".join(_TRUE + _FALSE)


class FlagError(UsageError, ValueError):
    """A flag has a value or name the runtime cannot accept; the message names variable and fix."""


def closest(name: str, candidates: Iterable[str], prefix: str = "") -> Optional[str]:
    """The candidate `name` most likely meant (case, '-' and blanks forgiven; a `prefix` they all
    share is left out of the comparison, so it does not make every pair look alike), or None."""

    def key(text: str) -> str:
        return text.strip().removeprefix(prefix).lower().replace("-", "_")

    normalized = {key(candidate): candidate for candidate in candidates}
    close = difflib.get_close_matches(key(name), sorted(normalized), n=1, cutoff=0.6)
    return normalized[close[0]] if close else None


def unknown_name(problem: str, name: str, candidates: Iterable[str], quote=repr, prefix: str = "") -> str:
    """`problem` plus a "did you mean" (or, with no close candidate, the known names)."""
    candidates = sorted(candidates)
    if " " in name.strip():
        problem += " (separate names with commas)"
    suggestion = closest(name, candidates, prefix)
    if suggestion is not None:
        return f"{problem}; did you mean {quote(suggestion)}?"
    return f"{problem}; known: {', '.join(candidates) or 'none'}"


def parse_bool(variable: str, value: str) -> bool:
    normalized = value.strip().lower()
    if normalized in _TRUE:
        return True
    if normalized in _FALSE:
        return False
    raise FlagError(f"{variable} must be one of {ACCEPTED_BOOLEANS}; got {value!r}")


def env_bool(variable: str, environ: Mapping[str, str] = os.environ) -> Optional[bool]:
    """The boolean value of `variable`, or None when it is unset or empty."""
    value = environ.get(variable, "")
    return parse_bool(variable, value) if value.strip() else None


def parse_names(value: str) -> list[str]:
    """A comma list of names (plugins or patches); blanks around items are ignored. Whether each
    name exists is checked by the caller, which knows the candidates."""
    return [item.strip() for item in value.split(",") if item.strip()]


def requested_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    return parse_names(environ.get(PLUGINS_VARIABLE, ""))


def check_booleans(environ: Mapping[str, str] = os.environ) -> None:
    """Every runtime boolean parses (whether or not this process reads it)."""
    for variable in BOOLEAN_VARIABLES:
        env_bool(variable, environ)


def strict(explicit: Optional[bool] = None, environ: Mapping[str, str] = os.environ) -> bool:
    if explicit is not None:
        return explicit
    return bool(env_bool(STRICT_VARIABLE, environ))


def patch_variable(patch_name: str) -> str:
    return PATCH_VARIABLE_PREFIX + patch_name.upper()


def current_patch_name(name: str, where: str = "the patch name") -> str:
    """`name`, or the new name of a renamed patch (warned once per old name and place)."""
    new = RENAMED_PATCHES.get(name)
    if new is None:
        return name
    if (name, where) not in _warned_renames:
        _warned_renames.add((name, where))
        logging.getLogger("megatron_lora_patch").warning(
            "megatron-lora-patch: %s %r is deprecated; it now means %r (use that name)", where, name, new)
    return new


def _forced(name: str, environ: Mapping[str, str]) -> Optional[bool]:
    """The boolean `MEGATRON_LORA_PATCH_<NAME>` sets, or a renamed patch's old variable (None: neither is set).
    Both set to the same value is fine; to different values is one line (neither silently wins)."""
    forced = env_bool(patch_variable(name), environ)
    for old, new in RENAMED_PATCHES.items():
        former = env_bool(patch_variable(old), environ) if new == name else None
        if former is None:
            continue
        current_patch_name(old, patch_variable(old))
        if forced is not None and forced != former:
            raise FlagError(
                f"{patch_variable(old)} turns {name} {'on' if former else 'off'} but {patch_variable(name)} turns "
                f"it {'on' if forced else 'off'}; remove one of the two ({patch_variable(old)} is its former name)"
            )
        forced = former
    return forced


def _unloaded_plugin(where: str, patch: str, otherwise: str) -> Optional[str]:
    """The one line for a patch of a plugin `MEGATRON_PLUGINS` does not name, else None."""
    plugin = PLUGIN_OF_PATCH.get(patch)
    if plugin is None:
        return None
    return (
        f"{where} names {patch}, a patch of the {plugin} plugin, which {PLUGINS_VARIABLE} does not name; "
        f"add the plugin ({PLUGINS_VARIABLE}=lora_correct,{plugin} turns {patch} on) or {otherwise}"
    )


def check_variable_names(
    patch_names: Iterable[str], declared: Iterable[str], environ: Mapping[str, str] = os.environ
) -> None:
    """Every set `MEGATRON_LORA_*` variable is one somebody reads: the runtime's own, a patch
    flag, or one a loaded plugin declared. A typo (`MEGATRON_LORA_RNAK`) fails with a suggestion."""
    patch_flags = {patch_variable(name) for name in patch_names}
    patch_flags |= {patch_variable(old) for old, new in RENAMED_PATCHES.items() if new in patch_names}
    known = set(RUNTIME_VARIABLES) | patch_flags | set(declared)
    for variable in sorted(environ):
        if not variable.startswith(VARIABLE_PREFIX) or variable in known or not environ[variable].strip():
            continue
        if variable in RENAMED:
            raise FlagError(f"{variable} was renamed {RENAMED[variable]}; set that instead")
        if variable.startswith(PATCH_VARIABLE_PREFIX):
            elsewhere = _unloaded_plugin(variable, variable[len(PATCH_VARIABLE_PREFIX):].lower(), f"unset {variable}")
            if elsewhere:
                raise FlagError(elsewhere)
            problem = f"{variable} names no known patch"
            raise FlagError(unknown_name(problem, variable, patch_flags, str, PATCH_VARIABLE_PREFIX))
        problem = f"{variable} is not a variable megatron-lora-patch reads"
        raise FlagError(unknown_name(problem, variable, known, str, VARIABLE_PREFIX))


def resolve_enabled(
    patch_defaults: Mapping[str, bool],
    explicit: Optional[Mapping[str, bool]] = None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, tuple[bool, str]]:
    """Decide for each patch whether it is enabled and why: 'arg', 'env' or 'default'."""
    known = sorted(patch_defaults)
    explicit = {current_patch_name(name, "the `enable` argument"): value for name, value in (explicit or {}).items()}
    check_known("the `enable` argument", explicit, known)
    disabled = [current_patch_name(name, DISABLED_VARIABLE) for name in parse_names(environ.get(DISABLED_VARIABLE, ""))]
    check_known(DISABLED_VARIABLE, disabled, known)

    decisions: dict[str, tuple[bool, str]] = {}
    for name, default in patch_defaults.items():
        forced = _forced(name, environ)
        if forced is True and name in disabled:
            raise FlagError(
                f"{patch_variable(name)} turns {name} on but {DISABLED_VARIABLE} lists it; remove one of the two"
            )
        if name in explicit:
            decisions[name] = (bool(explicit[name]), "arg")
        elif forced is not None:
            decisions[name] = (forced, "env")
        elif name in disabled:
            decisions[name] = (False, "env")
        else:
            decisions[name] = (default, "default")
    return decisions


def check_known(where: str, names: Iterable[str], known: Iterable[str], what: str = "patch") -> None:
    for name in names:
        if name not in known:
            elsewhere = _unloaded_plugin(where, name, f"drop {name} from {where}") if what == "patch" else None
            if elsewhere:
                raise FlagError(elsewhere)
            raise FlagError(unknown_name(f"{where} names unknown {what} {name!r}", name, known))
