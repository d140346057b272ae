"""What each FSDP2 rank holds of every HF tensor (train/shards.py) matches the gathered weights: 3 gloo ranks
(uneven chunks), a dense and a MoE model (fused experts carved per expert, held whole by one rank each).
Run as a script, this file is the worker: ``python test_train_shards.py MODEL_DIR OUT_FILE`` under RANK/WORLD_SIZE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_hpc.models.presets import init_model
from miles_hpc.planner.transfer import EngineRank, engine_layout, plan_transfers
from miles_hpc.train.fsdp import FSDPTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_train_fsdp import STEP_ALGO, STEP_CFG, free_port, worker_main  # noqa: E402

pytestmark = pytest.mark.process

WORLD = 3


def check_rank(model_dir: str) -> dict:
    trainer = FSDPTrainer(model_dir, STEP_CFG, STEP_ALGO, device="cpu", seed=0)
    sm = trainer.shard_map()
    full = {n: t.clone() for n, t in trainer.state_for_sync()}  # a collective: every rank gathers
    rank = trainer.rank
    problems = []
    if list(sm.shapes) != list(full):
        problems.append(f"names/order differ: {list(sm.shapes)[:3]} vs {list(full)[:3]}")
    for name, t in full.items():
        box = sm.layout[name][rank]
        if tuple(t.shape) != sm.shapes[name]:
            problems.append(f"{name}: shape {sm.shapes[name]} vs gathered {tuple(t.shape)}")
        elif box.empty:
            if name in sm.local:
                problems.append(f"{name}: rank {rank} holds nothing but has local data")
        elif not torch.equal(sm.local[name], t[box.slices()]):
            problems.append(f"{name}: local part != gathered tensor at {box.dims}")
    # Every element is held exactly once (or by identical copies): the plan's own check, for one engine of tp 1.
    plan = plan_transfers(sm.shapes, sm.layout, engine_layout(sm.shapes, 1, 1), 2, only=EngineRank(0, 0))
    covered = {name: sum(p.global_box.numel for p in plan if p.name == name) for name in sm.shapes}
    problems += [f"{n}: plan covers {c} elements" for n, c in covered.items() if c != full[n].numel()]
    held_experts = sorted(n for n in sm.local if ".experts." in n)
    return {"rank": rank, "problems": problems, "experts": held_experts, "tensors": len(full)}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_shard_map_matches_gathered_weights(arch: str, tmp_path: Path) -> None:
    model = init_model(arch, "tiny", tmp_path / "model")
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(model), str(tmp_path / f"out{r}.pt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()[-3000:]
    outs = [torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(WORLD)]
    for o in outs:
        assert o["problems"] == [], o["problems"][:5]
        assert o["tensors"] > 10
    if arch != "qwen3":  # 8 experts over 3 ranks: 3, 3, 2 per layer, disjoint
        per_rank = [o["experts"] for o in outs]
        assert all(per_rank) and not set(per_rank[0]) & set(per_rank[1])
        assert sum(map(len, per_rank)) == len(set().union(*map(set, per_rank)))


if __name__ == "__main__":
    worker_main(check_rank)
