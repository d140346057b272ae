"""FSDPTrainer on one CPU rank (gloo world of 1): log-probs, a learning step, weights out, checkpoints, TITO."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.models import iter_hf_tensors, load_pretrained, save_pretrained
from miles_hpc.models.presets import init_model
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.train import dist as tdist
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.checkpoint import checkpoint_path, latest_checkpoint
from miles_hpc.train.fsdp import FSDPTrainer
from miles_hpc.train.losses import policy_loss
from miles_hpc.train.protocol import Trainer


def free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


def worker_main(fn: Callable[[str], object]) -> None:
    """The body of a 2-rank test worker script: ``python FILE MODEL_DIR OUT_FILE`` under RANK/WORLD_SIZE saves
    ``fn(MODEL_DIR)`` to OUT_FILE, then leaves as the CLI's workers do (no exit destructors, see `tdist.leave`)."""
    torch.set_num_threads(1)
    tdist.init_trainer_world(tdist.world_from_env(device="cpu"))
    try:
        torch.save(fn(sys.argv[1]), sys.argv[2])
    finally:
        tdist.teardown()
    tdist.leave(0)


def make_batch(lengths: tuple[int, ...] = (7, 12, 25, 5, 18), seed: int = 0) -> TrainBatch:
    """Random tokens, a 3-token prompt, alternating-sign advantages: a fixed RL batch."""
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    return TrainBatch(
        tokens=toks,
        loss_mask=[[0] * 3 + [1] * (len(t) - 3) for t in toks],
        rollout_logprobs=[(-torch.rand(len(t), generator=g) * 6).tolist() for t in toks],
        advantages=[[1.0 if i % 2 == 0 else -1.0] * len(t) for i, t in enumerate(toks)],
        token_hash=[token_hash(t) for t in toks],
    )


# Large eps makes AdamW's first update ~ lr * grad (not ~ lr * sign(grad)), so a wrongly scaled gradient shows.
STEP_CFG = TrainConfig(lr=1e-2, adam_eps=1.0, max_tokens_per_microbatch=20, updates_per_step=2, grad_clip=0.0)
STEP_ALGO = AlgoConfig(loss_agg="seq_mean_token_mean")


def params_of(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.state_for_sync()}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("qwen3", "tiny", tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """A gloo world of one process (what FSDP2 needs), torn down after the module; one CPU thread so a busy CI
    machine does not thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cpu"))
    yield
    tdist.teardown()
    torch.set_num_threads(threads)


def test_protocol(world: None, tiny_model: Path) -> None:
    trainer = FSDPTrainer(tiny_model, TrainConfig(), AlgoConfig(), device="cpu", seed=0)
    assert isinstance(trainer, Trainer)
    assert (trainer.rank, trainer.world_size, trainer.step) == (0, 1, 0)


def test_logprobs_match_plain_model(world: None, tiny_model: Path) -> None:
    batch = make_batch()
    trainer = FSDPTrainer(tiny_model, TrainConfig(max_tokens_per_microbatch=30), AlgoConfig(), device="cpu", seed=0)
    got = trainer.compute_logprobs(batch)
    plain = load_pretrained(tiny_model)
    assert len(got) == len(batch)
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            ids = torch.tensor([toks])
            logp = torch.log_softmax(plain(ids)[0].float(), -1)
            want = [0.0] + logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            assert len(got[i]) == len(toks)
            assert torch.allclose(torch.tensor(got[i]), torch.tensor(want), atol=1e-5, rtol=0), i


def test_step_raises_logprob_of_positive_advantage(world: None, tiny_model: Path) -> None:
    batch = make_batch()
    trainer = FSDPTrainer(tiny_model, TrainConfig(lr=1e-3), AlgoConfig(), device="cpu", seed=0)
    before = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    after = trainer.compute_logprobs(batch)
    for key in (
        "loss",
        "pg_loss",
        "clip_frac",
        "grad_norm",
        "lr",
        "entropy",
        "kl",
        "tokens",
        "mismatch/max_abs_logprob_diff",
        "mismatch/mean_abs_logprob_diff",
    ):
        assert key in metrics, key
    assert metrics["grad_norm"] > 0 and metrics["tokens"] == batch.num_tokens
    assert metrics["mismatch/max_abs_logprob_diff"] >= metrics["mismatch/mean_abs_logprob_diff"] > 0
    # The surrogate objective, with the pre-step log-probs as old, went down ...
    flat = lambda rows: torch.tensor([v for r in rows for v in r])  # noqa: E731
    seq = torch.cat([torch.full((len(t),), i) for i, t in enumerate(batch.tokens)])
    args = (flat(batch.advantages), flat(batch.loss_mask), seq, AlgoConfig())
    loss_before, _ = policy_loss(flat(before), flat(before), *args)
    loss_after, _ = policy_loss(flat(after), flat(before), *args)
    assert loss_after < loss_before
    # ... because positive-advantage samples became likelier and negative ones less likely.
    for i in range(len(batch)):
        delta = sum(a - b for a, b, m in zip(after[i], before[i], batch.loss_mask[i]) if m)
        assert (delta > 0) == (batch.advantages[i][0] > 0), i


def test_activation_checkpointing_same_update(world: None, tiny_model: Path) -> None:
    batch = make_batch()
    plain = FSDPTrainer(tiny_model, STEP_CFG, STEP_ALGO, device="cpu", seed=0)
    ac_cfg = TrainConfig(**{**{f: getattr(STEP_CFG, f) for f in STEP_CFG.__slots__}, "activation_checkpointing": True})
    ac = FSDPTrainer(tiny_model, ac_cfg, STEP_ALGO, device="cpu", seed=0)
    plain.train_step(batch)
    ac.train_step(batch)
    a, b = params_of(plain), params_of(ac)
    assert all(torch.allclose(a[n], b[n], atol=1e-6, rtol=0) for n in a)


def test_state_for_sync_names_values_checksums(world: None, tiny_model: Path, tmp_path: Path) -> None:
    plain = load_pretrained(tiny_model)
    want = {n: tuple(t.shape) for n, t in iter_hf_tensors(plain)}
    trainer = FSDPTrainer(tiny_model, TrainConfig(lr=1e-3), AlgoConfig(), device="cpu", seed=0)
    assert [(n, tuple(t.shape)) for n, t in trainer.state_for_sync()] == list(want.items())
    trainer.train_step(make_batch())
    state = params_of(trainer)
    assert not torch.equal(state["model.norm.weight"], dict(iter_hf_tensors(plain))["model.norm.weight"])
    # The synced tensors are a checkpoint the plain loader reads back exactly.
    for name, t in iter_hf_tensors(plain):
        t.copy_(state[name])
    save_pretrained(plain, tmp_path / "synced")
    reloaded = dict(iter_hf_tensors(load_pretrained(tmp_path / "synced")))
    assert all(torch.equal(reloaded[n], state[n]) for n in want)
    sums = trainer.checksums(torch.bfloat16)
    assert sums == {n: tensor_checksum(t.to(torch.bfloat16)) for n, t in state.items()}
    assert trainer.checksums() == {n: tensor_checksum(t) for n, t in state.items()}


def test_save_load_resumes_exactly(world: None, tiny_model: Path, tmp_path: Path) -> None:
    cfg = TrainConfig(lr=1e-3, warmup_steps=2, lr_schedule="cosine", max_tokens_per_microbatch=20)
    batches = [make_batch(seed=s) for s in range(3)]
    straight = FSDPTrainer(tiny_model, cfg, AlgoConfig(), device="cpu", seed=0, total_steps=5)
    straight.train_step(batches[0])
    path = straight.save(checkpoint_path(tmp_path, straight.step), extra={"data_position": 7})
    assert path == tmp_path / "checkpoints" / "step_1" and latest_checkpoint(tmp_path) == path
    for b in batches[1:]:
        straight.train_step(b)

    resumed = FSDPTrainer(tiny_model, cfg, AlgoConfig(), device="cpu", seed=123, total_steps=5)
    assert resumed.load(path) == {"data_position": 7}
    assert resumed.step == 1
    for b in batches[1:]:
        resumed.train_step(b)
    assert resumed.step == straight.step == 3 and resumed.lr == straight.lr
    a, b = params_of(straight), params_of(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_latest_checkpoint_ignores_partial(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step_3").mkdir(parents=True)
    (root / "step_3" / "meta.json").write_text("{}")
    (root / "step_9.partial").mkdir()
    (root / "step_5").mkdir()  # no meta.json: torn
    assert latest_checkpoint(tmp_path) == root / "step_3"
    assert latest_checkpoint(tmp_path / "nope") is None


def test_tito_hash_mismatch_raises(world: None, tiny_model: Path) -> None:
    batch = make_batch()
    batch.tokens[2][-1] = (batch.tokens[2][-1] + 1) % 300
    trainer = FSDPTrainer(tiny_model, TrainConfig(), AlgoConfig(), device="cpu", seed=0)
    with pytest.raises(ValueError, match="sample 2"):
        trainer.train_step(batch)
    batch.token_hash = []
    with pytest.raises(ValueError, match="token_hash"):
        trainer.train_step(batch)


@pytest.mark.parametrize("max_norm", [1e-3, 1e6, float("inf")])
def test_sharded_clip_equals_torch_clip(world: None, tiny_model: Path, max_norm: float) -> None:
    from miles_hpc.train.fsdp import clip_sharded_grads_

    trainer = FSDPTrainer(tiny_model, TrainConfig(), AlgoConfig(), device="cpu", seed=0)
    params = [p for p in trainer.model.parameters()]
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = p.detach().clone()
        p.grad.to_local().copy_(torch.randn(p.to_local().shape, generator=g))
    shadows = [p.detach().clone().requires_grad_() for p in params]
    for s, p in zip(shadows, params):
        s.grad = p.grad.detach().clone()
    want = torch.nn.utils.clip_grad_norm_(shadows, max_norm).full_tensor()  # torch's DTensor path
    got = clip_sharded_grads_(iter(params), max_norm)
    assert torch.allclose(got, want, rtol=1e-6) and got > 1.0
    for p, s in zip(params, shadows):
        assert torch.allclose(p.grad.to_local(), s.grad.to_local(), rtol=1e-6, atol=0)
