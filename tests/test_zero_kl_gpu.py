"""Zero-KL mode on one GPU (tier `-m gpu`): an engine in bfloat16 with `batch_invariant` and a one-rank
`FSDPTrainer(zero_kl=True)` under bf16 mixed precision give bit-identical log-probs (the CPU test's requests:
batches of 1-3 joining, chunked prefills, prefix-cache hits) for dense, MoE and MLA models; without the mode they
differ; a dense model's decode steps under the Triton kernels replay CUDA graphs (`engine/invariant_decode.py`).
End to end: `miles-hpc run` on the GPU (engine and trainer side by side, colocated weight sync) reports
`mismatch/max_abs_logprob_diff == 0.0` at every RL step while the weights change, for Qwen3, for Qwen3-MoE with R3,
and for a multi-turn agent whose turns hit the prefix cache; the same run without the mode does not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_zero_kl import free_port, generate, make_ckpt, max_diff
from test_zero_kl_e2e import REPO, run

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.engine import runner as runner_mod
from miles_hpc.train import dist as tdist
from miles_hpc.train.fsdp import FSDPTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_world() -> Iterator[None]:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cuda"))
    yield
    tdist.teardown()


KERNELS = pytest.mark.parametrize("kernels", ["torch", "triton"])  # MILES_INVARIANT_KERNELS (models/invariant.py)


@KERNELS
@pytest.mark.parametrize(
    "arch,size",
    [("qwen3", "tiny"), ("qwen3", "small"), ("qwen3_moe", "small"), ("deepseek_v3", "small"), ("glm4_moe", "tiny")],
)
def test_engine_and_trainer_logprobs_are_bitwise_equal_on_gpu(
    cuda_world: None, tmp_path: Path, arch: str, size: str, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_INVARIANT_KERNELS", kernels)
    decoders: list[object] = []  # what serves the zero-KL engine's decode steps (None: the eager forward)
    setup = runner_mod.ModelRunner._invariant_decode
    monkeypatch.setattr(
        runner_mod.ModelRunner, "_invariant_decode", lambda self, *a: (setup(self, *a), decoders.append(self.decode))
    )
    ckpt = make_ckpt(tmp_path / "m", arch, size)
    cfg = TrainConfig(device="cuda", mixed_precision=True, max_tokens_per_microbatch=200)
    zk = FSDPTrainer(ckpt, cfg, AlgoConfig(), device="cuda", seed=0, zero_kl=True)
    assert max_diff(zk, generate(ckpt, True, device="cuda", dtype="bfloat16", num_blocks=1024)) == 0.0
    graphs = kernels == "triton" and arch == "qwen3"  # dense, Triton kernels: CUDA graphs (invariant_decode.py)
    assert [getattr(d, "graphs", None) is not None and bool(d.graphs) for d in decoders] == [graphs], decoders
    plain = FSDPTrainer(ckpt, cfg, AlgoConfig(), device="cuda", seed=0)
    assert max_diff(plain, generate(ckpt, False, device="cuda", dtype="bfloat16", num_blocks=1024)) > 0.0


GPU = [
    "train.device=cuda",
    "rollout.device=cuda",
    "model.dtype=bfloat16",
    "sync.strategy=colocated",
    "train.world_size=1",
]


@KERNELS
@pytest.mark.parametrize("arch,extra", [("qwen3", ()), ("qwen3_moe", ("algo.routing_replay=true",))])
def test_rl_run_on_gpu_has_zero_mismatch_at_every_step(
    tmp_path: Path, arch: str, extra: tuple[str, ...], kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_INVARIANT_KERNELS", kernels)  # inherited by every process of the run
    m = run(tmp_path / "run", "zero_kl=true", f"model.init_arch={arch}", "steps=6", *GPU, *extra)
    assert [r["mismatch/max_abs_logprob_diff"] for r in m] == [0.0] * 6
    assert sum(r["grad_norm"] > 0 for r in m) >= 3  # the policy moved, and the engine followed it exactly
    if extra:
        assert all(r["r3/topk_agreement"] == 1.0 for r in m)


def test_control_gpu_run_without_the_mode_has_a_mismatch(tmp_path: Path) -> None:
    m = run(tmp_path / "run", *GPU)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in m) > 0.0


def test_multi_turn_agent_on_gpu_hits_the_prefix_cache_with_zero_mismatch(tmp_path: Path) -> None:
    """Agent turns re-send the conversation: its prefix comes from the cache, the new turn is a prefill chunk after
    it, and the trainer still scores every sampled token to the same bits."""
    import json
    import subprocess
    import sys

    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_agent_cpu.yaml"),
        f"run_dir={tmp_path / 'run'}",
        "steps=2",
        "zero_kl=true",
        "train.sft_warmup_steps=3",
        *GPU,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mismatch/max_abs_logprob_diff"] for r in m] == [0.0, 0.0]
    assert all(r["prefix_cache_hit_rate"] > 0.5 for r in m)
