"""Docs that are generated from code stay in step with it."""

from __future__ import annotations

from pathlib import Path

from miles_hpc.config import config_reference

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_config_reference_is_current() -> None:
    text = (DOCS / "config.md").read_text()
    generated = text.split("<!-- BEGIN GENERATED -->\n", 1)[1].split("\n<!-- END GENERATED -->", 1)[0]
    assert generated == config_reference(), "regenerate the table in docs/config.md from config_reference()"
