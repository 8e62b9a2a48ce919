"""Every patch of both plugins keeps the patcher's contract, ddtrace `PatchTestCase`-style.

apply -> every attribute its patcher recorded holds a megatron-lora-patch wrapper exactly once
(its `__wrapped__` is the recorded original) -> apply again: same records, still wrapped once ->
revert -> every recorded original is back (`is`), or the attribute is gone if the patch created it.
Both import orders: Megatron imported before apply (one process, patch after patch), and apply
before Megatron is imported (a fresh interpreter per patch, so nothing was imported earlier: one world
whose rank r checks patch r, so the interpreters start side by side).
"""

from __future__ import annotations

import importlib

from megatron_lora_patch.proof.testbed.launcher import run_world
from megatron_lora_patch.proof.testbed.patches import all_patch_names
from megatron_lora_patch.runtime import versions

_MISSING = object()


def _spec(name: str):
    return importlib.import_module(f"megatron_lora_patch.patches.{name}").SPEC


def _in_tested_range(name: str) -> bool:
    installed = versions.installed_megatron_core()
    return versions.out_of_range_reason(name, _spec(name).versions, installed) is None


#: The patches this Megatron-Core is inside the tested range of (the others refuse to apply, tested elsewhere).
PATCHES = [name for name in all_patch_names() if _in_tested_range(name)]


def _import_targets(names) -> list[str]:
    """Import the patches' target modules; return those that exist in this install."""
    imported = []
    for name in names:
        for module_name in _spec(name).hooks:
            try:
                importlib.import_module(module_name)
            except ImportError:  # optional targets: Transformer Engine, megatron.legacy, megatron.training
                continue
            imported.append(module_name)
    return imported


def _wrapped_once_problems(changes) -> list[str]:
    from megatron_lora_patch.runtime.patching import is_wrapped_by_us

    problems = []
    for change in changes:
        current = vars(change.owner).get(change.attribute, _MISSING)
        if current is _MISSING:
            problems.append(f"{change.target}: missing while applied")
        elif change.wrapped and not (is_wrapped_by_us(current) and current.__wrapped__ is change.original):
            problems.append(f"{change.target}: not the recorded wrapper of the recorded original")
        elif change.wrapped and is_wrapped_by_us(change.original):
            problems.append(f"{change.target}: wrapped twice")
    return problems


def _restored_problems(changes) -> list[str]:
    problems = []
    for change in changes:
        current = vars(change.owner).get(change.attribute, _MISSING)
        if change.had_own and current is not change.original:
            problems.append(f"{change.target}: original not restored")
        if not change.had_own and current is not _MISSING:
            problems.append(f"{change.target}: created attribute left behind")
    return problems


def _contract(name: str, import_before: bool) -> dict:
    """Apply `name` alone, check, apply again, check, revert, check (in this process)."""
    from megatron_lora_patch.proof.testbed.patches import apply_only
    from megatron_lora_patch.runtime import registry

    if import_before:
        _import_targets([name])
    apply_only([name])
    importable = _import_targets([name])
    state = {row.patch: row.state for row in registry.status()}[name]
    changes = registry.get_runtime().changes(name)
    problems = _wrapped_once_problems(changes)
    apply_only([name])
    again = registry.get_runtime().changes(name)
    if [c.target for c in again] != [c.target for c in changes]:
        problems.append(f"second apply recorded {len(again)} changes, the first {len(changes)}")
    problems += _wrapped_once_problems(again)
    registry.revert([name])
    problems += _restored_problems(changes)
    targets = [change.target for change in changes]
    return {"state": state, "targets": targets, "problems": problems, "importable": importable}


def megatron_imported_first(rank, world_size, names):
    return {name: _contract(name, import_before=True) for name in names}


def applied_before_import(rank, world_size, names):
    return _contract(names[rank], import_before=False)


def _check(name: str, result: dict) -> None:
    """Applied: something recorded and the contract held. Skipped (the fix is upstream in this
    Megatron-Core, e.g. null_tokenizer on 0.19): nothing left changed. No target module in this
    install (null_tokenizer on a 0.13 wheel, which ships neither tokenizer): nothing applied."""
    if not result["importable"]:
        assert (result["state"], result["targets"]) == ("not imported yet", []), (name, result)
        return
    assert result["state"] in ("applied", "skipped"), (name, result)
    assert bool(result["targets"]) == (result["state"] == "applied"), (name, result)
    assert result["problems"] == [], (name, result["problems"])


def test_every_patch_wraps_once_and_reverts_with_megatron_imported_first():
    results = run_world(megatron_imported_first, 1, args=(PATCHES,), name="contract-import-first", warnings="ignore")[0]
    assert sorted(results) == sorted(PATCHES)
    for name, result in results.items():
        _check(name, result)


def test_each_patch_wraps_once_and_reverts_when_applied_alone_before_megatron_import():
    results = run_world(applied_before_import, len(PATCHES), args=(PATCHES,), name="contract-apply-first",
                        warnings="ignore")
    for name, result in zip(PATCHES, results):
        _check(name, result)


def test_every_patch_is_covered():
    """The list above is every patch of both plugins that this Megatron-Core is in range of."""
    assert {"cpu_compat", "lora_linear", "lora_checkpoint", "finalize_grads", "loss_normalization"} <= set(PATCHES)
