"""Shared helpers of the weight-sync tests over real engines: a fleet of bf16 `miles-hpc serve` processes behind
an admin key, one engine on the GPU, a router over them, an engine's checksums, and seeded "trainer versions" of the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from conftest import require
from test_client_engine import HAVE_SERVER, EngineProcess, engine_fleet, stop_all, tiny_model

from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.rollout.sglang import EngineRecord

ADMIN = "admin-key-sync-tests"


@contextmanager
def bf16_fleet(d: Path, n: int = 2) -> Iterator[list[EngineProcess]]:
    """`n` engines serving the tiny model in bf16 (the rollout dtype of the sync tests), admin key from a file."""
    (d / "admin_key").write_text(ADMIN + "\n")
    (d / "admin_key").chmod(0o600)
    args = ("--dtype", "bfloat16", "--admin-api-key-file", str(d / "admin_key"))
    with engine_fleet(d, n, args, wait=True) as procs:
        yield procs


@contextmanager
def gpu_engine(d: Path) -> Iterator[EngineRecord]:
    """One engine serving the tiny model in bf16 on this machine's GPU (the colocated tests' peer), ready."""
    require(HAVE_SERVER, "the embedded engine server (miles-hpc serve)")
    proc = EngineProcess(tiny_model(), d / "engine-0.json", args=("--device", "cuda", "--dtype", "bfloat16"))
    try:
        yield proc.start().wait_ready(180)
    finally:
        stop_all([proc])


def router_of(procs: list[EngineProcess]) -> Router:
    clients = [EngineClient(f"http://127.0.0.1:{p.port}", admin_api_key=ADMIN, connect_retries=0) for p in procs]
    return Router(clients, RouterConfig(health_interval_s=60), owns_clients=True)


async def engine_sums(client: EngineClient) -> dict[str, str]:
    return (await client.weights_checksums()).ranks[0].checksums


def perturbed_weights(seed: int, dtype: torch.dtype | None = torch.bfloat16) -> list[tuple[str, torch.Tensor]]:
    """The tiny model's HF tensors moved by a seeded perturbation (one "trainer step" per seed), in ``dtype``
    (None: as loaded)."""
    model = load_pretrained(tiny_model())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    return [(n, t.clone() if dtype is None else t.to(dtype).clone()) for n, t in iter_hf_tensors(model)]
