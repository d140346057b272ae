"""Test tiers and the CI rule: under MILES_REQUIRE_ALL=1 a missing component fails the test instead of skipping it.

Tiers (markers): default CPU tests, ``process`` (starts a process, a server or a cluster), ``slurm`` (a running
local Slurm), ``mpi`` (Open MPI + mpi4py), ``sglang`` (its own venv), ``slow``, ``gpu`` (a CUDA or ROCm device; the
only tier allowed to skip in CI). Tests ask for a component with :func:`require`.

The fast tier (``./scripts/test.sh --fast``) leaves out every tier that starts processes. So that it stays honest, a
test without one of ``PROCESS_MARKERS`` that starts a subprocess, a multiprocessing child or a listening socket
(its fixtures included) fails, naming the marker to add: in every run, CI's too.
"""

from __future__ import annotations

import importlib.util
import multiprocessing.process
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REQUIRE_ALL = os.environ.get("MILES_REQUIRE_ALL", "") not in ("", "0")


def has_megatron() -> bool:
    """megatron-core importable (find_spec of a dotted name raises when its parent package is absent)."""
    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def require(available: bool, what: str) -> None:
    """Skip when ``what`` is missing, or fail when CI says every component must be there."""
    if available:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{what} is missing but MILES_REQUIRE_ALL=1 (CI must install it)", pytrace=False)
    pytest.skip(f"{what} is not available (MILES_REQUIRE_ALL=1 turns this skip into a failure)")


def run_interpreted(code: str, timeout: int = 600) -> None:
    """Run `code` (a script that prints "ok" last) in its own Python with Triton's interpreter on: GPU kernels
    executed on CPU tensors, so CI, which has no GPU, checks them against their torch references. Its own process
    because TRITON_INTERPRET must be set before the kernels are decorated. The repository root is MILES_ROOT and
    on the path. Every kernel launch is recorded, then compiled for NVIDIA sm90/sm80 and AMD gfx942/gfx950
    (tests/triton_compile.py): the interpreter never runs Triton's compiler."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    require(importlib.util.find_spec("triton") is not None, "triton (the dev extra; its interpreter runs on CPU)")
    import tempfile

    here = Path(__file__).parent
    root = str(here.parent)
    with tempfile.TemporaryDirectory() as tmp:
        record = str(Path(tmp) / "launches.jsonl")
        env = {**os.environ, "TRITON_INTERPRET": "1", "MILES_ROOT": root, "PYTHONPATH": root}
        env["MILES_TRITON_RECORD"] = record
        recorder = (
            f"import sys; sys.path.insert(0, {str(here)!r}); import triton_compile; triton_compile.install_recorder()\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", recorder + code], env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout + done.stderr)[-4000:]
        # Then every kernel it launched, compiled for the GPUs we run on (tests/triton_compile.py).
        env = {**os.environ, "PYTHONPATH": root}
        env.pop("TRITON_INTERPRET", None)
        built = subprocess.run(
            [sys.executable, str(here / "triton_compile.py"), record],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        assert built.returncode == 0, (built.stdout + built.stderr)[-4000:]


def run_check(source: str, tmp_path: object, device: str = "cpu") -> None:
    """A kernel test's CHECK script (its `check(device, dtypes)`, and a `__main__` block that runs it on the CPU and
    prints "ok"): on "cpu" in Triton's interpreter (`run_interpreted`), else its `check` here on `device` in
    float32 and bfloat16."""
    from pathlib import Path

    script = Path(str(tmp_path)) / "check_kernels.py"
    script.write_text(source)
    if device == "cpu":
        run_interpreted(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
        return
    import runpy

    import torch

    runpy.run_path(str(script))["check"](device, (torch.float32, torch.bfloat16))


PROCESS_MARKERS = ("process", "slurm", "mpi", "sglang")
# The gpu tier is never in the fast tier, and on a GPU every Triton kernel's first launch runs the compiler (ptxas)
# as a subprocess: its tests are not asked to say so.
_GUARD_EXEMPT = (*PROCESS_MARKERS, "gpu")
_current: list[pytest.Item] = []  # the test being set up, run or torn down


class ProcessGuardError(RuntimeError):
    """A test outside the process tiers started a process or a server."""


def _guarded(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        item = _current[-1] if _current else None
        if item is not None and not any(item.get_closest_marker(m) for m in _GUARD_EXEMPT):
            raise ProcessGuardError(
                f"{item.nodeid} starts {what} but carries none of the markers "
                f"{', '.join(PROCESS_MARKERS)}: mark it @pytest.mark.process (the fast tier "
                "leaves such tests out)"
            )
        return original(*args, **kwargs)

    return wrapper


def pytest_configure(config: pytest.Config) -> None:
    subprocess.Popen.__init__ = _guarded("a subprocess", subprocess.Popen.__init__)  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _guarded(  # type: ignore[method-assign]
        "a multiprocessing child", multiprocessing.process.BaseProcess.start
    )
    socket.socket.listen = _guarded("a listening socket (a server)", socket.socket.listen)  # type: ignore[method-assign]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # GPU tests skip without a device even under MILES_REQUIRE_ALL: CI has no GPU.
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="no CUDA/ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_slurm_test_at_a_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """The Slurm tests share one local cluster of two nodes: under pytest-xdist (scripts/test.sh) a worker waits
    for the other's Slurm test to end (a lock file), so no test's jobs queue behind another's. (xdist's
    `xdist_group` does not group under pytest 9.2: it renames a test id that pytest no longer reads.)"""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    import fcntl
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "miles-hpc-slurm-tests.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def need_command():
    def check(name: str) -> str:
        path = shutil.which(name)
        require(path is not None, f"command {name!r}")
        return path or ""

    return check


def megatron_cpu_shims() -> None:
    """Let megatron-core's forward run in a CPU-only test process: the library's own CPU mode
    (`train/mcore_cpu.py`, what `miles-hpc run` uses with `train.device=cpu`); a no-op where CUDA is available."""
    import torch

    if torch.cuda.is_available():
        import miles_hpc.train.mcore_model  # noqa: F401  (its import-time fixes for megatron-core 0.16 without TE)

        return
    from miles_hpc.train import mcore_cpu

    mcore_cpu.enable()
