"""Environment flags of the runtime, parsed strictly: a bad value is one clear error.

Precedence (DESIGN.md section 3): explicit API argument > environment > patch default.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional

PLUGINS_VARIABLE = "MEGATRON_PLUGINS"
DISABLED_VARIABLE = "MEGATRON_LORA_DISABLED_PATCHES"
STRICT_VARIABLE = "MEGATRON_LORA_STRICT"
PATCH_VARIABLE_PREFIX = "MEGATRON_LORA_PATCH_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
ACCEPTED_BOOLEANS = ", ".join(_TRUE + _FALSE)


class FlagError(ValueError):
    """A flag has a value the runtime cannot accept; the message names variable and fix."""


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


def parse_names(variable: str, value: str) -> list[str]:
    """A comma list of identifiers (plugin or patch names); blanks around items are ignored."""
    names = [item.strip() for item in value.split(",") if item.strip()]
    for name in names:
        if not name.isidentifier():
            raise FlagError(
                f"{variable} must be a comma-separated list of names like 'lora_correct'; got {value!r}"
            )
    return names


def requested_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    return parse_names(PLUGINS_VARIABLE, environ.get(PLUGINS_VARIABLE, ""))


def strict(explicit: Optional[bool] = None, environ: Mapping[str, str] = os.environ) -> bool:
    if explicit is not None:
        return explicit
    return bool(env_bool(STRICT_VARIABLE, environ))


def patch_variable(patch_name: str) -> str:
    return PATCH_VARIABLE_PREFIX + patch_name.upper()


def resolve_enabled(
    patch_defaults: Mapping[str, bool],
    explicit: Optional[Mapping[str, bool]] = None,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, tuple[bool, str]]:
    """Decide for each patch whether it is enabled and why: 'arg', 'env' or 'default'.

    Every patch-related variable is validated against the known patch names, so a
    typo (`MEGATRON_LORA_PATCH_LORA_LINAER=0`) fails instead of silently doing nothing.
    """
    known = sorted(patch_defaults)
    explicit = dict(explicit or {})
    _check_known("the `enable` argument", explicit, known)
    disabled = parse_names(DISABLED_VARIABLE, environ.get(DISABLED_VARIABLE, ""))
    _check_known(DISABLED_VARIABLE, disabled, known)
    unknown_variables = sorted(
        variable
        for variable in environ
        if variable.startswith(PATCH_VARIABLE_PREFIX)
        and variable[len(PATCH_VARIABLE_PREFIX):].lower() not in patch_defaults
    )
    if unknown_variables:
        raise FlagError(
            f"{unknown_variables[0]} names no known patch; use one of "
            + ", ".join(patch_variable(name) for name in known)
        )

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


def _check_known(where: str, names: Iterable[str], known: list[str]) -> None:
    for name in names:
        if name not in known:
            raise FlagError(f"{where} names unknown patch {name!r}; known patches: {', '.join(known)}")
