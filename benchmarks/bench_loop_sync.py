"""Weight sync inside the real RL loop: `miles-hpc run` once per strategy, same model, same trainer ranks and
engines, and the loop's own per-step sync time (`time/sync_s`: pause, push, verify checksums, continue).

This is where p2p and broadcast differ in what they do: with W trainer ranks, broadcast gathers every tensor into
trainer rank 0 and sends it from there, p2p has each rank send its own FSDP2 shards to the engines. One JSON line
per strategy: median sync seconds over the steps after the first (the first also builds the groups), the model
bytes each engine receives (rollout dtype) and GB/s, the final weight version (every version is verified by
checksums before the run goes on, so a version that arrives is a version that matched), the largest
train/rollout log-prob difference, and the run's wall time. References in the same run: an all-reduce between two
ranks of the same kind (gloo processes on the CPU, NCCL between two GPUs: `collective_bw.py`), and on the CPU the
memcpy bandwidth of the same bytes.

    python benchmarks/bench_loop_sync.py                                      # CPU: 2 ranks, 2 engines, gloo
    python benchmarks/bench_loop_sync.py --trainer-ranks 1 --engines 1        # one trainer, one engine
    python benchmarks/bench_loop_sync.py --device cuda --trainer-ranks 1 --engines 1 --size 1b   # 2 GPUs, NCCL
    python benchmarks/bench_loop_sync.py --device cuda --trainer-ranks 2 --engines 2 --size 1b   # 4 GPUs

With `--device cuda` the trainer ranks take GPUs 0..W-1 and the engines the next ones (`launch/local.py`
gpu_plan); broadcast and p2p then run over NCCL, which needs W + E GPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_hpc.models.presets import init_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weight_sync import SIZES  # noqa: E402  (benchmarks/ is not a package)
from collective_bw import allreduce_bandwidth  # noqa: E402
from sync_transfer import memcpy_gbps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def loop_argv(args: argparse.Namespace, model_dir: Path, run_dir: Path, strategy: str) -> list[str]:
    gpu = ["train.device=cuda", "rollout.device=cuda", "model.dtype=bfloat16"] if args.device == "cuda" else []
    return [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / args.config),
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        f"steps={args.steps}",
        "train.sft_warmup_steps=0",
        f"train.world_size={args.trainer_ranks}",
        f"rollout.num_engines={args.engines}",
        f"sync.strategy={strategy}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.samples}",
        f"rollout.max_new_tokens={args.new_tokens}",
        "train.checkpoint_interval=0",
        *gpu,
    ]


def one_run(args: argparse.Namespace, model_dir: Path, work: Path, strategy: str, nbytes: int) -> dict[str, Any]:
    run_dir = work / strategy
    t0 = time.perf_counter()
    proc = subprocess.run(loop_argv(args, model_dir, run_dir, strategy), capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"miles-hpc run with sync.strategy={strategy} failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r["time/sync_s"] for r in rows[1:]]  # step 0's publish also opens the groups
    sync_s = statistics.median(timed)
    return {
        "bench": "loop_sync",
        "strategy": strategy,
        "device": args.device,
        "trainer_ranks": args.trainer_ranks,
        "engines": args.engines,
        "size": args.size,
        "bytes": nbytes,
        "steps": len(rows),
        "sync_s": round(sync_s, 4),
        "sync_min_max_s": [round(min(timed), 4), round(max(timed), 4)],
        "gbps_per_engine": round(nbytes / sync_s / 1e9, 3),
        "first_sync_s": round(rows[0]["time/sync_s"], 4),
        "weight_version": int(rows[-1]["weight_version"]),
        "max_abs_logprob_diff": max(r["mismatch/max_abs_logprob_diff"] for r in rows),
        "train_s": round(statistics.median(r["time/train_s"] for r in rows[1:]), 4),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--strategies", default="broadcast,p2p")
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument(
        "--size",
        choices=["small", *sorted(set(SIZES) - {"small"})],
        default="25m",
        help="Qwen3 shape (bench_weight_sync.py's sizes; byte-level tokenizer)",
    )
    ap.add_argument("--steps", type=int, default=4, help="RL steps per run (the first one's sync is not timed)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml", help="the run's config (task, algorithm)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step's sync is not timed)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model("qwen3", "small", Path(tmp) / "model", overrides=SIZES[args.size])
        numel = model_numel(model_dir)
        nbytes = numel * (2 if args.device == "cuda" else 4)  # the rollout dtype: bf16 on GPUs, fp32 here
        for strategy in args.strategies.split(","):
            print(json.dumps(one_run(args, model_dir, Path(tmp), strategy, nbytes)), flush=True)
        mb = max(1, min(nbytes, 1 << 30) >> 20)
        print(json.dumps({**allreduce_bandwidth(2, args.device, mb), "reference_for": "loop_sync"}), flush=True)
        if args.device == "cpu":
            print(
                json.dumps(
                    {
                        "bench": "memcpy",
                        "device": "cpu",
                        "bytes": nbytes,
                        "gbps": round(memcpy_gbps(nbytes), 2),
                        "reference_for": "loop_sync",
                    }
                ),
                flush=True,
            )


def model_numel(model_dir: Path) -> int:
    """Parameters in the checkpoint's safetensors files (header shapes only, nothing loaded)."""
    from safetensors import safe_open

    numel = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            numel += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return numel


if __name__ == "__main__":
    main()
