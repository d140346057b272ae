"""Weight sync into tensor-parallel engines: resharded p2p against broadcast (one JSON line per result).

Measured section (`--only measured`, CPU/gloo here): E engines of `miles-hpc serve --tp-size T` (real processes)
and W trainer ranks (threads with FSDP2's dim-0 shards, `ThreadedRanks`) for each (strategy, T, W); per push: the
time (median of `--reps`), the bytes every trainer rank sends and every engine rank receives (broadcast: trainer
rank 0 originates the whole model and every engine rank receives it whole; p2p: from the plan the strategy
itself runs, `planner.transfer.plan_transfers`), and the peer in the same run: broadcast's time for the same
(T, W).

Plan section (`--only plan`): the bytes the busiest trainer rank sends per sync with p2p, for a real model's
shapes (`--model`, a config.json; default GLM-5.2 from configs/models, `--layers` of its layers), over trainer ranks
W and engines E of TP T, against broadcast's trainer rank 0, which originates the whole model (`model_bytes`)
whatever W and E.

    PYTHONPATH=. python3 benchmarks/bench_tp_sync.py                 # both sections (a few minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def _emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def measured(args: argparse.Namespace) -> None:
    import sys

    from miles_hpc.launch.local import free_port
    from miles_hpc.models import ModelConfig, build_model, iter_hf_tensors, save_pretrained
    from miles_hpc.models.presets import init_model, preset_config
    from miles_hpc.planner.transfer import EngineRank, engine_layout, link_bytes, plan_transfers
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.sync.strategies.base import GroupSyncSpec
    from miles_hpc.sync.strategies.broadcast import BroadcastSync
    from miles_hpc.sync.strategies.p2p import P2PSync, ThreadedRanks

    sys.path.insert(0, str(REPO / "tests"))
    from server_fixtures import start_server  # the launcher's way: `serve --port 0 --rendezvous FILE`

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        init_model(args.arch, "small", model_dir, seed=0)
        mc = ModelConfig.from_hf_dict(preset_config(args.arch, "small"))
        torch.manual_seed(0)
        save_pretrained(build_model(mc), model_dir)
        named = [(n, t.detach().clone()) for n, t in iter_hf_tensors(build_model(mc))]
        whole = sum(t.numel() * t.element_size() for _, t in named)
        kv = None if mc.is_mla else mc.num_key_value_heads
        times: dict[tuple[int, int], float] = {}
        for tp in (1, 2):
            servers = [start_server(model_dir, Path(tmp) / f"tp{tp}-{i}", "--tp-size", str(tp)) for i in range(2)]
            try:
                for world in (1, 2):
                    for strategy in ("broadcast", "p2p"):
                        ranks = ThreadedRanks(named, world)
                        spec = GroupSyncSpec(
                            master_address="127.0.0.1", next_port=free_port, bucket_bytes=8 << 20, timeout_s=120
                        )
                        sync = BroadcastSync(spec) if strategy == "broadcast" else P2PSync(spec, ranks)
                        took = asyncio.run(_pushes(sync, [s.url for s in servers], named, args.reps, EngineClient))
                        if strategy == "broadcast":
                            times[(tp, world)] = took
                            sent = {0: whole}  # what rank 0 originates (the collective's fan-out is gloo's)
                            recv = whole
                        else:
                            plan = plan_transfers(
                                ranks.shapes, ranks.layout, engine_layout(ranks.shapes, tp, 2, kv_heads=kv), 4
                            )
                            links = link_bytes(plan)
                            sent = {s: sum(b for (src, _), b in links.items() if src == s) for s in range(world)}
                            recv = max(
                                sum(b for (_, d), b in links.items() if d == EngineRank(0, r)) for r in range(tp)
                            )
                        _emit(
                            {
                                "bench": "tp_sync",
                                "section": "measured",
                                "device": "cpu",
                                "arch": args.arch,
                                "strategy": strategy,
                                "engines": 2,
                                "engine_tp": tp,
                                "trainer_ranks": world,
                                "model_bytes": whole,
                                "push_s": round(took, 4),
                                "peer_broadcast_push_s": round(times[(tp, world)], 4),
                                "max_bytes_sent_per_trainer_rank": max(sent.values()),
                                "max_bytes_received_per_engine_rank": recv,
                                "reps": args.reps,
                            }
                        )
            finally:
                for s in servers:
                    s.stop()


async def _pushes(sync: Any, urls: list[str], named: list[Any], reps: int, client_cls: Any) -> float:
    clients = [client_cls(u, connect_retries=0) for u in urls]
    try:
        await sync.connect(clients)
        out = []
        for rep in range(reps + 1):  # the first also warms the group up: not counted
            t0 = time.perf_counter()
            sums = await sync.push(iter(named) if sync.takes_named else iter(()), str(rep + 1))
            out.append(time.perf_counter() - t0)
            await sync.verify(clients, sums)
        return statistics.median(out[1:])
    finally:
        await sync.close()
        for c in clients:
            await c.close()


def plan(args: argparse.Namespace) -> None:
    from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors
    from miles_hpc.planner.transfer import engine_layout, fsdp_layout, link_bytes, plan_transfers

    cfg = json.loads(Path(args.model).read_text())
    n = min(cfg["num_hidden_layers"], args.layers)  # per-layer figures scale linearly
    cfg["num_hidden_layers"] = n
    for key in ("indexer_types", "mlp_layer_types", "layer_types"):  # per-layer lists: the first n
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:n]
    mc = ModelConfig.from_hf_dict(cfg)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in iter_hf_tensors(CausalLM(mc))}
    esize = 2  # bf16
    whole = esize * sum(int(torch.tensor(s).prod()) if s else 1 for s in shapes.values())
    kv = None if mc.is_mla else mc.num_key_value_heads
    for tp in (8,):
        for engines in (1, 4):
            layout = engine_layout(shapes, tp, engines, kv_heads=kv)
            for world in (8, 32):
                links = link_bytes(plan_transfers(shapes, fsdp_layout(shapes, world), layout, esize))
                per_src: dict[int, int] = {}
                for (src, _), b in links.items():
                    per_src[src] = per_src.get(src, 0) + b
                _emit(
                    {
                        "bench": "tp_sync",
                        "section": "plan",
                        "model": Path(args.model).stem,
                        "layers": mc.num_hidden_layers,
                        "engines": engines,
                        "engine_tp": tp,
                        "trainer_ranks": world,
                        "model_bytes": whole,
                        "p2p_max_bytes_per_trainer_rank": max(per_src.values()),
                        "ratio": round(max(per_src.values()) / whole, 4),
                    }
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("measured", "plan"), default=None)
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=str(REPO / "configs/models/glm52.json"))
    ap.add_argument("--layers", type=int, default=4, help="plan section: layers of --model kept")
    args = ap.parse_args()
    if args.only in (None, "plan"):
        plan(args)
    if args.only in (None, "measured"):
        measured(args)


if __name__ == "__main__":
    main()
