"""Environment flags of the runtime, parsed strictly: a bad value or an unknown name is one clear
error (docs/fail-closed.md). An empty value means unset, for every variable.

Precedence (docs/architecture.md section 3): explicit API argument > environment > patch default.
"""

from __future__ import annotations

import difflib
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


def check_variable_names(
    patch_names: Iterable[str], declared: Iterable[str], environ: Mapping[str, str] = os.environ
) -> None:
    """Every set `MEGATRON_LORA_*` variable is one somebody reads: the runtime's own, a patch
    flag, or one a loaded plugin declared. A typo (`MEGATRON_LORA_RNAK`) fails with a suggestion."""
    patch_flags = {patch_variable(name) for name in patch_names}
    known = set(RUNTIME_VARIABLES) | patch_flags | set(declared)
    for variable in sorted(environ):
        if not variable.startswith(VARIABLE_PREFIX) or variable in known or not environ[variable].strip():
            continue
        if variable in RENAMED:
            raise FlagError(f"{variable} was renamed {RENAMED[variable]}; set that instead")
        if variable.startswith(PATCH_VARIABLE_PREFIX):
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
    explicit = dict(explicit or {})
    check_known("the `enable` argument", explicit, known)
    disabled = parse_names(environ.get(DISABLED_VARIABLE, ""))
    check_known(DISABLED_VARIABLE, disabled, known)

    decisions: dict[str, tuple[bool, str]] = {}
    for name, default in patch_defaults.items():
        forced = env_bool(patch_variable(name), environ)
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
            raise FlagError(unknown_name(f"{where} names unknown {what} {name!r}", name, known))
