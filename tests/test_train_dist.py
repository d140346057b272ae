"""Data parallelism is exact: 2 gloo ranks (subprocesses) give the same update as 1 rank on the same batch.

This proves global loss normalisation (counts of the whole mini-batch on every rank), gradient averaging, dummy
micro-batches on the rank with less work, and the gathers of compute_logprobs / state_for_sync / metrics.
Run as a script, this file is the worker: ``python test_train_dist.py MODEL_DIR OUT_FILE`` under RANK/WORLD_SIZE.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_hpc.train.fsdp import FSDPTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_train_fsdp import STEP_ALGO, STEP_CFG, free_port, make_batch, params_of, tiny_model, worker_main, world  # noqa: E402,F401

pytestmark = pytest.mark.process

# Rank 1 gets fewer micro-batches than rank 0 with these lengths and the 20-token budget (dummy path runs).
LENGTHS = (7, 12, 25, 5, 18, 9, 3)


def run_once(model_dir: str) -> dict:
    """What both worlds compute: logprobs, one train_step (2 mini-batches), then the full weights."""
    trainer = FSDPTrainer(model_dir, STEP_CFG, STEP_ALGO, device="cpu", seed=0)
    batch = make_batch(LENGTHS)
    logprobs = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    params = params_of(trainer)
    return {"logprobs": logprobs, "metrics": metrics, "params": params, "rank": trainer.rank}


def test_world_size_2_equals_world_size_1(world: None, tiny_model: Path, tmp_path: Path) -> None:
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
    ref = run_once(str(tiny_model))  # the world of 1, in this process, while the two ranks run
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    for r in range(2):
        outs.append(torch.load(tmp_path / f"out{r}.pt", weights_only=False))
    r0, r1 = outs
    assert r1["logprobs"] == []  # gathered to rank 0 only
    assert len(r0["logprobs"]) == len(LENGTHS)
    for a, b in zip(r0["logprobs"], ref["logprobs"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)
    assert r0["metrics"] == r1["metrics"]  # reduced: identical on every rank
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "tokens", "mismatch/mean_abs_logprob_diff"):
        assert r0["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    for name, t in ref["params"].items():
        assert torch.allclose(r0["params"][name], t, atol=1e-5, rtol=0), name
        assert torch.equal(r0["params"][name], r1["params"][name]), name


LEAVER = """
import multiprocessing, sys
from miles_hpc.train import dist as tdist
if __name__ == "__main__":
    manager = multiprocessing.get_context("spawn").Manager()  # a live child, as megatron's checkpoint writer keeps
    print(manager._process.pid, flush=True)
    tdist.leave(3)
"""


def test_leave_ends_children_and_keeps_the_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "leaver.py"
    script.write_text(LEAVER)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == 3, done.stderr[-2000:]
    child = int(done.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # ended (and reaped by init, or gone): no orphan keeps the Slurm step alive


if __name__ == "__main__":
    worker_main(run_once)
