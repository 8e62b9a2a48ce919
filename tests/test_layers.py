"""The package's import graph has layers with arrows only downward and no cycle (docs/architecture.md
section 2).

runtime (bootstrap, registry, hookspecs, flags, versions, ...) < LoRA config and adapter math < LoRA on
layers and training, the live model's inventory < checkpoints < PEFT exchange < TP-invariant mode < patches (one
module per patch: declaration, hooks and wrappers) < plugins < proof (testbed < oracle) < CLI. A module may import
its own layer or a lower one; the runtime never imports LoRA, nothing below the proof imports it. Read from the
source with `ast` (imports inside functions count too), so a lazy import cannot hide an upward arrow.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "megatron_lora_patch"

#: Module prefix under the package -> layer rank (higher may import lower); longest prefix wins.
LAYERS = {
    "__init__": 0, "_checkout": 0, "runtime": 0, "apply": 0, "revert": 0, "status": 0, "SkipPatch": 0,
    "lora.config": 1, "lora.config_rules": 1, "lora.adapters": 1, "cpu_testbed": 1,
    "lora.layers": 2, "lora.training": 2, "lora.inventory": 2,
    "lora.checkpoints": 3, "save_adapters": 3, "load_adapters": 3,
    "lora.exchange": 4, "export_peft": 4, "import_peft": 4,
    "lora": 4, "layout_invariant": 5, "handoff": 5,
    "patches": 6, "plugins": 7,
    "proof.testbed": 8, "proof.oracle": 9, "proof": 9,
    "cli": 10, "__main__": 10,
}


def _layer(module: str) -> int:
    parts = module.split(".")[1:] or ["__init__"]
    for length in range(len(parts), 0, -1):
        key = ".".join(parts[:length])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"{module}: no layer declared in tests/test_layers.py LAYERS")


#: Source directories outside the package and the module name they ship as (setup.py's package_dir).
MAPPED = {f"{PACKAGE}.patches": ROOT / "patches"}


def _source_dirs():
    yield PACKAGE, ROOT / PACKAGE
    yield from MAPPED.items()


def _modules():
    for name, directory in _source_dirs():
        for path in sorted(directory.rglob("*.py")):
            yield ".".join([name, *path.relative_to(directory).with_suffix("").parts]), path


def _source_path(module: str) -> pathlib.Path:
    """Where `module` (a dotted name under the package) lives in this checkout, without a suffix."""
    for name, directory in MAPPED.items():
        if module == name or module.startswith(name + "."):
            return directory.joinpath(*module.split(".")[name.count(".") + 1:])
    return ROOT.joinpath(*module.split("."))


def _imports(module: str, path: pathlib.Path):
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith(PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            source = ".".join(filter(None, [base, node.module]))
            if source == PACKAGE:  # `from megatron_lora_patch import x`: x names the module
                yield from (f"{PACKAGE}.{alias.name}" for alias in node.names)
            elif source.startswith(PACKAGE):  # `from pkg import mod` imports pkg.mod where that is a module
                yield from (_submodule(source, alias.name) for alias in node.names)


def _submodule(source: str, name: str) -> str:
    candidate = _source_path(f"{source}.{name}")
    return f"{source}.{name}" if candidate.with_suffix(".py").exists() or candidate.is_dir() else source


def _upward(module: str, path: pathlib.Path):
    return [target for target in _imports(module, path) if _layer(target) > _layer(module)]


def test_the_scan_covers_the_top_level_patches():
    """`patches/` at the repository's top level is read as `megatron_lora_patch.patches` (the name it ships as),
    so an upward arrow or a cycle through a patch module is seen too."""
    scanned = {module for module, _ in _modules()}
    patches = {f"{PACKAGE}.patches.{path.stem}" for path in (ROOT / "patches").glob("*.py")}
    assert f"{PACKAGE}.patches.lora_linear" in patches and patches <= scanned
    assert _submodule(f"{PACKAGE}.patches", "lora_linear") == f"{PACKAGE}.patches.lora_linear"
    assert _upward(f"{PACKAGE}.patches.lora_linear", ROOT / "patches" / "lora_linear.py") == []


def test_every_import_points_down_or_sideways():
    upward = {module: _upward(module, path) for module, path in _modules()}
    assert {module: targets for module, targets in upward.items() if targets} == {}


@pytest.mark.parametrize(
    "line",
    [
        "from megatron_lora_patch.proof.oracle import harness",
        "from ..lora.adapters import kernels",
        "    import megatron_lora_patch.cli.export",
        "from megatron_lora_patch.plugins import lora_correct",
    ],
)
def test_an_upward_import_is_seen(tmp_path, line):
    """Negative control: the same check flags an upward import written into a registry module."""
    source = tmp_path / "registry.py"
    source.write_text(f"def later():\n    pass\n\nif True:\n{line if line.startswith(' ') else '    ' + line}\n")
    assert _upward("megatron_lora_patch.runtime.registry", source) != []


def _module_graph() -> dict:
    known = {module for module, _ in _modules()}
    graph = {}
    for module, path in _modules():
        targets = set()
        for target in _imports(module, path):
            while target not in known and "." in target:  # `from pkg.mod import name` -> pkg.mod
                target = target.rsplit(".", 1)[0]
            if target in known and target != module:
                targets.add(target)
        graph[module] = targets
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert _cycles(_module_graph()) == []


def test_a_cycle_is_seen():
    """Negative control: two modules importing each other form one component."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
