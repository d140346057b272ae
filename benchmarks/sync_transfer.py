"""The `transfer` section of bench_weight_sync.py: time one publish per strategy to real engine processes.

Engines are real `miles-hpc serve` processes on this machine, loaded with a random-init checkpoint of the chosen
shape; the trainer side is this process, publishing perturbed weights through `sync.publish.Publisher` (pause ->
push -> verify checksums -> continue), exactly what the RL loop runs. Per strategy and engine count: bytes moved
(rollout dtype), push seconds and GB/s (median of `--reps` publishes), the whole cycle's seconds, and as the
physical reference measured in the same run, this host's memcpy bandwidth for the same bytes (a broadcast to E
engines on one host cannot beat E copies of the bytes through memory).

`--device cuda`: the model is bf16 on GPU 0 and the reference is the device-to-device copy bandwidth of the same
bytes. `colocated` engines serve on GPU 0 too (`--kv-cache-fraction` small). Broadcast, p2p and delta need a
second GPU (NCCL refuses two ranks of one communicator on one GPU): with G >= 2 GPUs their engines go to GPUs
1..G-1 in turn, broadcast and p2p run over NCCL (p2p with one trainer rank: its threads would share GPU 0), delta
codes on the GPUs (`sync.delta_device: trainer`), and an all-reduce between GPUs 0 and 1 of the same bytes
(`collective_bw.py`, NCCL) is measured in the same run as the link's reference; on the CPU the same all-reduce
runs over gloo.

Strategies: `broadcast` (every publish moves the full tensors over gloo), `p2p` (`--trainer-ranks` ranks,
threads of this process, each sending its dim-0 shards to every engine; verified per piece), `colocated` (full
tensors through a shared-memory segment per bucket; on GPU, written straight into the engines' parameters through
CUDA IPC handles opened once), `colocated_buckets` (on GPU: per-bucket CUDA IPC handles, what real SGLang gets)
and `delta` (each publish perturbs 2% of the values
by one ulp, about what an RL step at lr 1e-6 does to bf16 weights; the first publish is full and untimed, then
deltas go through RUN/weights files; `bytes` stays the full size so GB/s compare as "model bytes updated per s").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from collective_bw import allreduce_bandwidth  # benchmarks/ is on sys.path when bench_weight_sync.py runs

from miles_hpc.launch.local import free_port
from miles_hpc.models import ModelConfig, build_model, iter_hf_tensors, save_pretrained
from miles_hpc.models.presets import preset_config
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.rollout.sglang import wait_for_engines
from miles_hpc.sync.protocol import WeightSync
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies import colocated_direct
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.broadcast import BroadcastSync
from miles_hpc.sync.strategies.colocated import ColocatedSpec, ColocatedSync
from miles_hpc.sync.strategies.colocated_direct import write_and_hash
from miles_hpc.sync.strategies.delta import DeltaSpec, DeltaSync
from miles_hpc.sync.strategies.p2p import P2PSync, ThreadedRanks
from miles_hpc.sync.wire.checksum import tensor_checksums

TRANSPORTS = {
    "broadcast": "gloo (loopback)",
    "p2p": "gloo (loopback), trainer ranks as threads",
    "delta": "files (RUN/weights)",
    "colocated": "shared memory",
    "colocated_buckets": "shared memory",
}


def memcpy_gbps(nbytes: int, device: str = "cpu") -> float:
    """Copy bandwidth of `nbytes` on `device` (bytes copied per second; a copy reads and writes each byte)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def _transport(strategy: str, device: str) -> str:
    if not device.startswith("cuda"):
        return TRANSPORTS[strategy]
    gpu = {
        "colocated": "CUDA IPC, direct writes",
        "colocated_buckets": "CUDA IPC, buckets",
        "broadcast": "NCCL, GPU 0 -> engine GPUs",
        "p2p": "NCCL, GPU 0 -> engine GPUs",
        "delta": "files, GPU codec",
    }
    return gpu[strategy]


def _checksum_s(named: list[tuple[str, torch.Tensor]], device: str) -> float:
    """Seconds the trainer's own checksums of these tensors take (part of every push: what `verify` compares)."""
    tensor_checksums(named)
    _sync(device)
    t0 = time.perf_counter()
    tensor_checksums(named)
    _sync(device)
    return time.perf_counter() - t0


def _direct_copy_s(sync: Any, named: list[tuple[str, torch.Tensor]]) -> tuple[float, float] | None:
    """Seconds the copies of a direct write take alone (every tensor into the engine's own view of it, through the
    handles the strategy opened, one torch copy each), and the same copies as the push makes them, hashing what
    they write (`colocated_direct.write_and_hash` in the push's launches, one host read). The values are the
    ones just published, so the engine's weights do not change."""
    targets = list(sync._direct._targets.values())
    if not targets:
        return None
    views = targets[0].views

    def copy_all() -> None:
        for name, t in named:
            views[name].copy_(t)

    def copy_hash() -> None:
        write_and_hash(((t, [views[name]], False) for name, t in named), 512 << 20).cpu()

    out = []
    for fn in (copy_all, copy_hash):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out[0], out[1]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def bench_transfer(args: argparse.Namespace, sizes: dict[str, dict[str, int]]) -> Iterator[dict[str, Any]]:
    if getattr(args, "first_launch_mb", None) is not None:  # the direct write's first launch (A/B of its size)
        colocated_direct.FIRST_LAUNCH_BYTES = args.first_launch_mb << 20
    if os.environ.get("MILES_SYNC_DEBUG"):  # per-bucket timings of the strategies on stderr
        logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("miles_hpc.sync").setLevel(logging.DEBUG)
    gpu = args.device.startswith("cuda")
    gpus = torch.cuda.device_count() if gpu else 0
    hf = preset_config("qwen3", "small") | sizes[args.transfer_size] | {"torch_dtype": "bfloat16" if gpu else "float32"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(args.seed)
        model = build_model(ModelConfig.from_hf_dict(hf), device=args.device)  # bf16 on the GPU
        save_pretrained(model, model_dir)
        for strategy in args.strategies.split(","):
            if gpus == 1 and not strategy.startswith("colocated"):
                yield {
                    "bench": "weight_sync",
                    "section": "transfer",
                    "strategy": strategy,
                    "device": args.device,
                    "skipped": "one GPU: NCCL refuses two ranks on one device; needs a second GPU",
                }
                continue
            for engines in [int(e) for e in args.engines.split(",")]:
                if gpus and strategy in ("broadcast", "p2p") and 1 + engines > gpus:
                    why = f"NCCL: {1 + engines} ranks need as many GPUs, this machine has {gpus}"
                    yield {
                        "bench": "weight_sync",
                        "section": "transfer",
                        "strategy": strategy,
                        "engines": engines,
                        "device": args.device,
                        "skipped": why,
                    }
                    continue
                work = Path(tmp) / f"{strategy}{engines}"
                yield asyncio.run(_one(args, model, model_dir, work, engines, strategy, gpus))
        if gpus != 1:  # the link's reference: an all-reduce of the same bytes between two ranks (GPUs 0 and 1)
            nbytes = sum(t.numel() * t.element_size() for _, t in iter_hf_tensors(model))
            yield {
                **allreduce_bandwidth(2, "cuda" if gpu else "cpu", max(1, min(nbytes, 1 << 30) >> 20)),
                "reference_for": "weight_sync transfer",
            }


def _perturb_ulps(t: torch.Tensor, frac: float, g: torch.Generator) -> None:
    """Move about `frac` of the values of a float tensor by one ulp (bit pattern +-1), in place; `g` lives on the
    tensor's device."""
    bits = t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).view(-1)
    move = torch.rand(bits.shape, generator=g, device=bits.device) < frac
    step = torch.randint(0, 2, bits.shape, generator=g, device=bits.device, dtype=bits.dtype) * 2 - 1
    bits += step * move


def _make_sync(strategy: str, work: Path, bucket_mb: int, ranks: ThreadedRanks, gpu: bool) -> WeightSync:
    backend = "nccl" if gpu else "gloo"
    if strategy == "p2p":
        return P2PSync(
            GroupSyncSpec(
                master_address="127.0.0.1",
                next_port=free_port,
                bucket_bytes=bucket_mb << 20,
                backend=backend,
                timeout_s=300,
            ),
            ranks,
        )
    if strategy == "delta":  # on GPUs the codec runs where the tensors are (sync.delta_device: trainer)
        return DeltaSync(DeltaSpec(run_dir=work, timeout_s=300, device=None if gpu else "cpu"))
    if strategy.startswith("colocated"):  # colocated: direct writes on a GPU; colocated_buckets: never
        return ColocatedSync(ColocatedSpec(bucket_bytes=bucket_mb << 20, timeout_s=300, direct=strategy == "colocated"))
    return BroadcastSync(
        GroupSyncSpec(
            master_address="127.0.0.1",
            next_port=free_port,
            backend=backend,
            bucket_bytes=bucket_mb << 20,
            timeout_s=300,
        )
    )


def _engine_device(args: argparse.Namespace, strategy: str, i: int, gpus: int) -> list[str]:
    """`serve` flags placing engine `i`: the trainer's GPU for colocated, else GPUs 1..G-1 in turn."""
    if not args.device.startswith("cuda"):
        return []
    if strategy.startswith("colocated"):
        return ["--device", args.device, "--kv-cache-fraction", "0.02"]
    return ["--device", f"cuda:{1 + i % (gpus - 1)}", "--kv-cache-fraction", "0.05"]


async def _one(
    args: argparse.Namespace, model: torch.nn.Module, model_dir: Path, work: Path, n: int, strategy: str, gpus: int
) -> dict[str, Any]:
    rdv = work / "rendezvous"
    rdv.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "miles_hpc.cli",
                "serve",
                str(model_dir),
                "--port",
                "0",
                "--rendezvous",
                str(rdv / f"engine-{i}.json"),
                "--max-total-tokens",
                "4096",
                *_engine_device(args, strategy, i, gpus),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        for i in range(n)
    ]
    try:
        urls = [r.url for r in wait_for_engines(rdv, n, timeout=300, poll_s=0.1)]
        named = [(k, v.detach().clone()) for k, v in iter_hf_tensors(model)]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        trainer_ranks = 1 if gpus else args.trainer_ranks  # NCCL: one rank per GPU, and the trainer has GPU 0
        ranks = ThreadedRanks(named, trainer_ranks)  # p2p's trainer side: views of `named`, kept current
        sync = _make_sync(strategy, work, args.bucket_mb, ranks, gpus > 0)
        g = torch.Generator(args.device).manual_seed(args.seed)
        pushes: list[float] = []
        cycles: list[float] = []
        phases: list[dict[str, float]] = []  # direct writes: the push's phases (DirectWriter.last)
        verifies: list[float] = []  # the engines' checksums, fetched and compared (part of the cycle)
        async with Router([EngineClient(u) for u in urls], RouterConfig(health_interval_s=30), owns_clients=True) as r:
            publisher = Publisher(sync, r, pause_mode="in_place")
            inner = sync.push

            async def timed_push(it, version):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                out = await inner(it, version)
                pushes.append(time.perf_counter() - t0)
                phases.append(dict(getattr(getattr(sync, "_direct", None), "last", {})))
                return out

            sync.push = timed_push  # type: ignore[method-assign]
            inner_verify = sync.verify

            async def timed_verify(targets, sent):  # type: ignore[no-untyped-def]
                t0 = time.perf_counter()
                out = await inner_verify(targets, sent)
                verifies.append(time.perf_counter() - t0)
                return out

            sync.verify = timed_verify  # type: ignore[method-assign]
            try:
                for rep in range(args.reps + 1):  # the first publish also builds the group: not timed
                    for _, t in named:
                        _perturb_ulps(t, 0.02, g)
                    _sync(args.device)
                    t0 = time.perf_counter()
                    await publisher.publish(lambda: iter(named), str(rep + 1))
                    cycles.append(time.perf_counter() - t0)
                if os.environ.get("MILES_BENCH_PROFILE"):  # one more publish under cProfile, its top rows on stderr
                    import cProfile
                    import pstats

                    prof = cProfile.Profile()
                    prof.enable()
                    await publisher.publish(lambda: iter(named), str(args.reps + 2))
                    prof.disable()
                    rows = int(os.environ["MILES_BENCH_PROFILE"])
                    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(rows)
                    pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(rows)
                    for timings in (pushes, cycles, phases, verifies):
                        del timings[args.reps + 1 :]  # (the profiled publish is not one of the timed ones)
                direct = strategy == "colocated" and args.device.startswith("cuda")
                copy_s = _direct_copy_s(sync, named) if direct else None
            finally:
                await sync.close()
        push_s, cycle_s = statistics.median(pushes[1:]), statistics.median(cycles[1:])
        timed = [p for p in phases[1:] if p]
        phase = {f"push_{k}": round(statistics.median(p[k] for p in timed), 5) for k in (timed[0] if timed else {})}
        moved = nbytes
        if strategy == "delta":  # what the last publish actually wrote
            moved = json.loads((work / "weights" / f"v{args.reps + 1}" / "manifest.json").read_text())["total_bytes"]
        return {
            "bench": "weight_sync",
            "section": "transfer",
            "strategy": strategy,
            "transport": _transport(strategy, args.device),
            "device": args.device,
            "engines": n,
            "trainer_ranks": trainer_ranks if strategy == "p2p" else 1,
            "size": args.transfer_size,
            "bytes": nbytes,
            "reps": args.reps,
            "push_s": round(push_s, 4),
            "push_gbps": round(nbytes / push_s / 1e9, 3),
            "bytes_delivered_gbps": round(n * nbytes / push_s / 1e9, 3),
            "cycle_s": round(cycle_s, 4),
            "verify_s": round(statistics.median(verifies[1:]), 4) if len(verifies) > 1 else None,
            "moved_bytes": moved,
            **phase,
            **({"first_launch_bytes": colocated_direct.FIRST_LAUNCH_BYTES} if phase else {}),
            "memcpy_gbps": round(memcpy_gbps(nbytes, args.device), 2),
            "trainer_checksums_s": round(_checksum_s(named, args.device), 4),
            **(
                {}
                if copy_s is None
                else {
                    "direct_copy_s": round(copy_s[0], 4),
                    "direct_copy_gbps": round(nbytes / copy_s[0] / 1e9, 1),
                    "direct_copy_hash_s": round(copy_s[1], 4),
                    "direct_copy_hash_gbps": round(nbytes / copy_s[1] / 1e9, 1),
                }
            ),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
