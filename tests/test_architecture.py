"""What may import what (ARCHITECTURE.md), read from the source with `ast`: every import statement counts, the
ones inside functions too, so a lazy import cannot hide a backward dependency.

Floors: the pure modules (standard library only) <- the torch core (checkpoints, skippers) <- `vskipper.mixed`
<- `vskipper.sglang`; `loadgen` and the operator stand on the pure modules; the demo stands on everything.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOPS = {"vskipper": ROOT / "vskipper", "loadgen": ROOT / "loadgen",
        "vskipper_operator": ROOT / "operator" / "vskipper_operator", "demo": ROOT / "demo", "deploy": ROOT / "deploy"}

# The pure floor: no torch, no I/O, standard library only. The operator image and the loadgen image install
# these without the runtime extra.
PURE = {"vskipper", "vskipper.constants", "vskipper.roofline", "vskipper.switch", "vskipper.arms",
        "vskipper.modelspec", "vskipper.metrics_names", "vskipper.serveargs", "vskipper.skippers",
        "vskipper.skippers.registry"}
# The torch core: tiny checkpoints, the skipper plugins and the offline tour; engine-independent like the pure
# floor, but with torch.
TORCH_CORE = {"vskipper.checkpoint", "vskipper.tour", "vskipper.skippers.base", "vskipper.skippers.modules",
              "vskipper.skippers.random_skip", "vskipper.skippers.static_depth", "vskipper.skippers.trained_gate"}
# The command line: its module level is pure (test_cli proves it imports no torch); its verbs reach the mixed and
# SGLang floors through imports inside the verb.
# `vskipper.fetch` is the model-download command the server pod's init container runs (standard library, and
# huggingface_hub when importable).
ENTRY = {"vskipper.cli", "vskipper.fetch"}

# Known exceptions, each named; a fix removes its line here.
KNOWN_BACKWARD: set[tuple[str, str]] = set()
# (the scheduler hooks and the executed-configuration reader find the runtime through vskipper.sglang.active,
# so neither imports the runtime that imports them)
KNOWN_CYCLES: list[set[str]] = []


def _module_name(top: str, path: Path) -> str:
    parts = [top, *path.relative_to(TOPS[top]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_module_name(top, p): p for top, d in TOPS.items() for p in sorted(d.rglob("*.py"))}


@cache
def imported_names(module: str) -> tuple[str, ...]:
    """Every dotted name an import statement of `module` names (`from a import b` names `a` and `a.b`)."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            names += [source, *(f"{source}.{a.name}" for a in node.names)]
    return tuple(names)


def project_imports(module: str) -> set[str]:
    """The project modules `module` imports (a name resolves to its longest known module prefix)."""
    known, found = modules(), set()
    for name in imported_names(module):
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) != module:
            found.add(".".join(parts))
    return found


def test_every_top_level_vskipper_module_has_a_floor():
    top_level = {m for m in modules() if m.split(".")[0] == "vskipper" and
                 (m.count(".") <= 1 or m.startswith("vskipper.skippers.")) and
                 not m.startswith(("vskipper.mixed", "vskipper.sglang"))}
    assert top_level - PURE - TORCH_CORE - ENTRY == set(), "add the module to PURE, TORCH_CORE or ENTRY"
    assert (PURE | TORCH_CORE | ENTRY) <= set(modules()), "a floor names a module that no longer exists"


def test_pure_modules_import_only_the_standard_library_and_pure_modules():
    stdlib = sys.stdlib_module_names | {"__future__"}
    bad = {(m, name) for m in PURE for name in imported_names(m)
           if name.split(".")[0] not in stdlib | set(TOPS)}
    bad |= {(m, dep) for m in PURE for dep in project_imports(m) if dep not in PURE}
    assert bad == set()


def test_the_torch_core_imports_neither_the_mixed_nor_the_sglang_floor():
    bad = {(m, dep) for m in TORCH_CORE | ENTRY for dep in project_imports(m) if dep.startswith("vskipper.")
           and dep not in PURE | TORCH_CORE}
    # the command line's verbs import their floor inside the verb, never at module level
    lazy_verbs = {("vskipper.cli", "vskipper.mixed.tune_cli"), ("vskipper.cli", "vskipper.sglang.cli"),
                  ("vskipper.cli", "vskipper.sglang.backend_read")}  # tune-tiles times SGLang's own prefill read
    assert bad == lazy_verbs
    module_level = {n.module for n in ast.parse(modules()["vskipper.cli"].read_text()).body
                    if isinstance(n, ast.ImportFrom)}
    assert not {m for m in module_level if m and m.split(".")[0] == "vskipper"} - PURE


def test_mixed_never_imports_sglang():
    bad = {(m, name) for m in modules() if m.startswith("vskipper.mixed") for name in imported_names(m)
           if name.split(".")[0] == "sglang" or name.startswith("vskipper.sglang")}
    assert bad == set()


def test_vskipper_imports_neither_loadgen_nor_the_operator_nor_the_repository_tooling():
    bad = {(m, dep) for m in modules() if m.split(".")[0] == "vskipper" for dep in project_imports(m)
           if dep.split(".")[0] in ("loadgen", "vskipper_operator", "demo", "deploy")}
    assert bad - KNOWN_BACKWARD == set()


def test_the_deployment_generators_are_repository_tooling():
    """deploy/ (chart, rules and dashboard generators that write repository paths) stands on the pure modules and
    the operator's schema; no shipped package imports it, and no wheel carries it."""
    bad = {(m, dep) for m in modules() if m.split(".")[0] == "deploy" for dep in project_imports(m)
           if dep.split(".")[0] == "vskipper" and dep not in PURE}
    assert bad == set()
    users = {m for m in modules() if m.split(".")[0] != "deploy" for dep in project_imports(m)
             if dep.split(".")[0] == "deploy"}
    assert users == set()
    import tomllib

    packaged = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(pattern.startswith("deploy") for pattern in packaged["include"])


def test_loadgen_and_the_operator_stand_on_the_pure_modules_only():
    bad = {(m, dep) for m in modules() if m.split(".")[0] in ("loadgen", "vskipper_operator")
           for dep in project_imports(m) if dep.startswith("vskipper") and not dep.startswith("vskipper_operator")
           and dep not in PURE | ENTRY}
    bad |= {(m, dep) for m in modules() if m.startswith("loadgen") for dep in project_imports(m)
            if dep.split(".")[0] in ("vskipper_operator", "demo")}
    bad |= {(m, dep) for m in modules() if m.startswith("vskipper_operator") for dep in project_imports(m)
            if dep.split(".")[0] in ("loadgen", "demo")}
    assert bad == set()


def test_no_import_cycles_between_modules():
    graph = {m: project_imports(m) for m in modules()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(component)

    for m in graph:
        if m not in index:
            visit(m)
    assert [c for c in cycles if not any(c <= known for known in KNOWN_CYCLES)] == []


def test_the_checker_sees_imports_inside_functions():
    """The rules above would pass vacuously if the parser missed imports inside functions."""
    assert "vskipper.sglang.cli" in project_imports("vskipper.cli")  # imported inside `_serve`
    assert "vskipper_operator.crd" in project_imports("deploy.chart")
    assert "vskipper.sglang.hooks" in project_imports("vskipper.sglang.runtime")
