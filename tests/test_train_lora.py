"""LoRA RL in the FSDP trainer: only the adapter learns (base weights bit-identical), weights out are the merged
ones (gathered and as p2p shards), the adapter alone is checkpointed and resumes exactly, and 2 data-parallel ranks
(subprocesses, gloo) give the 1-rank update. Run as a script, this file is the 2-rank worker:
``python test_train_lora.py MODEL_DIR OUT_FILE`` under RANK/WORLD_SIZE."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from miles_hpc.config import LoraConfig
from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.train.fsdp import FSDPTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_train_fsdp import STEP_ALGO, STEP_CFG, free_port, make_batch, tiny_model, worker_main, world  # noqa: E402,F401

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))
LENGTHS = (7, 12, 25, 5, 18, 9, 3)
CFG = dataclasses.replace(STEP_CFG, lr=5e-2)


def lora_trainer(model_dir: Path | str, seed: int = 0) -> FSDPTrainer:
    return FSDPTrainer(model_dir, CFG, STEP_ALGO, device="cpu", seed=seed, lora=LORA)


def base_weights(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        for n, t in trainer.model.state_dict().items()
    }


def adapter_of(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.adapter_for_sync()}


def run_once(model_dir: str) -> dict:
    trainer = lora_trainer(model_dir)
    batch = make_batch(LENGTHS)
    metrics = trainer.train_step(batch)
    return {"metrics": metrics, "adapter": adapter_of(trainer), "rank": trainer.rank}


def test_only_the_adapter_learns_and_weights_out_are_merged(world: None, tiny_model: Path) -> None:
    trainer = lora_trainer(tiny_model)
    before = base_weights(trainer)
    adapter0 = adapter_of(trainer)
    assert all(not t.any() for n, t in adapter0.items() if "lora_B" in n)  # B = 0: a fresh adapter changes nothing
    merged0 = {n: t.clone() for n, t in trainer.state_for_sync()}
    ref = dict(iter_hf_tensors(load_pretrained(tiny_model)))
    assert all(torch.equal(merged0[n], ref[n]) for n in ref)
    assert trainer.optimizer.param_groups[0]["params"] == list(trainer.adapter.parameters())

    metrics = trainer.train_step(make_batch(LENGTHS))
    assert metrics["grad_norm"] > 0
    after = base_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)  # the base is frozen, bit for bit
    adapter1 = adapter_of(trainer)
    assert all(not torch.equal(adapter0[n], adapter1[n]) for n in adapter1)  # every A and B moved

    merged = dict(trainer.state_for_sync())
    for name, t in merged.items():
        module = name.removesuffix(".weight")
        if module in trainer.adapter.modules_:
            delta = trainer.adapter.delta(module).detach()
            torch.testing.assert_close(t, after[name] + delta, atol=0, rtol=0)
            assert delta.abs().max() > 0
        else:
            assert torch.equal(t, after[name]), name
    sm = trainer.shard_map()  # p2p: this rank's rows of the merged weights (world of 1: all of them)
    for name, t in sm.local.items():
        assert torch.equal(t, merged[name][sm.layout[name][0].slices()]), name


def test_adapter_checkpoint_resumes_exactly(world: None, tiny_model: Path, tmp_path: Path) -> None:
    a = lora_trainer(tiny_model)
    a.train_step(make_batch(LENGTHS, seed=1))
    path = a.save(tmp_path / "step_1", extra={"step": 1})
    assert (path / "adapter" / "adapter_model.safetensors").is_file() and not (path / "dcp").exists()
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 200_000  # no base weights
    b = lora_trainer(tiny_model, seed=5)  # another init: the load must replace it
    assert b.load(path) == {"step": 1} and b.step == a.step == 2  # two optimizer steps (updates_per_step)
    assert all(torch.equal(x, y) for x, y in zip(adapter_of(a).values(), adapter_of(b).values()))
    ma, mb = a.train_step(make_batch(LENGTHS, seed=2)), b.train_step(make_batch(LENGTHS, seed=2))
    assert ma["loss"] == mb["loss"] and ma["grad_norm"] == mb["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(adapter_of(a).values(), adapter_of(b).values()))  # Adam state too
    other = FSDPTrainer(tiny_model, CFG, STEP_ALGO, device="cpu", seed=0, lora=dataclasses.replace(LORA, rank=2))
    with pytest.raises(ValueError, match="adapter.*differs from this run's lora config"):
        other.load(path)
    full = FSDPTrainer(tiny_model, CFG, STEP_ALGO, device="cpu", seed=0)
    with pytest.raises(ValueError, match="fsdp-lora backend"):
        full.load(path)


@pytest.mark.process
def test_two_ranks_equal_one(world: None, tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(tiny_model), str(tmp_path / f"out{r}.pt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    ref = run_once(str(tiny_model))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    r0, r1 = (torch.load(tmp_path / f"out{r}.pt", weights_only=False) for r in range(2))
    for key in ("loss", "grad_norm", "entropy"):
        assert r0["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, t in ref["adapter"].items():
        torch.testing.assert_close(r0["adapter"][name], t, atol=1e-5, rtol=0)
        assert torch.equal(r0["adapter"][name], r1["adapter"][name]), name  # replicas stay identical


if __name__ == "__main__":
    worker_main(run_once)
