"""The colocated direct write's device pass on its own, against one device copy of the same bytes (same run).

The tensors are the 7B transfer shape's 310 bf16 HF tensors (`bench_weight_sync.SIZES`, random values), the
destinations separate allocations (as an engine's parameters are). One JSON line per measurement, each with the
reference measured in the same process: `copy_s`, one flat device copy of the same bytes. Times are medians of
`--reps` after a warm-up; `wall` rows are what a caller waits for (host work, launches and the GPU, then a
synchronisation), `gpu` rows the device time alone (events around the launches, queued behind a sleep kernel so
that the host's work is off the clock):
- copy_per_tensor: one torch copy per tensor (what a direct write without hashing would do);
- copy_with_lanes: the fused copy + hash, one launch for all tensors (`checksum.copy_with_lanes`);
- write_and_hash: the push's launches (`colocated_direct.write_and_hash`, its default launch sizes), and
  write_and_hash_F_N: first launch F MiB, then N MiB each;
- lanes_of / tensor_checksums: the hash alone (the engine's verify) without / with heads and digests;
- host_*: host seconds until the call returns (launches queued, nothing waited for);
- `--sweep`: the kernel's layouts (block, warps, chunks per step, early loads) for copy + hash, gpu time, each
  checked bit for bit against the default layout's lanes and the destinations against the sources.

    PYTHONPATH=. python3 benchmarks/bench_direct_write.py --reps 9 [--sweep]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_weight_sync import SIZES  # noqa: E402

from miles_hpc.sync.strategies import colocated_direct  # noqa: E402
from miles_hpc.sync.wire import checksum  # noqa: E402


def shapes(size: str) -> list[tuple[int, ...]]:
    """The HF tensor shapes of the Qwen3 transfer shape `size` (byte vocabulary of 320, tied head)."""
    c = SIZES[size]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,), (d,), (d,)]
    return [(320, h)] + layer * c["num_hidden_layers"] + [(h,)]


def wall(fn: Callable[[], Any], reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def host(fn: Callable[[], Any], reps: int) -> float:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # the GPU busy meanwhile: the launches queue, nothing waits
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(out)


def gpu(fn: Callable[[], Any], reps: int) -> float:
    fn()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms: the host's work happens while this runs
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="7b", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sweep", action="store_true", help="time the kernel's layouts for copy + hash")
    ap.add_argument("--label", default="", help="a tag copied into every line (which tree ran)")
    ap.add_argument("--profile", type=int, default=0, help="print this many cProfile rows of write_and_hash (stderr)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    srcs = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes(args.size)]
    dsts = [torch.empty_like(t) for t in srcs]
    named = [(f"t{k}", t) for k, t in enumerate(srcs)]
    nbytes = sum(t.nbytes for t in srcs)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    pairs = list(zip(srcs, dsts))
    runs: dict[str, Callable[[], Any]] = {
        "copy": lambda: flat_dst.copy_(flat_src),
        "copy_per_tensor": lambda: [d.copy_(s) for s, d in pairs],
        "copy_with_lanes": lambda: checksum.copy_with_lanes(pairs),
        "write_and_hash": lambda: colocated_direct.write_and_hash(((s, [d], False) for s, d in pairs), 512 << 20),
        "lanes_of": lambda: checksum.lanes_of(srcs),
        # the push's launches, other sizes (first launch, then each): MiB
        **{
            f"write_and_hash_{f}_{n}": (
                lambda f=f, n=n: colocated_direct.write_and_hash(
                    ((s, [d], False) for s, d in pairs), 512 << 20, n << 20, f << 20
                )
            )
            for f, n in ((256, 2048), (512, 2048), (512, 4096), (1024, 1 << 20), (1 << 20, 1 << 20))
            if args.label != "old"
        },
        "tensor_checksums": lambda: checksum.tensor_checksums(named),
    }
    common = {"bench": "direct_write", "label": args.label, "size": args.size, "tensors": len(srcs), "bytes": nbytes}
    copy_wall = wall(runs["copy"], args.reps)
    copy_gpu = gpu(runs["copy"], args.reps)
    want = torch.stack([checksum._torch_lanes(checksum.words(t)) for t in srcs]).cpu()  # the definition (torch)
    for key, fn in runs.items():
        row: dict[str, Any] = {**common, "what": key}
        row["wall_s"] = round(wall(fn, args.reps), 6)
        row["gpu_s"] = round(gpu(fn, args.reps), 6)
        if key != "tensor_checksums":
            row["host_s"] = round(host(fn, args.reps), 6)
        if key in ("copy_with_lanes", "lanes_of") or key.startswith("write_and_hash"):
            for d in dsts:
                d.zero_()
            lanes = fn().cpu()
            row["lanes_ok"] = torch.equal(lanes, want)
            if key != "lanes_of":
                row["copies_ok"] = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for s, d in pairs)
        row["copy_s"], row["copy_gpu_s"] = round(copy_wall, 6), round(copy_gpu, 6)
        row["x_copy_wall"] = round(row["wall_s"] / copy_wall, 3)
        row["gb_s"] = round(nbytes / row["wall_s"] / 1e9, 1)
        print(json.dumps(row), flush=True)
    if args.profile:  # where the host's time goes (stderr): the push's launches, the GPU kept busy meanwhile
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for _ in range(args.reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
            prof.enable()
            runs["write_and_hash"]()
            prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
    if not args.sweep:
        return
    from miles_hpc.sync.wire import checksum_kernels as ck

    saved = {k: getattr(ck, k) for k in ("BLOCK", "WARPS", "ROWS", "PREFETCH", "PROGRAMS", "MIN_CHUNKS")}
    layouts = [
        {},
        {"WARPS": 8},
        {"BLOCK": 4096, "WARPS": 8},
        {"BLOCK": 1024, "WARPS": 2},
        {"BLOCK": 1024},
        {"ROWS": 2, "BLOCK": 1024},
        {"PROGRAMS": 16384},
        {"PROGRAMS": 4096},
        {"PREFETCH": False},
        {"MIN_CHUNKS": 2, "PROGRAMS": 16384},
    ]
    for layout in layouts:
        for k, v in saved.items():
            setattr(ck, k, layout.get(k, v))
        try:
            fn = runs["copy_with_lanes"]
            t = gpu(fn, args.reps)
            for d in dsts:
                d.zero_()
            ok = torch.equal(fn().cpu(), want) and all(
                torch.equal(d.view(torch.int16), s.view(torch.int16)) for s, d in pairs
            )
            t_hash = gpu(runs["lanes_of"], args.reps)
            row = {**common, "what": "sweep", "layout": layout, "copy_hash_gpu_s": round(t, 6)}
            row |= {"hash_gpu_s": round(t_hash, 6), "ok": ok, "copy_gpu_s": round(copy_gpu, 6)}
            row["x_copy_gpu"] = round(t / copy_gpu, 3)
        except Exception as e:  # noqa: BLE001  (a layout that does not compile is a result too)
            row = {**common, "what": "sweep", "layout": layout, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(row), flush=True)
    for k, v in saved.items():
        setattr(ck, k, v)


if __name__ == "__main__":
    main()
