"""Imports go one way (the layer contract of the README's layout), and a serving method is a
policy module, never a flag tested elsewhere. Read from the source with ``ast``: nothing is
imported or run."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Bottom to top: a package may import its own modules and packages of lower layers only.
LAYERS = (
    {"pallas_kernels"},
    {"lsparse_jax.kernels"},
    {"lsparse_jax.config", "lsparse_jax.tasks", "lsparse_jax.parallel",
     "lsparse_jax.request_groups"},
    {"lsparse_jax.quant"},
    {"lsparse_jax.indexing"},
    {"lsparse_jax.model"},
    {"lsparse_jax.memory"},
    {"lsparse_jax.methods"},
    {"lsparse_jax.serving", "lsparse_jax.training"},
    {"experiments"},
)
RANK = {pkg: rank for rank, layer in enumerate(LAYERS) for pkg in layer}


def package(module: str) -> str | None:
    """The layer package of a dotted module name (None: outside the contract)."""
    parts = module.split(".")
    if parts[0] in ("pallas_kernels", "experiments"):
        return parts[0]
    if parts[0] == "lsparse_jax" and len(parts) > 1:
        return "lsparse_jax." + parts[1]
    return None


def imports(path: pathlib.Path):
    """Absolute module names ``path`` imports (function-level imports included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def sources():
    for top in ("pallas_kernels", "lsparse_jax", "experiments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            if module == "lsparse_jax.__init__":  # the package root registers the methods
                continue
            yield path, module


def test_every_library_package_has_a_layer():
    packages = {package(m) for _, m in sources()}
    assert packages <= set(RANK), f"packages without a layer: {packages - set(RANK)}"


def test_imports_go_down_only():
    bad = []
    for path, module in sources():
        src = package(module)
        for name in imports(path):
            dst = package(name)
            if dst is None or dst == src:
                continue
            if name == "lsparse_jax" or RANK[dst] >= RANK[src]:
                bad.append(f"{path.relative_to(ROOT)}: {src} imports {name}")
    assert bad == []


def test_no_method_flags_outside_the_policy_modules():
    flag = re.compile(r"method\s*==\s*['\"]|\.lean\b|\.paged\b|\.adaptive\b|"
                      r"method\s+in\s+\(")
    bad = [f"{path.relative_to(ROOT)}:{i + 1}: {line.strip()}"
           for path in sorted((ROOT / "lsparse_jax").rglob("*.py"))
           if "methods" not in path.parts
           for i, line in enumerate(path.read_text().splitlines()) if flag.search(line)]
    assert bad == []


def test_the_contract_catches_a_violation(tmp_path):
    """The checker itself: an upward import is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from lsparse_jax.serving.engine import Engine\n")
    assert list(imports(bad)) == ["lsparse_jax.serving.engine"]
    assert RANK[package("lsparse_jax.serving.engine")] > RANK["lsparse_jax.model"]
