"""The layout rules of docs/design.md (section "Packages and their arrows"), checked on the source: static imports
(function-local ones too, read by scripts/import_arrows.py, whose arrows the docs print) and strategy names."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from import_arrows import PKG, imports_of, module_name  # noqa: E402

# Strategy names, written out so that this file needs no import of the package it checks. A test below keeps
# them equal to the registry.
STRATEGY_NAMES = frozenset({"broadcast", "p2p", "delta", "colocated", "lora"})


def _under(module: str, *packages: str) -> bool:
    return any(module == f"miles_hpc.{p}" or module.startswith(f"miles_hpc.{p}.") for p in packages)


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _rule(src: str, dst: str) -> str | None:
    """Why ``src`` may not import ``dst`` (both dotted miles_hpc modules), or None."""
    s, d = _stage(src), _stage(dst)
    if d in ("", s, "__version__"):
        return None
    if s in ("cluster", "data", "config") and d != "config":
        return f"{s} may import only miles_hpc.config"
    if s == "rollout" and d == "train":
        return "rollout never imports train"
    if s == "train" and d == "rollout":
        return "train never imports rollout"
    if s == "planner" and d not in ("models",):
        return "planner is pure functions: it may import only models (their configs)"
    if d == "engine" and s in ("rollout", "train", "sync", "loop"):
        return f"{s} reaches the engine over HTTP, never by import"
    if s == "engine" and d == "rollout":
        return "the engine never imports the client side (rollout)"
    if s == "engine" and d == "sync" and not _under(dst, "sync.wire", "sync.codec"):
        return "the engine uses the wire and the codecs of sync, never its strategies (the client side)"
    if s == "launch" and d == "engine" and not _under(dst, "engine.launch"):
        return "launch builds the engine's command line (engine.launch) and talks to the engine over HTTP"
    if s == "loop" and d in ("launch", "cluster"):
        return "the RL loops never start processes: launch and cluster start them"
    return None


def _sync_rule(src: str, dst: str) -> str | None:
    """The rooms inside sync: the wire and the codecs sit below the strategies and never look up."""
    if _under(src, "sync.wire") and not _under(dst, "sync.wire", "atomic"):
        return "sync.wire imports only sync.wire (and atomic)"
    if _under(src, "sync.codec") and not _under(dst, "sync.wire", "sync.codec", "atomic"):
        return "sync.codec imports only sync.wire and sync.codec (and atomic)"
    return None


def import_violations(pkg: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        src = module_name(path, pkg)
        for target in sorted(imports_of(path, pkg)):
            rule = _rule(src, target) or _sync_rule(src, target)
            if rule:
                bad.append(f"{path.relative_to(pkg.parent)} imports {target}: {rule}")
        if _under(src, "loop"):
            for target in sorted(imports_of(path, pkg, ours=False) & {"subprocess", "multiprocessing"}):
                bad.append(f"{path.relative_to(pkg.parent)} imports {target}: the RL loops never start processes")
    return bad


def _names_a_strategy(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in STRATEGY_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_strategy(e) for e in node.elts)
    return False


def strategy_name_violations(pkg: Path = PKG) -> list[str]:
    """``x.strategy == "lora"`` outside sync/: what a strategy needs or does is a trait of its class
    (miles_hpc/sync/strategies/base.py). config/ is exempt: it validates the names it accepts."""
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        module = module_name(path, pkg)
        if _under(module, "sync", "config"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            by_name = any(isinstance(s, ast.Attribute) and s.attr == "strategy" for s in sides)
            if by_name and any(_names_a_strategy(s) for s in sides):
                bad.append(f"{path.relative_to(pkg.parent)}:{node.lineno} compares a sync strategy by name")
    return bad


def test_import_direction() -> None:
    assert import_violations() == []


def test_no_strategy_is_known_by_name_outside_sync() -> None:
    assert strategy_name_violations() == []


def test_strategy_names_are_the_registry() -> None:
    from miles_hpc.sync.factory import STRATEGIES

    assert set(STRATEGIES) == STRATEGY_NAMES


def test_the_checkers_can_fail(tmp_path: Path) -> None:
    # Each rule, broken once in a made-up package: the checker must resolve relative and function-local imports.
    pkg = tmp_path / "miles_hpc"
    files = {
        "rollout/probe.py": "def g():\n    from ..train import losses\n    import miles_hpc.engine.server\n",
        "data.py": "from miles_hpc.models import x\n",
        "engine/core.py": "from miles_hpc.sync.strategies import colocated\nfrom miles_hpc.sync.wire import pg\n",
        "sync/wire/pg.py": "from ..strategies import p2p\n",
        "sync/codec/bits.py": "from miles_hpc.sync import protocol\n",
        "loop/sync.py": "import subprocess\nfrom miles_hpc.launch import workers\n",
        "launch/local.py": "from miles_hpc.engine import server\n",
        "planner/estimate.py": "from miles_hpc.train import shards\n",
        "launch/controller.py": "def f(cfg):\n    return cfg.sync.strategy in ('lora', 'delta')\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    found = "\n".join(import_violations(pkg))
    for why in (
        "rollout never imports train",
        "reaches the engine over HTTP",
        "data may import only miles_hpc.config",
        "never its strategies",
        "sync.wire imports only",
        "sync.codec imports only",
        "loop/sync.py imports subprocess",
        "the RL loops never start processes: launch",
        "launch builds the engine's command line",
        "planner is pure functions",
    ):
        assert why in found, why
    assert "engine/core.py imports miles_hpc.sync.wire" not in found
    assert strategy_name_violations(pkg) == ["miles_hpc/launch/controller.py:2 compares a sync strategy by name"]


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80


def size_violations(pkg: Path = PKG) -> list[str]:
    """Library files over 600 lines; functions over 80 lines whose docstring (or a comment right above the def,
    for Triton kernels) gives no reason ("Long: ...")."""
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        where = path.relative_to(pkg.parent)
        if len(lines) > MAX_FILE_LINES:
            bad.append(f"{where}: {len(lines)} lines (at most {MAX_FILE_LINES}: split it)")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            reason = "Long:" in (ast.get_docstring(node) or "") or lines[first - 2].strip().startswith("# Long:")
            if length > MAX_FUNCTION_LINES and not reason:
                bad.append(f"{where}:{node.lineno} {node.name} is {length} lines with no 'Long:' reason")
    return bad


def test_files_and_functions_stay_small() -> None:
    assert size_violations() == []


def test_the_size_check_can_fail(tmp_path: Path) -> None:
    pkg = tmp_path / "miles_hpc"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (pkg / "big.py").write_text(f"def long():\n{body}\n" + "\n" * MAX_FILE_LINES)
    (pkg / "ok.py").write_text(f'def long():\n    """Long: a reason."""\n{body}\n# Long: a kernel.\ndef k():\n{body}')
    assert size_violations(pkg) == [
        f"miles_hpc/big.py: {MAX_FUNCTION_LINES + 2 + MAX_FILE_LINES} lines (at most {MAX_FILE_LINES}: split it)",
        f"miles_hpc/big.py:1 long is {MAX_FUNCTION_LINES + 1} lines with no 'Long:' reason",
    ]
