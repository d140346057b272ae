"""SGLang schema conformance (marker ``sglang``): runs tests/sglang_schema_check.py in SGLang's own venv.

The venv (default ``.venv-sglang``, or ``$SGLANG_VENV``) is made by ``scripts/test_sglang.sh`` (~11 GB: sglang pulls a
CUDA torch, so it never shares our main venv). Without it this test skips, or fails under MILES_REQUIRE_ALL=1 (CI
makes the venv first).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import require

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("SGLANG_VENV", REPO / ".venv-sglang"))


@pytest.mark.sglang
def test_requests_and_launcher_match_sglang() -> None:
    python = VENV / "bin" / "python"
    require(python.exists(), f"SGLang venv at {VENV} (make it with scripts/test_sglang.sh --install-only)")
    proc = subprocess.run(
        [str(python), str(REPO / "tests" / "sglang_schema_check.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "all checks passed" in proc.stdout


@pytest.mark.sglang
def test_preflight_reads_the_real_sglang_version() -> None:
    """Preflight's probe of `rollout.sglang_python` against SGLang's own venv: it imports sglang and its version is
    one preflight accepts (scripts/test_sglang.sh installs the checked release, or the newest that installs)."""
    from miles_hpc.launch.preflight import SGLANG_BELOW, SGLANG_MIN, _version_tuple, probe_sglang

    python = VENV / "bin" / "python"
    require(python.exists(), f"SGLang venv at {VENV} (make it with scripts/test_sglang.sh --install-only)")
    got = probe_sglang(str(python), timeout_s=300)
    assert got.version is not None, got.error
    assert SGLANG_MIN <= _version_tuple(got.version) < SGLANG_BELOW, got.version
