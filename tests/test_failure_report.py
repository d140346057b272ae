"""launch/failure.report_failure: the exit code and the one message of each way a run ends badly."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from miles_hpc.launch.failure import report_failure
from miles_hpc.launch.signals import RunInterrupted


def test_a_ctrl_c_outside_the_runs_handlers_exits_as_sigint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A second Ctrl-C that lands after the run restored Python's handler (while its processes stop) is a
    # KeyboardInterrupt: a stop by SIGINT (130), not an error (1); no traceback file for it.
    assert report_failure(KeyboardInterrupt(), tmp_path) == 128 + signal.SIGINT
    assert "SIGINT: stopped" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert report_failure(RunInterrupted(signal.SIGTERM), None) == 128 + signal.SIGTERM
    assert report_failure(ValueError("bad"), tmp_path) == 1
    assert "error: ValueError: bad" in capsys.readouterr().err and (tmp_path / "controller.traceback").is_file()
