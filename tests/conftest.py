"""Test tiers and the CI rule: under MILES_REQUIRE_ALL=1 a missing component fails the test instead of skipping it.

Tiers (markers): default CPU tests, ``slurm`` (a running local Slurm), ``mpi`` (Open MPI + mpi4py), ``gpu`` (a CUDA or
ROCm device; the only tier allowed to skip in CI). Tests ask for a component with :func:`require`.
"""

from __future__ import annotations

import os
import shutil

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REQUIRE_ALL = os.environ.get("MILES_REQUIRE_ALL", "") not in ("", "0")


def require(available: bool, what: str) -> None:
    """Skip when ``what`` is missing, or fail when CI says every component must be there."""
    if available:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{what} is missing but MILES_REQUIRE_ALL=1 (CI must install it)", pytrace=False)
    pytest.skip(f"{what} is not available (MILES_REQUIRE_ALL=1 turns this skip into a failure)")


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


@pytest.fixture
def need_command():
    def check(name: str) -> str:
        path = shutil.which(name)
        require(path is not None, f"command {name!r}")
        return path or ""

    return check
