"""All-reduce bus bandwidth across processes of this host: the reference the multi-device weight-sync benchmarks
print beside their own GB/s (gloo over loopback on the CPU, NCCL over NVLink/PCIe between GPUs).

Each of `ranks` processes (GPU i for rank i with NCCL) all-reduces a `mb`-MB float32 buffer, `warmup` untimed
times, then `iters` timed ones between barriers. Bus bandwidth follows nccl-tests' definition, the figure that is
comparable across rank counts: bytes x 2 (n - 1) / n / seconds per all-reduce (each byte crosses n - 1 links twice
in a ring: reduce-scatter, then all-gather); algorithmic bandwidth is bytes / seconds.

    python benchmarks/collective_bw.py --ranks 2                 # CPU, gloo
    python benchmarks/collective_bw.py --ranks 2 --device cuda   # GPUs 0 and 1, NCCL
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles_hpc.launch.local import free_port
from miles_hpc.train.dist import leave


def _rank_main(rank: int, n: int, port: int, out: str, fn: Callable[..., Any], fn_args: tuple) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    result = fn(*fn_args)  # an exception goes back to mp.spawn, which re-raises it in the parent
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    leave(0)  # not through exit destructors: gloo/NCCL can abort a finished process there


def spawn_ranks(n: int, fn: Callable[..., Any], *fn_args: Any) -> Any:
    """`fn(*fn_args)` in `n` processes with torchrun's variables set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT: rank i uses GPU i); returns rank 0's (JSON-able) result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.spawn(_rank_main, args=(n, free_port(), out, fn, fn_args), nprocs=n, join=True)
        return json.loads(Path(out).read_text())


def _allreduce_seconds(device: str, mb: int, warmup: int, iters: int) -> float:
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = device == "cuda"
    if gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if gpu else "gloo", rank=rank, world_size=n, device_id=torch.device("cuda", rank) if gpu else None
    )
    try:
        buf = torch.ones(mb << 18, dtype=torch.float32, device=f"cuda:{rank}" if gpu else "cpu")  # mb MB

        def wait() -> None:
            if gpu:
                torch.cuda.synchronize()
            dist.barrier()

        for _ in range(warmup):
            dist.all_reduce(buf)
        wait()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        wait()
        return (time.perf_counter() - t0) / iters
    finally:
        dist.destroy_process_group()


def allreduce_bandwidth(
    ranks: int, device: str = "cpu", mb: int = 64, warmup: int = 2, iters: int = 5
) -> dict[str, Any]:
    """One JSON-able record: the all-reduce's bus and algorithmic GB/s over `ranks` processes on `device`."""
    if ranks < 2:
        raise ValueError(f"an all-reduce bandwidth needs at least 2 ranks, got {ranks}")
    if device == "cuda" and torch.cuda.device_count() < ranks:
        raise ValueError(f"--ranks {ranks} needs {ranks} GPUs; this machine has {torch.cuda.device_count()}")
    seconds = spawn_ranks(ranks, _allreduce_seconds, device, mb, warmup, iters)
    nbytes = mb << 20
    return {
        "bench": "collective",
        "op": "all_reduce",
        "backend": "nccl" if device == "cuda" else "gloo",
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "ranks": ranks,
        "bytes": nbytes,
        "seconds": round(seconds, 6),
        "algbw_gbps": round(nbytes / seconds / 1e9, 3),
        "busbw_gbps": round(nbytes * 2 * (ranks - 1) / ranks / seconds / 1e9, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--mb", type=int, default=64, help="MB all-reduced per call")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    print(json.dumps(allreduce_bandwidth(args.ranks, args.device, args.mb, iters=args.iters)), flush=True)


if __name__ == "__main__":
    main()
