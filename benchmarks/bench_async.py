"""Sync vs fully async RL on the same hardware, when a few trajectories are much longer than the rest.

The real loops (loop/sync.py and loop/fully_async.py: producer, buffer, FSDP2 trainer, weight publish with
checksums) drive real `miles-hpc serve` engines on this machine. Only the response lengths are made long-tailed:
every sample's `max_new_tokens` is drawn from a lognormal (seeded by the sample's own sampling seed, so both modes
see the same distribution) and generated with `ignore_eos`, so an engine's time per sample follows it
(`--sigma 1.0`: p99 / median = e^2.33 = 10.2). Per mode, one JSON line: trained samples per second, the trainer's
idle fraction (1 - time in train_step / wall), staleness of the trained groups, and for fully async the speedup
over sync measured in the same run.

    python benchmarks/bench_async.py                       # CPU, tiny Qwen3, 1 engine, ~2 min
    python benchmarks/bench_async.py --device cuda --size small --engines 1 --steps 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from miles_hpc.config import load_config
from miles_hpc.data.prompts import PromptIterator, render_prompt
from miles_hpc.data.tasks import make_task
from miles_hpc.launch.local import free_port
from miles_hpc.launch.trainer_ranks import RankedTrainer
from miles_hpc.loop import fully_async
from miles_hpc.loop import sync as sync_loop
from miles_hpc.metrics import MetricsLogger
from miles_hpc.models.presets import init_model
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.plugins import load_object
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.rollout.sglang import wait_for_engines
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.broadcast import BroadcastSync

REPO = Path(__file__).resolve().parents[1]


class TailRouter:
    """The real router, with each sample's length drawn from a lognormal (seeded by its sampling seed)."""

    def __init__(self, router: Router, median: float, sigma: float, cap: int) -> None:
        self.router, self.median, self.sigma, self.cap = router, median, sigma, cap

    def length(self, seed: int) -> int:
        return max(1, min(self.cap, round(self.median * random.Random(seed).lognormvariate(0.0, self.sigma))))

    async def generate(self, ids: list[int], params: dict[str, Any], **kw: Any) -> Any:
        if "sampling_seed" in params:  # a first piece; a continuation keeps the length left of its first piece
            params = {**params, "max_new_tokens": self.length(params["sampling_seed"]), "ignore_eos": True}
        return await self.router.generate(ids, params, **kw)


async def run_mode(args: argparse.Namespace, mode: str, model_dir: Path, urls: list[str], work: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from miles_hpc.train.fsdp import FSDPTrainer

    overrides = [
        f"mode={mode}",
        f"steps={args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.n}",
        f"rollout.max_new_tokens={args.max_len}",
        f"fully_async.max_inflight={args.max_inflight}",
        f"fully_async.max_staleness={args.max_staleness}",
        f"fully_async.buffer_groups={max(args.prompts, 2 * args.prompts)}",
        "train.world_size=1",
        "train.sft_warmup_steps=0",
        "train.checkpoint_interval=0",
        "algo.tis_cap=2.0",
    ]
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", overrides)
    trainer = RankedTrainer(
        FSDPTrainer(str(model_dir), cfg.train, cfg.algo, device=args.device, seed=0, total_steps=args.steps)
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    records = make_task("arith", n=4096, seed=0)
    prompts = PromptIterator(records, batch_size=args.prompts, seed=0, shuffle=True)
    (work / mode).mkdir(parents=True)
    clients = [EngineClient(u) for u in urls]
    async with Router(clients, RouterConfig(health_interval_s=30), owns_clients=True) as router:
        sync = BroadcastSync(
            GroupSyncSpec(
                master_address="127.0.0.1", next_port=free_port, backend="nccl" if args.device == "cuda" else "gloo"
            )
        )
        publisher = Publisher(sync, router, pause_mode="retract")
        metrics = MetricsLogger(work / mode, total_steps=args.steps, console=None)
        ctx = sync_loop.LoopContext(
            cfg=cfg,
            trainer=trainer,
            router=TailRouter(router, args.median_len, args.sigma, args.max_len),  # type: ignore[arg-type]
            publisher=publisher,
            prompts=prompts,
            records=records,
            render=lambda r: render_prompt(r, tokenizer, apply_chat_template=False),
            tokenizer=tokenizer,
            reward_fn=load_object(cfg.reward.fn, kind="reward function"),
            store=None,
            metrics=metrics,
            checkpoints=work / mode / "checkpoints",
        )
        try:
            if mode == "sync":
                await sync_loop.publish(ctx, version=0)  # both modes start from the same weights on the engines
            t0 = time.perf_counter()
            await (fully_async.run if mode == "fully_async" else sync_loop.run)(ctx, 0)
            wall = time.perf_counter() - t0
        finally:
            metrics.close()
            await sync.close()
    rows = [json.loads(line) for line in (work / mode / "metrics.jsonl").read_text().splitlines()]
    train_s = sum(r["time/train_s"] for r in rows)
    samples = sum(r["rollout/samples"] for r in rows)
    # Steady state: from the end of step 0 (the async pipeline's fill and the first publish are behind us).
    steady_wall = rows[-1]["time/elapsed_s"] - rows[0]["time/elapsed_s"]
    steady = rows[1:]
    lens = [r["response_len_mean"] for r in rows]
    out = {
        "bench": "async",
        "mode": mode,
        "engine": args.engine,
        "device": args.device,
        "engines": args.engines,
        "steps": args.steps,
        "token_ms": args.token_ms if args.engine == "sim" else None,
        "train_threads": args.train_threads,
        "samples_per_step": args.prompts * args.n,
        "median_len": args.median_len,
        "sigma": args.sigma,
        "p99_over_median": round(math.exp(2.326 * args.sigma), 1),
        "max_len": args.max_len,
        "wall_s": round(wall, 2),
        "samples_per_s": round(samples / wall, 3),
        "trainer_idle_frac": round(1 - train_s / wall, 3),
        "train_s": round(train_s, 2),
        "response_len_mean": round(statistics.fmean(lens), 1),
        "sync_frac": round(sum(r["time/sync_s"] for r in rows) / wall, 3),
        "steady_samples_per_s": round(sum(r["rollout/samples"] for r in steady) / steady_wall, 3),
        "steady_trainer_idle_frac": round(1 - sum(r["time/train_s"] for r in steady) / steady_wall, 3),
    }
    if mode == "fully_async":
        out |= {
            "max_inflight": args.max_inflight,
            "max_staleness": args.max_staleness,
            "staleness_mean": round(statistics.fmean(r["async/staleness_mean"] for r in rows), 2),
            "staleness_max": max(r["async/staleness_max"] for r in rows),
            "wait_frac": round(sum(r["time/wait_s"] for r in rows) / wall, 3),
            "dropped_stale_groups": rows[-1]["async/dropped_stale"],
            "engine_util": round(statistics.fmean(r["async/engine_util"] for r in rows), 3),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="tiny", help="qwen3 preset of the model (tiny, small, ...)")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--median-len", type=float, default=16.0, help="median response length in tokens")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the length (1.0: p99 = 10x median)")
    ap.add_argument("--max-len", type=int, default=256, help="length cap")
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--modes", default="sync,fully_async")
    ap.add_argument(
        "--engine",
        default="real",
        choices=["real", "sim"],
        help="real: `miles-hpc serve`; sim: sim_engine.py, L tokens take L x --token-ms whatever the load",
    )
    ap.add_argument("--token-ms", type=float, default=4.0, help="sim engine: time per generated token")
    ap.add_argument(
        "--train-threads",
        type=int,
        default=1,
        help="torch threads of the trainer, both modes (1 on a 2-core CPU leaves the other core to the "
        "rollout side, as separate training and rollout GPUs would)",
    )
    args = ap.parse_args()

    import torch

    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    torch.set_num_threads(args.train_threads)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = init_model("qwen3", args.size, work / "model")
        rdv = work / "rendezvous"
        rdv.mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if args.engine == "sim":
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            cmd = [
                sys.executable,
                str(REPO / "benchmarks" / "sim_engine.py"),
                "--token-ms",
                str(args.token_ms),
                "--vocab",
                str(vocab),
            ]
        else:
            cmd = [sys.executable, "-m", "miles_hpc.cli", "serve", str(model_dir), "--device", args.device]
        procs = [
            subprocess.Popen(
                [*cmd, "--port", "0", "--rendezvous", str(rdv / f"engine-{i}.json")],
                stdout=subprocess.DEVNULL,
                stderr=open(os.environ.get("ENGINE_LOG", os.devnull), "a"),
                env=env,
            )
            for i in range(args.engines)
        ]
        init_trainer_world(
            world_from_env(
                {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
                device=args.device,
            )
        )
        try:
            urls = [r.url for r in wait_for_engines(rdv, args.engines, timeout=300, poll_s=0.1)]
            results = {}
            for mode in args.modes.split(","):
                results[mode] = asyncio.run(run_mode(args, mode, model_dir, urls, work))
                if mode == "fully_async" and "sync" in results:
                    for key in ("samples_per_s", "steady_samples_per_s"):
                        results[mode][key.replace("samples_per_s", "speedup_vs_sync")] = round(
                            results[mode][key] / results["sync"][key], 2
                        )
                print(json.dumps(results[mode]), flush=True)
        finally:
            teardown()
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(30)


if __name__ == "__main__":
    main()
