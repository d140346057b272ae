#!/usr/bin/env python3
"""The import arrows between miles_hpc's packages, read from the source (static imports, function-local included).

    python scripts/import_arrows.py            # one line per arrow: `src -> dst  (n imports)`
    python scripts/import_arrows.py --depth 3  # sub-packages too (miles_hpc.sync.wire -> ...)

`tests/test_layout.py` checks the layout rules with the same reader (`imports_of`), so what this prints is what the
rules see.
"""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "miles_hpc"


def module_name(path: Path, pkg: Path = PKG) -> str:
    """Dotted module of ``path`` (``miles_hpc/sync/wire/pg.py`` -> ``miles_hpc.sync.wire.pg``)."""
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, pkg: Path = PKG, *, ours: bool = True) -> set[str]:
    """Dotted modules imported anywhere in ``path`` (relative imports resolved): miles_hpc's alone, or every one
    with ``ours=False``. ``from a import b`` gives both ``a`` and ``a.b`` (``b`` may be a module)."""
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
    return {m for m in found if not ours or m == "miles_hpc" or m.startswith("miles_hpc.")}


def is_module(name: str, pkg: Path = PKG) -> bool:
    """``name`` is one of our modules or packages (not a name imported from one, like ``__version__``)."""
    path = pkg.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit(module: str, depth: int, pkg: Path = PKG) -> str:
    """The package (or top-level module) ``module`` belongs to, ``depth`` dotted parts deep."""
    parts = module.split(".")
    for n in range(min(depth, len(parts)), 1, -1):
        if (pkg.parent.joinpath(*parts[:n]) / "__init__.py").is_file() or n == 2:
            return ".".join(parts[:n])
    return module


def arrows(depth: int = 2, pkg: Path = PKG) -> Counter[tuple[str, str]]:
    """(importing unit, imported unit) -> number of import statements' targets, self-arrows left out."""
    out: Counter[tuple[str, str]] = Counter()
    for path in sorted(pkg.rglob("*.py")):
        src = unit(module_name(path, pkg), depth, pkg)
        seen = set()
        for target in filter(lambda t: is_module(t, pkg), imports_of(path, pkg)):
            dst = unit(target, depth, pkg)
            if dst != src and dst != "miles_hpc" and (path, dst) not in seen:
                seen.add((path, dst))
                out[(src, dst)] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=2, help="2: top-level packages; 3: their sub-packages")
    args = ap.parse_args()
    for (src, dst), n in sorted(arrows(args.depth).items()):
        print(f"{src.removeprefix('miles_hpc.'):<18} -> {dst.removeprefix('miles_hpc.'):<18} ({n} files)")


if __name__ == "__main__":
    main()
