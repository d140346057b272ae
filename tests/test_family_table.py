"""docs/models.md's table of every family x stage stays true: every family this project builds is a row, every
"runs" cell names a test function that exists, and the SGLang column says what preflight does."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from miles_hpc.launch.preflight import SGLANG_ARCHS
from miles_hpc.models.families import ARCHITECTURES, SUPPORTED_MODEL_TYPES, WRAPPERS

REPO = Path(__file__).resolve().parents[1]
STAGES = ("embedded engine", "FSDP2", "megatron-core", "SGLang", "R3", "LoRA", "zero-KL")
KINDS = ("runs", "refused", "untested", "n/a")
TEST = re.compile(r"tests/(test_\w+)\.py::(test_\w+)")
DENSE = ("llama", "qwen2", "qwen3")


def _table() -> dict[str, dict[str, str]]:
    """model_type -> stage -> cell, from the table under '## Per family and stage'."""
    text = (REPO / "docs" / "models.md").read_text()
    section = text.split("## Per family and stage", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[1:] == list(STAGES), header
    table: dict[str, dict[str, str]] = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        family = re.findall(r"`(\w+)`", cells[0])[0]  # the first backticked name is the row's model_type
        assert family not in table, f"{family} has two rows"
        table[family] = dict(zip(STAGES, cells[1:], strict=True))
    return table


def _defined(file: str) -> set[str]:
    tree = ast.parse((REPO / "tests" / f"{file}.py").read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_family_is_a_row() -> None:
    assert sorted(_table()) == sorted({*SUPPORTED_MODEL_TYPES, *WRAPPERS})


def test_every_cell_says_runs_refused_untested_or_na_and_runs_names_a_test_that_exists() -> None:
    for family, cells in _table().items():
        for stage, cell in cells.items():
            kind = next((k for k in KINDS if cell.startswith(k)), None)
            assert kind is not None, f"{family} x {stage}: {cell!r} starts with none of {KINDS}"
            named = TEST.findall(cell)
            assert kind != "runs" or named, f"{family} x {stage} says runs but names no test"
            for file, func in named:
                assert (REPO / "tests" / f"{file}.py").is_file(), f"{family} x {stage}: no tests/{file}.py"
                assert func in _defined(file), f"{family} x {stage}: tests/{file}.py has no {func}"
            if kind == "refused":
                assert len(cell) > len("refused: ") + 10, f"{family} x {stage}: a refusal says why"


def test_r3_is_na_exactly_for_the_dense_families() -> None:
    for family, cells in _table().items():
        assert cells["R3"].startswith("n/a") == (family in DENSE), family


@pytest.mark.parametrize("family", sorted({*SUPPORTED_MODEL_TYPES, *WRAPPERS}))
def test_the_sglang_column_is_what_preflight_says(family: str, tmp_path: Path) -> None:
    """Preflight refuses rollout.backend=sglang for a checkpoint whose class is not in SGLANG_ARCHS (naming the
    class); the table says refused exactly for those. Checked on each family's tiny preset where it has one."""
    from test_preflight import check

    from miles_hpc.models.presets import ARCHS, HYBRID_ARCHS, WRAPPED_ARCHS, init_model

    refused = _table()[family]["SGLang"].startswith("refused")
    arch = ARCHITECTURES.get(family) or WRAPPERS[family].architecture
    assert refused == (arch not in SGLANG_ARCHS), (family, arch)
    if family not in (*ARCHS, *HYBRID_ARCHS, *WRAPPED_ARCHS):
        return  # no preset (a wrapper of a preset family): its class decides, as above
    path = init_model(family, "tiny", tmp_path / "m")
    base = ["rollout.backend=sglang", "rollout.sglang_python=/opt/sglang/bin/python", f"model.path={path}"]
    problems = [p for p in check(base).problems if p.key == "rollout.backend"]
    assert bool(problems) == refused, problems
    assert not refused or arch in problems[0].what, problems


def test_kimi_k25_is_served_by_sglang_under_the_release_class_name(tmp_path: Path) -> None:
    """Preflight lets SGLang serve a Kimi-K2.5 checkpoint under the release's class name (SGLang's EntryClass,
    tests/sglang_schema_check.py), names transformers' spelling with the fix, and the weight sync's names are the
    text model's (SGLang's Kimi-K2.5 class drops `language_model.` from each name it loads: rollout/sglang.py)."""
    import json

    from test_preflight import check

    from miles_hpc.models.hf_io import iter_hf_tensors, load_pretrained
    from miles_hpc.models.presets import init_model

    path = init_model("kimi_k25", "tiny", tmp_path / "m")
    base = ["rollout.backend=sglang", "rollout.sglang_python=/opt/sglang/bin/python", f"model.path={path}"]
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert not [p for p in check(base).problems if p.key == "rollout.backend"]
    names = [n for n, _ in iter_hf_tensors(load_pretrained(path))]
    assert names and all(n.startswith(("model.", "lm_head.")) for n in names), names[:5]

    config["architectures"] = ["Kimi_K25ForConditionalGeneration"]  # what transformers' save_pretrained writes
    (path / "config.json").write_text(json.dumps(config))
    (problem,) = [p for p in check(base).problems if p.key == "rollout.backend"]
    assert "Kimi_K25ForConditionalGeneration" in problem.what
    assert '"architectures": ["KimiK25ForConditionalGeneration"]' in problem.fix
