"""The packages import one way down (docs/architecture.md):

    run_decode.py, benchmarks/ -> hisparse_jax.serving -> models/ -> hisparse_jax (library) -> pallas_kernels/

configs/ sits beside them and imports none of them. Checked on the source (every import
statement, inside functions too), so a lazy import cannot hide a cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Layer name -> the modules it may not import (prefix match on the dotted name).
FORBIDDEN = {
    "pallas_kernels": ("hisparse_jax", "models", "configs"),
    "hisparse_jax": ("hisparse_jax.serving", "models"),  # the library, less its serving package
    "models": ("hisparse_jax.serving",),
    "configs": ("hisparse_jax", "models", "pallas_kernels"),
}


def _layer(path: pathlib.Path, root: pathlib.Path) -> str | None:
    parts = path.relative_to(root).parts
    if parts[0] == "hisparse_jax" and len(parts) > 1 and parts[1] == "serving":
        return None  # the top layer may import anything below
    return parts[0] if parts[0] in FORBIDDEN else None


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _violations(root: pathlib.Path) -> list[str]:
    found = []
    for layer, banned in FORBIDDEN.items():
        for path in sorted((root / layer).rglob("*.py")):
            if _layer(path, root) is None:
                continue
            bad = sorted({n for n in _imports(path) for b in banned if n == b or n.startswith(b + ".")})
            if bad:
                found.append(f"{path.relative_to(root)} ({layer}) imports {bad}")
    return found


def test_imports_go_down_only():
    assert _violations(ROOT) == []


def test_the_check_sees_a_lazy_upward_import(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.py").write_text("def f():\n    from hisparse_jax.serving.engine import Engine\n")
    (tmp_path / "hisparse_jax" / "serving").mkdir(parents=True)
    (tmp_path / "hisparse_jax" / "serving" / "y.py").write_text("import models.decoding\n")
    assert _violations(tmp_path) == ["models/x.py (models) imports ['hisparse_jax.serving.engine', 'hisparse_jax.serving.engine.Engine']"]
