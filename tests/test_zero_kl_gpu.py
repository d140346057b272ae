"""Zero-KL mode on one GPU (tier `-m gpu`): an engine in bfloat16 with `batch_invariant` and a one-rank
`FSDPTrainer(zero_kl=True)` under bf16 mixed precision give bit-identical log-probs (the CPU test's requests:
batches of 1-3 joining, chunked prefills, prefix-cache hits); without the mode they differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_zero_kl import free_port, generate, make_ckpt, max_diff

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.train import dist as tdist
from miles_hpc.train.fsdp import FSDPTrainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_world() -> Iterator[None]:
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cuda"))
    yield
    tdist.teardown()


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_engine_and_trainer_logprobs_are_bitwise_equal_on_gpu(cuda_world: None, tmp_path: Path, size: str) -> None:
    ckpt = make_ckpt(tmp_path / "m", "qwen3", size)
    cfg = TrainConfig(device="cuda", mixed_precision=True, max_tokens_per_microbatch=200)
    zk = FSDPTrainer(ckpt, cfg, AlgoConfig(), device="cuda", seed=0, zero_kl=True)
    assert max_diff(zk, generate(ckpt, True, device="cuda", dtype="bfloat16", num_blocks=1024)) == 0.0
    plain = FSDPTrainer(ckpt, cfg, AlgoConfig(), device="cuda", seed=0)
    assert max_diff(plain, generate(ckpt, False, device="cuda", dtype="bfloat16", num_blocks=1024)) > 0.0
