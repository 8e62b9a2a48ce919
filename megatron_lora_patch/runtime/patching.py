"""The patch model: a declarative `PatchSpec` and a transactional `Patcher`.

A patch module (one per target, under `megatron_lora_patch.patches`) exposes
`SPEC = PatchSpec(...)`. Its top level imports only the standard library and this
runtime; Megatron/torch imports happen inside the hook functions, which run when
their target module is imported. Every change a hook makes goes through the
`Patcher` it is given, so a failure half way and `revert()` both restore the exact
originals (`__wrapped__`), and applying twice never wraps twice.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from typing import Any, Callable, Mapping, Sequence

import wrapt

log = logging.getLogger(__name__)

_MARKER = "_self_megatron_lora_patch"

#: A hook patches one imported target module through the given patcher.
PatchHook = Callable[["Patcher", types.ModuleType], None]


@dataclasses.dataclass(frozen=True)
class PatchSpec:
    """What a patch changes, where, for which Megatron-Core versions, and its default.

    `hooks` maps each target module name to the function that patches it; the
    runtime calls a hook once that module is imported. `versions` is a PEP 440
    specifier of the Megatron-Core versions the patch is tested against (the range
    CI runs). Its environment flag is `flags.patch_variable(name)`.

    What a patch really changed is what its `Patcher` recorded (`Patcher.targets`), which
    `status` shows once applied; before that it shows the hook modules (`target_text`).
    """

    name: str
    summary: str
    hooks: Mapping[str, PatchHook]
    versions: str
    default: bool

    @property
    def target_text(self) -> str:
        """The hook modules, what `status` shows until the patch has applied."""
        return ", ".join(self.hooks)


@dataclasses.dataclass(frozen=True)
class Change:
    """One attribute a `Patcher` changed: `original` is what revert puts back (`had_own`
    False: the attribute was not in `owner`'s own namespace, so revert deletes it)."""

    owner: Any
    attribute: str
    original: Any
    had_own: bool
    wrapped: bool  # True: `Patcher.wrap`; False: `Patcher.replace`

    @property
    def target(self) -> str:
        """`module:Class.attribute` or `module:attribute`, the form `status` prints."""
        module = getattr(self.owner, "__module__", None) if isinstance(self.owner, type) else None
        if module is not None:
            return f"{module}:{self.owner.__qualname__}.{self.attribute}"
        return f"{_describe(self.owner)}:{self.attribute}"


class Patcher:
    """Records every change one patch makes so it can be undone exactly, in reverse."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._changes: list[Change] = []

    def wrap(
        self, owner: Any, attribute: str, wrapper: Callable[..., Any], reexported_by: Sequence[str] = ()
    ) -> Any:
        """Wrap `owner.attribute` with a wrapt `wrapper(wrapped, instance, args, kwargs)`.

        Refuses to wrap twice (invariant: never double wrapped). `reexported_by` names modules that
        import the function by name (`from x import f`, a package's `__init__`): see `_point_reexports`.
        """
        if is_wrapped_by_us(inspect_static(owner, attribute)):
            raise RuntimeError(f"{_describe(owner)}.{attribute} is already wrapped by megatron-lora-patch")
        had_own = _has_own(owner, attribute)
        proxy = wrapt.wrap_function_wrapper(owner, attribute, wrapper)
        setattr(proxy, _MARKER, True)  # `_self_` attributes live on the proxy, not the wrapped function
        self._record(Change(owner, attribute, proxy.__wrapped__, had_own, wrapped=True))
        if reexported_by:
            self._point_reexports(owner, attribute, proxy, reexported_by)
        return proxy

    def _point_reexports(self, owner: Any, attribute: str, proxy: Any, importers: Sequence[str]) -> None:
        """Point each already-imported `importers` module's copy of the original at `proxy`.

        A module that imported the function by name before the patch holds the original, and callers
        through it would miss the patch whatever the import order; modules imported later copy the
        proxy, and revert hands those the original back. A copy someone else replaced is left alone
        (with a warning): the patch then covers the calls through `owner` only.
        """
        original = proxy.__wrapped__

        def give_later_copies_the_original() -> None:
            for name in importers:
                importer = sys.modules.get(name)
                if importer is not None and vars(importer).get(attribute) is proxy:
                    setattr(importer, attribute, original)

        self.on_revert(give_later_copies_the_original)  # runs after the replacements below are undone
        for name in importers:
            importer = sys.modules.get(name)
            copy = vars(importer).get(attribute) if importer is not None else None
            if copy is original:
                self.replace(importer, attribute, proxy)
            elif copy is not None and copy is not proxy and not is_wrapped_by_us(copy):
                log.warning("megatron-lora-patch: %s.%s was replaced by someone else; only %s.%s is patched",
                            name, attribute, _describe(owner), attribute)

    def replace(self, owner: Any, attribute: str, value: Any) -> None:
        """Set `owner.attribute = value` (creating it if absent); revert restores or deletes it."""
        had_own = _has_own(owner, attribute)
        original = inspect_static(owner, attribute) if had_own else None
        setattr(owner, attribute, value)
        self._record(Change(owner, attribute, original, had_own, wrapped=False))

    def on_revert(self, undo: Callable[[], None]) -> None:
        """Register an extra undo step for state a hook changed outside attributes."""
        self._undo.append(undo)

    @property
    def changes(self) -> tuple[Change, ...]:
        """Every attribute changed since the last revert, in order."""
        return tuple(self._changes)

    def targets(self) -> list[str]:
        """The changed attributes as `status` prints them, each once, in order."""
        return list(dict.fromkeys(change.target for change in self._changes))

    def revert(self) -> None:
        """Undo every recorded change, newest first; the patcher can then be reused."""
        while self._undo:
            self._undo.pop()()
        self._changes.clear()

    def _record(self, change: Change) -> None:
        self._changes.append(change)
        self._undo.append(lambda: _restore(change.owner, change.attribute, change.original, change.had_own))


def inspect_static(owner: Any, attribute: str) -> Any:
    """The raw attribute (descriptor included) as stored on `owner` or its MRO."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attribute in vars(klass):
                return vars(klass)[attribute]
        raise AttributeError(f"{owner.__qualname__} has no attribute {attribute!r}")
    return getattr(owner, attribute)


def is_wrapped_by_us(value: Any) -> bool:
    """Whether `value` is a wrapper a `Patcher` installed."""
    return bool(getattr(value, _MARKER, False))


def _has_own(owner: Any, attribute: str) -> bool:
    return attribute in vars(owner) if hasattr(owner, "__dict__") else hasattr(owner, attribute)


def _restore(owner: Any, attribute: str, original: Any, had_own: bool) -> None:
    if had_own:
        setattr(owner, attribute, original)
    elif _has_own(owner, attribute):
        delattr(owner, attribute)


def _describe(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
