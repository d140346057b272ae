"""FSDPTrainer on the hybrid families (one CPU rank): packed micro-batches of several sequences give each sequence's
own log-probs (no DeltaNet or Mamba-2 state crosses a boundary inside a pack), and a step learns (issue 29)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_fsdp import make_batch, world  # noqa: F401  (the fixture `world`)

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.models.presets import init_model
from miles_hpc.train.fsdp import FSDPTrainer


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe_text", "nemotron_h"])
def hybrid_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(request.param, "tiny", tmp_path_factory.mktemp(request.param) / "model", seed=1)


def test_packed_logprobs_are_each_sequences_own(world: None, hybrid_model: Path) -> None:  # noqa: F811
    batch = make_batch(lengths=(7, 12, 70, 5, 18))  # packs of several sequences; one longer than a 64-token chunk
    trainer = FSDPTrainer(hybrid_model, TrainConfig(max_tokens_per_microbatch=40), AlgoConfig(), device="cpu", seed=0)
    got = trainer.compute_logprobs(batch)
    plain = load_pretrained(hybrid_model)
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            ids = torch.tensor([toks])
            logp = torch.log_softmax(plain(ids)[0].float(), -1)
            want = [0.0] + logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            assert torch.allclose(torch.tensor(got[i]), torch.tensor(want), atol=2e-5, rtol=0), i


def test_a_step_learns(world: None, hybrid_model: Path) -> None:  # noqa: F811
    batch = make_batch()
    trainer = FSDPTrainer(hybrid_model, TrainConfig(lr=1e-3), AlgoConfig(), device="cpu", seed=0)
    before = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    for i in range(len(batch)):
        delta = sum(a - b for a, b, m in zip(after[i], before[i], batch.loss_mask[i]) if m)
        assert (delta > 0) == (batch.advantages[i][0] > 0), i
    # The recurrent layers' parameters were trained too (their gradients reached them).
    names = dict(trainer.state_for_sync())
    fresh = dict(iter_hf_tensors(load_pretrained(hybrid_model)))  # the sync's names: the checkpoint's
    recurrent = (".linear_attn.", ".mixer.A_log", ".mixer.conv1d.")  # Gated DeltaNet's; Mamba-2's
    moved = [n for n in names if any(r in n for r in recurrent) and not torch.equal(names[n].float(), fresh[n].float())]
    assert any(n.endswith("A_log") for n in moved) and any("conv1d" in n for n in moved)


def test_a_run_of_a_hybrid_is_refused_where_it_cannot_go_yet() -> None:
    from miles_hpc.config import ConfigError, load_config

    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
    load_config(tiny, ["model.init_arch=qwen3_next"])  # our engines at TP 1, FSDP, broadcast: fine
    for override, key in (
        ("rollout.engine_tp=2", "rollout.engine_tp"),
        ("train.backend=megatron megatron.distributed_optimizer=false", "train.backend"),
        ("zero_kl=true", "zero_kl"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(tiny, ["model.init_arch=qwen3_5_moe_text", *override.split()])
