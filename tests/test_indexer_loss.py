"""The DSA indexer loss (`train.indexer_loss_coef`, models/dsa.indexer_kl): the same value and gradients as
megatron-core's `compute_dsa_indexer_loss` on the same tensors (dense and sparse), the loss trains the indexer and
nothing else (every other gradient is the one without it), and training on it brings the indexer's choice closer
to where the attention looks; bad combinations are refused."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from test_train_fsdp import make_batch, params_of, world  # noqa: F401 (world: the gloo fixture)

from miles_hpc.config import AlgoConfig, LoraConfig, TrainConfig
from miles_hpc.models import dsa
from miles_hpc.models.presets import init_model
from miles_hpc.train.fsdp import FSDPTrainer

LENGTHS = (40, 23, 31, 6)  # the tiny presets' index_topk is 16: most queries see a sparse subset


def _tensors(seed: int, s: int = 37, heads: int = 3, ih: int = 4) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(1, s, ih, 8, generator=g, dtype=torch.float32)
    ik = torch.randn(1, s, 8, generator=g, dtype=torch.float32)
    iw = torch.randn(1, s, ih, generator=g, dtype=torch.float32)
    q = torch.randn(1, heads, s, 12, generator=g, dtype=torch.float32)
    k = torch.randn(1, heads, s, 12, generator=g, dtype=torch.float32)
    return iq, ik, iw, q, k


def _megatron_loss(iq, ik, iw, q, k, topk, sparse, index_scale, attn_scale):  # noqa: ANN001, ANN202
    mdsa = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    s = iq.shape[1]
    scores = dsa.index_scores(iq, ik, iw, index_scale)  # megatron folds the scale into the head weights: same
    scores = scores + torch.full((s, s), float("-inf"), dtype=scores.dtype).triu(1)  # as forward_with_scores masks
    pg = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    query, key = q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3)  # [S, b, heads, dim]
    # megatron: coef x the mean over (b, S) rows; ours is the sum over rows
    return mdsa.compute_dsa_indexer_loss(scores, topk.long(), query, key, attn_scale, float(s), sparse, pg)


@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_megatron_value_and_gradients(sparse: bool, seed: int) -> None:
    iq, ik, iw, q, k = _tensors(seed)
    topk = dsa.causal_topk(dsa.index_scores(iq, ik, iw, 0.1), 9)  # [1, S, 9]: rows past 9 keys are sparse
    grads = []
    values = []
    for fn in ("ours", "megatron"):
        leaves = [t.clone().requires_grad_(True) for t in (iq, ik, iw)]
        if fn == "ours":
            v = dsa.indexer_kl(
                *leaves, q, k, index_scale=0.1, attn_scale=0.25, bounds=None, selection=[topk] if sparse else None
            )
        else:
            v = _megatron_loss(*leaves, q, k, topk, sparse, 0.1, 0.25)
        v.backward()
        values.append(v.detach())
        grads.append([t.grad for t in leaves])
    # float32 both; megatron adds 1e-10 inside its logs (scores kept moderate so no probability is that small)
    torch.testing.assert_close(values[0], values[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert values[0] > 0


def test_packed_sequences_are_each_their_own() -> None:
    """With bounds, each packed sequence's rows see its own keys only: the sum of the sequences' losses."""
    iq, ik, iw, q, k = _tensors(3, s=30)
    whole = dsa.indexer_kl(iq, ik, iw, q, k, index_scale=0.3, attn_scale=0.25, bounds=[0, 12, 30], selection=None)
    parts = sum(
        dsa.indexer_kl(
            iq[:, a:b],
            ik[:, a:b],
            iw[:, a:b],
            q[:, :, a:b],
            k[:, :, a:b],
            index_scale=0.3,
            attn_scale=0.25,
            bounds=None,
            selection=None,
        )
        for a, b in ((0, 12), (12, 30))
    )
    torch.testing.assert_close(whole, parts)


def test_chunked_rows_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    iq, ik, iw, q, k = _tensors(4, s=50)
    sel = [dsa.causal_topk(dsa.index_scores(iq, ik, iw, 0.3), 7)]
    one = dsa.indexer_kl(iq, ik, iw, q, k, index_scale=0.3, attn_scale=0.25, bounds=None, selection=sel)
    monkeypatch.setattr(dsa, "SCORE_ROWS", 16)
    chunked = dsa.indexer_kl(iq, ik, iw, q, k, index_scale=0.3, attn_scale=0.25, bounds=None, selection=sel)
    torch.testing.assert_close(one, chunked)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("glm_moe_dsa", "tiny", tmp_path_factory.mktemp("glm") / "model", seed=1)


def _grads_after_backward(trainer: FSDPTrainer, batch) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Parameter gradients of one step's backward (captured before the optimizer step clears them)."""
    got: dict[str, torch.Tensor] = {}
    step = trainer._clip_and_step

    def capture() -> torch.Tensor:
        for name, p in trainer.model.named_parameters():
            if p.grad is not None:
                got[name] = p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
        return step()

    trainer._clip_and_step = capture  # type: ignore[method-assign]
    trainer.train_step(batch)
    return got


def test_the_loss_trains_the_indexer_only(world: None, glm: Path) -> None:
    batch = make_batch(LENGTHS)
    grads = {}
    for coef in (0.0, 1.0):
        cfg = TrainConfig(lr=1e-3, indexer_loss_coef=coef, grad_clip=0.0, max_tokens_per_microbatch=64)
        grads[coef] = _grads_after_backward(FSDPTrainer(glm, cfg, AlgoConfig(), device="cpu", seed=0), batch)
    indexer = {k for k in grads[1.0] if ".indexer." in k}
    assert indexer and not indexer & set(grads[0.0]), "the indexer has gradients only from its loss"
    assert all(grads[1.0][k].abs().sum() > 0 for k in indexer)
    for name, g in grads[0.0].items():  # the main model's gradients do not see the indexer loss
        torch.testing.assert_close(grads[1.0][name], g, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_training_on_it_lowers_the_kl(world: None, glm: Path, mode: str) -> None:
    batch = make_batch(LENGTHS)
    cfg = TrainConfig(lr=3e-3, indexer_loss_coef=1.0, indexer_loss=mode, max_tokens_per_microbatch=64)
    trainer = FSDPTrainer(glm, cfg, AlgoConfig(), device="cpu", seed=0)
    before = params_of(trainer)
    kls = [trainer.train_step(batch)["dsa/indexer_kl"] for _ in range(6)]
    assert kls[-1] < 0.9 * kls[0], kls
    after = params_of(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before if ".indexer." in k)


def test_refusals(world: None, glm: Path, tmp_path: Path) -> None:
    dense = init_model("qwen3", "tiny", tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"indexer_loss_coef=0.5: .* qwen3, which has no DSA indexer"):
        FSDPTrainer(dense, TrainConfig(indexer_loss_coef=0.5), AlgoConfig(), device="cpu", seed=0)
    lora = LoraConfig(rank=4)
    with pytest.raises(ValueError, match="with LoRA: the indexer is frozen"):
        FSDPTrainer(glm, TrainConfig(indexer_loss_coef=0.5), AlgoConfig(), device="cpu", seed=0, lora=lora)
    with pytest.raises(ValueError, match="indexer_loss_coef"):
        TrainConfig(indexer_loss_coef=-1.0)
