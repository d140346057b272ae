"""The import-direction rules of DESIGN section 2, checked on the source (static imports, incl. function-local)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "miles_hpc"


def imports_of(path: Path, pkg: Path = PKG) -> set[str]:
    """Dotted miles_hpc modules imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return {m for m in found if m == "miles_hpc" or m.startswith("miles_hpc.")}


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(pkg: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        src = stage(".".join(path.relative_to(pkg.parent).with_suffix("").parts))
        for target in sorted(imports_of(path, pkg)):
            dst = stage(target)
            if dst in ("", src, "__version__"):
                continue
            rule = None
            if src in ("cluster", "data", "config") and dst != "config":
                rule = f"{src} may import only miles_hpc.config"
            elif src == "rollout" and dst == "train":
                rule = "rollout never imports train"
            elif src == "train" and dst == "rollout":
                rule = "train never imports rollout"
            elif dst == "engine" and src in ("rollout", "train", "sync", "loop"):
                rule = f"{src} reaches the engine over HTTP, never by import"
            if rule:
                bad.append(f"{path.relative_to(pkg.parent)} imports {target}: {rule}")
    return bad


def test_import_direction() -> None:
    assert violations() == []


def test_checker_sees_relative_and_local_imports(tmp_path: Path) -> None:
    # The checker must resolve `from ..train import x` inside a function, or the rule above could never fail.
    pkg = tmp_path / "miles_hpc"
    (pkg / "rollout").mkdir(parents=True)
    f = pkg / "rollout" / "probe.py"
    f.write_text("def g():\n    from ..train import losses\n    import miles_hpc.engine.server\n")
    (pkg / "data.py").write_text("from miles_hpc.models import x\n")
    assert imports_of(f, pkg) >= {"miles_hpc.train", "miles_hpc.train.losses", "miles_hpc.engine.server"}
    found = violations(pkg)
    assert any("rollout never imports train" in v for v in found)
    assert any("reaches the engine over HTTP" in v for v in found)
    assert any("data may import only miles_hpc.config" in v for v in found)
