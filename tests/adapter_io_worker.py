"""Rank-side code of tests/test_fail_closed_adapter_io.py: the collective adapter I/O calls, each rank its own.

Each rank builds the TP2 model with adapters, then makes its calls in order: (function, keyword arguments, this
rank's local view) or None for a call it skips; `export_peft` (no world) writes a PEFT adapter for the import. A
local view stands in for a directory only this rank's node sees (node-local disks): "stale" shows this rank a file in
a directory the others see empty, "missing" hides a directory from this rank. Per call: (outcome, seconds): "ok",
or the UsageError's message.
"""

from __future__ import annotations

import contextlib
import os

import persistence_worker


@contextlib.contextmanager
def _local_view(view, path: str):
    """Make `path` look, to this rank only, as `view` says (None: as it is): "stale" lists a file in it, "missing"
    hides it and everything under it."""
    def hidden(where) -> bool:
        where = os.fspath(where)
        return where == path or where.startswith(path + os.sep)

    replaced = []
    if view == "stale":
        replaced.append((os, "listdir", lambda original: lambda where: ["stale.distcp"] if where == path
                         else original(where)))
    elif view == "missing":
        for name in ("exists", "isfile", "isdir"):
            replaced.append((os.path, name, lambda original: lambda where: False if hidden(where)
                             else original(where)))
    saved = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    for module, name, make in replaced:
        setattr(module, name, make(getattr(module, name)))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def calls_world(rank: int, world: int, topology: str, spec, seed: int, calls) -> list:
    from rank_calls import make_calls

    return make_calls(rank, topology, spec, persistence_worker.lora_config(seed), calls, _adapter_io)


def _adapter_io(chunks: list, call: tuple) -> str:
    from megatron_lora_patch import export_peft, import_peft, load_adapters, save_adapters

    functions = {"save_adapters": save_adapters, "load_adapters": load_adapters, "import_peft": import_peft,
                 "export_peft": lambda chunks, **options: export_peft(**options)}  # one process, no world
    function, options, view = call
    with _local_view(view, options.get("directory") or options.get("peft_dir")):
        functions[function](chunks, **options)
    return "ok"
