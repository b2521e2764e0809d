"""The project's import graph has no cycles and goes one way down (docs/architecture.md):

    scripts:   run_decode.py, benchmarks/, examples/
    serving/                    the application: engine, scheduler, CLI, PD, telemetry
    models/registry.py          model_type -> family (the one dispatch over families)
    models/<family>/            dsa, deepseek_v4, minimax_m3: model, loading, decoding, runner
    models/common/              blocks the families share
    hisparse_jax/               the library
    pallas_kernels/<op>/        one folder per op; pallas_kernels/common.py beside them
    configs/                    model configs: imports nothing of the project

Checked on the source (every import statement, inside functions too, so a lazy import cannot
hide a cycle or an upward import). Within a floor: no family imports another family, no kernel
op imports another op (shared helpers live in pallas_kernels/common.py)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = ("pallas_kernels", "configs", "hisparse_jax", "models", "serving", "benchmarks", "examples", "run_decode.py")
FAMILIES = ("dsa", "deepseek_v4", "minimax_m3")


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    modules = {}
    for source in SOURCES:
        path = root / source
        files = [path] if path.is_file() else sorted(path.rglob("*.py")) if path.is_dir() else []
        for file in files:
            modules[_module_name(file, root)] = file
    return modules


def _resolve(name: str, modules) -> str | None:
    """The project module a dotted import name lands in (a symbol's module for `from m import f`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the project modules it imports (relative imports resolved, lazy ones included)."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import submodule` lands in the submodule, `from pkg import sym` in pkg
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            targets |= {t for n in names if (t := _resolve(n, modules)) and t != module}
        graph[module] = targets
    return graph


def floor(module: str) -> int:
    """Higher floors may import lower ones, never the reverse."""
    top = module.split(".")[0]
    if top in ("pallas_kernels", "configs"):
        return 0
    if top == "hisparse_jax":
        return 1
    if top == "models":
        second = module.split(".")[1] if "." in module else ""
        return {"common": 2, **{f: 3 for f in FAMILIES}}.get(second, 4)  # models, models.registry: 4
    if top == "serving":
        return 5
    return 6  # scripts


def _unit(module: str) -> str | None:
    """The unit a module belongs to, for the same-floor rules: a family or a kernel op."""
    parts = module.split(".")
    if parts[0] == "models" and len(parts) > 1 and parts[1] in FAMILIES:
        return f"models.{parts[1]}"
    if parts[0] == "pallas_kernels" and len(parts) > 1 and parts[1] != "common":
        return f"pallas_kernels.{parts[1]}"
    return None


def layer_violations(graph) -> list[str]:
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            up = floor(target) > floor(module)
            sideways = _unit(module) is not None and _unit(target) not in (None, _unit(module)) and floor(target) == floor(module)
            configs_out = module.split(".")[0] == "configs" and target.split(".")[0] != "configs"
            kernels_out = module.split(".")[0] == "pallas_kernels" and target.split(".")[0] != "pallas_kernels"
            if up or sideways or configs_out or kernels_out:
                found.append(f"{module} imports {target}")
    return found


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_project_imports_go_down_only():
    assert layer_violations(import_graph(ROOT)) == []


def test_the_project_has_no_import_cycles():
    assert cycles(import_graph(ROOT)) == []


def test_the_library_imports_neither_models_nor_serving():
    graph = import_graph(ROOT)
    bad = {m: t for m, ts in graph.items() if m.startswith("hisparse_jax") for t in ts if t.split(".")[0] in ("models", "serving")}
    assert bad == {}


def test_the_checks_see_planted_violations(tmp_path):
    def write(path, text=""):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)

    for package in ("models", "models/common", "models/dsa", "models/minimax_m3", "serving", "hisparse_jax", "pallas_kernels",
                    "pallas_kernels/swap_in", "pallas_kernels/topk"):  # fmt: skip
        write(f"{package}/__init__.py")
    write("models/registry.py", "from models.dsa import family\n")
    write("models/dsa/family.py", "def f():\n    from models import registry\n")  # lazy, upward: a family imports the registry
    write("models/dsa/model.py", "from models.minimax_m3.model import Block\n")  # sideways: another family
    write("models/minimax_m3/model.py", "class Block: ...\n")
    write("models/common/layers.py", "from models.dsa.model import X\n")  # shared blocks import a family
    write("hisparse_jax/state.py", "import serving.engine\n")  # the library imports the application
    write("serving/engine.py", "from hisparse_jax.state import S\n")
    write("pallas_kernels/topk/api.py", "from pallas_kernels.swap_in.base import Plan\n")  # one op imports another
    write("pallas_kernels/swap_in/base.py", "Plan = 1\n")
    graph = import_graph(tmp_path)
    assert layer_violations(graph) == [
        "hisparse_jax.state imports serving.engine",
        "models.common.layers imports models.dsa.model",
        "models.dsa.family imports models.registry",
        "models.dsa.model imports models.minimax_m3.model",
        "pallas_kernels.topk.api imports pallas_kernels.swap_in.base",
    ]
    assert cycles(graph) == [["hisparse_jax.state", "serving.engine"], ["models.dsa.family", "models.registry"]]
