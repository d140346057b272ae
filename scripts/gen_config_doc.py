"""Regenerate the table in docs/config.md from the config dataclasses (tests/test_docs.py checks it is current)."""

from pathlib import Path

from miles_hpc.config import config_reference

doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
head, rest = doc.read_text().split("<!-- BEGIN GENERATED -->\n", 1)
tail = rest.split("\n<!-- END GENERATED -->", 1)[1]
doc.write_text(f"{head}<!-- BEGIN GENERATED -->\n{config_reference()}\n<!-- END GENERATED -->{tail}")
