"""Issue 10's runs that need two or more GPUs (`pytest -m gpu tests/test_multi_gpu.py` on such a machine): the tiny
RL loop with the trainer on GPU 0 and the engine on GPU 1 over NCCL (broadcast, p2p), and with four GPUs two
trainer ranks and two engines, p2p sending each rank's own shards. Every published version is verified by the
engines' checksums before the loop goes on, so the weight versions in the metrics are versions that matched.

Their CPU counterparts run in CI: `tests/test_loop_e2e.py` (broadcast with two trainer ranks; p2p with two ranks
and two engines, gloo). The timings of the same runs: `benchmarks/bench_loop_sync.py --device cuda`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_loop_e2e import metrics, run  # noqa: E402  (`miles-hpc run` and its metrics.jsonl, as the CPU loop tests)


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_loop(run_dir: Path, *overrides: str) -> list[dict]:
    run(
        run_dir,
        "steps=3",
        "train.device=cuda",
        "rollout.device=cuda",
        "train.mixed_precision=false",
        "train.sft_warmup_steps=5",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        *overrides,
        small=False,
    )
    return metrics(run_dir)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["broadcast", "p2p"])
def test_trainer_on_gpu0_engine_on_gpu1_over_nccl(tmp_path: Path, strategy: str) -> None:
    if gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {gpus()}")
    m = run_loop(tmp_path / "run", "train.world_size=1", "rollout.num_engines=1", f"sync.strategy={strategy}")
    assert [r["weight_version"] for r in m] == [1, 2, 3] and all(r["sync/engines"] == 1 for r in m)
    assert all(r["sync/dropped_engines"] == 0 for r in m)
    # fp32 on both sides (no TF32: torch's default), different kernels: log-probs agree to float noise
    assert max(r["mismatch/max_abs_logprob_diff"] for r in m) < 1e-3


@pytest.mark.gpu
def test_two_trainer_ranks_send_their_own_shards_to_two_engines(tmp_path: Path) -> None:
    if gpus() < 4:
        pytest.skip(f"needs 4 GPUs, this machine has {gpus()}")
    m = run_loop(tmp_path / "run", "train.world_size=2", "rollout.num_engines=2", "sync.strategy=p2p")
    assert [r["weight_version"] for r in m] == [1, 2, 3] and all(r["sync/engines"] == 2 for r in m)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in m) < 1e-3
