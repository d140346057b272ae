"""Docs that are generated from code stay in step with it, and every path the docs name exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from miles_hpc.config import config_reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))

import gen_architecture  # noqa: E402  (scripts/ is not a package)

# A path into the repository, as the docs write one: a top-level directory of ours, then path characters.
_TOP = "miles_hpc|launchers|slurm|configs|benchmarks|scripts|tests|docs|\\.ci"
_PATH = re.compile(rf"(?<![\w./-])(?:{_TOP})/[\w./-]*[\w/]")


def named_paths(text: str) -> set[str]:
    """Repository paths named in ``text``; ones with a pattern in them (``*``, ``<``, ``{``) are left out."""
    found = set()
    for m in _PATH.finditer(text):
        path, after = m.group(0), text[m.end() : m.end() + 1]
        if after not in ("*", "<", "{"):
            found.add(path.rstrip("/"))
    return found


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    return sorted(p for p in named_paths(text) if not (root / p).exists())


def test_config_reference_is_current() -> None:
    text = (DOCS / "config.md").read_text()
    generated = text.split("<!-- BEGIN GENERATED -->\n", 1)[1].split("\n<!-- END GENERATED -->", 1)[0]
    assert generated == config_reference(), "regenerate the table in docs/config.md from config_reference()"


def test_architecture_is_current() -> None:
    assert (DOCS / "architecture.md").read_text() == gen_architecture.render(), (
        "docs/architecture.md is stale: python scripts/gen_architecture.py"
    )


def test_every_path_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    missing = {p.name: missing_paths(p.read_text()) for p in pages}
    assert {k: v for k, v in missing.items() if v} == {}


def test_the_path_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "miles_hpc" / "loop").mkdir(parents=True)
    (tmp_path / "miles_hpc" / "loop" / "sync.py").write_text("")
    text = "read `miles_hpc/loop/sync.py` first, then miles_hpc/loop/gone.py; shards are RUN/trajectories/*.h5"
    assert missing_paths(text, tmp_path) == ["miles_hpc/loop/gone.py"]
    assert named_paths("see tests/test_x.py::test_y and slurm/*.sbatch") == {"tests/test_x.py"}
