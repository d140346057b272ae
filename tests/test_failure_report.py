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


def test_a_second_signal_inside_a_checkpoint_write_still_stops_with_its_code() -> None:
    """torch's distributed checkpoint collects what its steps raise into a CheckpointException (a second SIGINT
    during the save arrives that way, as CI saw): the stop is found inside and exits 128 + SIGINT, not 1."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise RunInterrupted(signal.SIGINT)
    except RunInterrupted as e:
        wrapped = CheckpointException("ranks", {0: _wrap_exception(e)})
    assert report_failure(wrapped, None) == 128 + signal.SIGINT
    try:
        raise ValueError("the save failed") from RunInterrupted(signal.SIGTERM)
    except ValueError as e:
        assert report_failure(e, None) == 128 + signal.SIGTERM
    assert report_failure(CheckpointException("ranks", {0: _wrap_exception(OSError("disk full"))}), None) == 1


def test_a_collective_timeout_is_told_what_it_means(capsys: pytest.CaptureFixture[str]) -> None:
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation"
    )
    assert report_failure(gloo, None) == 1
    err = capsys.readouterr().err
    assert "Timed out waiting 30000ms for recv" in err and "train.collective_timeout_s" in err
    assert "RUN/logs/trainer-<rank>.log" in err
    assert report_failure(RuntimeError("something else"), None) == 1
    assert "collective_timeout_s" not in capsys.readouterr().err
