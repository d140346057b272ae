"""FSDPTrainer (one CPU rank) on the DSA families: log-probs equal the plain model's at contexts longer than
index_topk, a step learns, routing replay (R3) replays its MoE layers, and `train.mtp_loss_coef` trains the
multi-token-prediction layer (and only then)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_train_fsdp import make_batch, params_of, world  # noqa: F401 (world: the gloo fixture)

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.models import load_pretrained
from miles_hpc.models.presets import init_model
from miles_hpc.train.fsdp import FSDPTrainer

LENGTHS = (40, 23, 31, 6)  # the tiny presets' index_topk is 16: most queries see a sparse subset


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def dsa_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(request.param, "tiny", tmp_path_factory.mktemp(request.param) / "model", seed=1)


def test_logprobs_match_plain_model(world: None, dsa_model: Path) -> None:
    batch = make_batch(LENGTHS)
    trainer = FSDPTrainer(dsa_model, TrainConfig(max_tokens_per_microbatch=64), AlgoConfig(), device="cpu", seed=0)
    got = trainer.compute_logprobs(batch)
    plain = load_pretrained(dsa_model)
    with torch.no_grad():
        for i, toks in enumerate(batch.tokens):
            ids = torch.tensor([toks])
            logp = torch.log_softmax(plain(ids)[0].float(), -1)
            want = [0.0] + logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
            assert torch.allclose(torch.tensor(got[i]), torch.tensor(want), atol=1e-5, rtol=0), i


def _mtp_params(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    n = trainer.config.num_hidden_layers
    return {k: v for k, v in params_of(trainer).items() if k.startswith(f"model.layers.{n}.")}


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_mtp_loss_trains_the_mtp_layer_only_when_asked(world: None, dsa_model: Path, coef: float) -> None:
    batch = make_batch(LENGTHS)
    cfg = TrainConfig(lr=1e-2, mtp_loss_coef=coef, grad_clip=0.0, max_tokens_per_microbatch=64)
    trainer = FSDPTrainer(dsa_model, cfg, AlgoConfig(), device="cpu", seed=0)
    before = _mtp_params(trainer)
    assert before, "the preset has an MTP layer"
    first = trainer.train_step(batch)
    after = _mtp_params(trainer)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if coef == 0.0:
        assert not changed and "mtp/loss" not in first
        return
    # The indexer is not trained (no gradient through the top-k choice), everything else of the layer is.
    assert set(changed) == {k for k in before if ".indexer." not in k and not k.endswith("correction_bias")}
    losses = [first["mtp/loss"]] + [trainer.train_step(batch)["mtp/loss"] for _ in range(4)]
    assert losses[-1] < losses[0], losses


def test_mtp_loss_needs_mtp_layers(world: None, tmp_path: Path) -> None:
    path = init_model("glm_moe_dsa", "tiny", tmp_path / "m", overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ValueError, match="train.mtp_loss_coef=0.5: .* no multi-token-prediction layers"):
        FSDPTrainer(path, TrainConfig(mtp_loss_coef=0.5), AlgoConfig(), device="cpu", seed=0)


def test_routing_replay_replays_the_moe_layers(world: None, dsa_model: Path) -> None:
    plain = load_pretrained(dsa_model)
    batch = make_batch(LENGTHS)
    routed = []
    with torch.no_grad():
        for toks in batch.tokens:
            _, ids = plain(torch.tensor([toks]), return_routed_experts=True)
            routed.append(ids[0])
    assert routed[0].shape[1] == len(plain.moe_layer_ids) > 0
    replayed = dataclasses.replace(batch, routed_experts=[r.numpy() for r in routed])
    trainer = FSDPTrainer(dsa_model, TrainConfig(), AlgoConfig(routing_replay=True), device="cpu", seed=0)
    metrics = trainer.train_step(replayed)
    assert metrics["r3/coverage"] == 1.0 and metrics["r3/topk_agreement"] == 1.0


def test_indexer_replay_of_own_records_trains_the_same_and_is_counted(world: None, dsa_model: Path) -> None:
    plain = load_pretrained(dsa_model)
    batch = make_batch(LENGTHS)
    k = plain.config.index_topk
    records = []
    for toks in batch.tokens:  # the plain model's own choices, recorded as the engine records them
        seen: dict[int, torch.Tensor] = {}
        hooks = [
            plain.model.layers[i].self_attn.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out[1]))
            for i in plain.indexer_layer_ids
        ]
        with torch.no_grad():
            plain(torch.tensor([toks]))
        for h in hooks:
            h.remove()
        rows = []
        for i in plain.indexer_layer_ids:
            s = seen[i][0][0].long()
            s = torch.where(s <= torch.arange(len(toks))[:, None], s, -1)
            rows.append(torch.nn.functional.pad(s, (0, k - s.shape[-1]), value=-1))
        records.append(torch.stack(rows, dim=1)[:-1].numpy())  # the last token never ran through the engine
    cfg = TrainConfig(lr=1e-2, grad_clip=0.0, max_tokens_per_microbatch=64)
    live = FSDPTrainer(dsa_model, cfg, AlgoConfig(), device="cpu", seed=0)
    replay = FSDPTrainer(dsa_model, cfg, AlgoConfig(), device="cpu", seed=0)
    with_records = dataclasses.replace(batch, indexer_topk=records)
    a, b = live.train_step(batch), replay.train_step(with_records)
    rows = sum(len(t) - 1 for t in batch.tokens) * len(plain.indexer_layer_ids)
    assert b["dsa/replay_coverage"] == rows / (batch.num_tokens * len(plain.indexer_layer_ids))
    assert b["dsa/topk_agreement"] == 1.0 and "dsa/replay_coverage" not in a
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert all(torch.equal(x, y) for x, y in zip(params_of(live).values(), params_of(replay).values()))
