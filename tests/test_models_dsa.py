"""miles_hpc.models, the DSA families (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): MLA whose keys are the
lightning indexer's top-k per query, GLM-5.2's layer-shared indexer, dense-then-MoE layers. Parity with
transformers 5.24 on tiny random configs: logits, the tokens each query selects, gradients, checkpoints both ways,
at contexts shorter and longer than index_topk, packed sequences equal to separate ones; bad configs refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_support import hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import ModelConfig, load_pretrained, save_pretrained
from miles_hpc.models.dsa import Selection

REPO = Path(__file__).resolve().parents[1]
MLA: dict[str, Any] = dict(
    num_key_value_heads=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=16,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_head_dim=8,
    index_n_heads=8,
    index_topk=5,
    rms_norm_eps=1e-5,  # GLM-5's; the latent norms keep 1e-6 (transformers' RMSNorm default)
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GLM-5.2 in miniature: dense layers first, full/shared indexer layers, interleaved indexer RoPE.
    "glm-shared-indexer": (
        "glm_moe_dsa",
        dict(
            num_hidden_layers=5,
            first_k_dense_replace=2,
            indexer_types=["full", "full", "shared", "full", "shared"],
            n_group=1,
            topk_group=1,
            rope_parameters=dict(rope_type="default", rope_theta=8000000.0),
        ),
    ),
    # The schedule form (index_topk_freq / index_skip_topk_offset), groups in the router, yarn RoPE with mscale.
    "glm-schedule-yarn": (
        "glm_moe_dsa",
        dict(
            num_hidden_layers=4,
            first_k_dense_replace=1,
            index_topk_freq=2,
            index_skip_topk_offset=1,
            index_topk=3,
            n_group=2,
            topk_group=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=32,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
    ),
    # DeepSeek-V3.2: an indexer in every layer, half-split indexer RoPE, group-limited routing.
    "dsv32": (
        "deepseek_v32",
        dict(
            num_hidden_layers=3,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            index_n_heads=6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
}


def dsa_model(case: str, seed: int = 0) -> Any:
    model_type, overrides = CASES[case]
    hf = hf_model(model_type, seed, **{**MLA, **overrides})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a non-zero router correction bias (HF inits it to zeros)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return hf


def _capture(modules: dict[str, torch.nn.Module], pick: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name, m in modules.items():
        m.register_forward_hook(lambda _m, _a, out, name=name: seen.__setitem__(name, pick(out)))
    return seen


def hf_selections(hf: Any) -> dict[str, Any]:
    """transformers' top-k indices [B, S, k] per layer, by attention module name."""
    atts = {n: m for n, m in hf.named_modules() if n.endswith("self_attn")}
    if hf.config.model_type == "glm_moe_dsa":
        return _capture(atts, lambda out: out[2])
    return _capture({n + ".indexer": m.indexer for n, m in atts.items()}, lambda out: out)


def our_selections(model: Any) -> dict[str, Any]:
    atts = {n: m for n, m in model.named_modules() if n.endswith("self_attn")}
    return _capture(atts, lambda out: out[1])


def selected_sets(indices: torch.Tensor) -> list[list[set[int]]]:
    """Per row and query, the selected keys that attention uses (causal: key <= query)."""
    return [[{int(t) for t in q if t <= s} for s, q in enumerate(row)] for row in indices]


@pytest.mark.parametrize("seq", [4, 13], ids=["shorter-than-topk", "longer-than-topk"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_logits_and_selection(case: str, seq: int, tmp_path: Path) -> None:
    hf = dsa_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert cfg.is_dsa and cfg.model_type == CASES[case][0]
    ids = input_ids(seq=seq)
    theirs_sel, mine_sel = hf_selections(hf), our_selections(ours)
    with torch.no_grad():
        ref = hf(ids).logits
        logits = ours(ids)
    assert max_diff(logits, ref) < 1e-4
    full = [i for i in range(cfg.num_hidden_layers) if cfg.indexer_full(i)]
    for i in full:
        key = f"model.layers.{i}.self_attn"
        theirs = theirs_sel[key if cfg.model_type == "glm_moe_dsa" else key + ".indexer"]
        mine: Selection = mine_sel[key]
        assert selected_sets(mine[0]) == selected_sets(theirs), f"layer {i}"
    if seq > cfg.index_topk:  # the sparsity matters: some query sees fewer keys than it could
        widths = [len(q) for q in selected_sets(mine_sel[f"model.layers.{full[0]}.self_attn"][0])[0]]
        assert max(widths) == cfg.index_topk < seq
    shared = [i for i in range(cfg.num_hidden_layers) if not cfg.indexer_full(i)]
    assert all(not hasattr(ours.model.layers[i].self_attn, "indexer") for i in shared)
    assert bool(shared) == (case.startswith("glm"))


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_round_trip_both_ways(case: str, tmp_path: Path) -> None:
    hf = dsa_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids = input_ids(seq=11)
    save_pretrained(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["model_type"] == CASES[case][0]
    with torch.no_grad():
        ref = hf(ids).logits
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) < 1e-5
        assert max_diff(load_pretrained(tmp_path / "ours")(ids), ours(ids)) == 0.0
    assert ModelConfig.from_hf_dict(written) == ours.config


def test_packed_sequences_equal_separate_ones(tmp_path: Path) -> None:
    dsa_model("glm-shared-indexer").save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    a, b = input_ids(batch=1, seq=9, seed=3), input_ids(batch=1, seq=6, seed=4)
    with torch.no_grad():
        packed = ours(torch.cat([a, b], dim=1), cu_seqlens=torch.tensor([0, 9, 15]))
        alone = torch.cat([ours(a), ours(b)], dim=1)
    assert max_diff(packed, alone) < 1e-5


@pytest.mark.parametrize("case", ["glm-shared-indexer", "dsv32"])
def test_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf = dsa_model(case)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).train()
    ids, targets = input_ids(seq=12), input_ids(seq=12, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        if ".indexer." in name:  # the top-k choice is not differentiable: no gradient in either
            assert p.grad is None and mine[name].grad is None, name
            continue
        assert p.grad is not None and max_diff(mine[name].grad, p.grad) < 1e-5, name


def _glm_dict(**changes: Any) -> dict[str, Any]:
    d = json.loads((REPO / "configs/models/glm52.json").read_text())
    d.update(changes)
    return d


def test_glm52_config_parses_with_its_real_shapes() -> None:
    cfg = ModelConfig.from_hf_dict(_glm_dict())
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_experts, cfg.index_topk) == ("glm_moe_dsa", 78, 256, 2048)
    assert sum(cfg.indexer_full(i) for i in range(78)) == 21 and cfg.indexer_full(78)  # the MTP layer has its own
    assert cfg.moe_layer_ids()[0] == 3 and cfg.num_nextn_predict_layers == 1 and cfg.indexer_rope_interleave
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (2048, 512, 256, 256)
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(indexer_types=["full"] * 77), "indexer_types has 77 entries for num_hidden_layers=78"),
        (dict(indexer_types=["shared"] + ["full"] * 77), r"indexer_types\[0\] is \"shared\""),
        (dict(indexer_types=["full", "sparse"] + ["full"] * 76), "indexer_types: unknown entries"),
        (dict(index_topk=0), "index_topk must be positive"),
        (dict(index_n_heads=-1), "index_n_heads must be positive"),
        (dict(mlp_layer_types=["dense"] * 3), "mlp_layer_types has 3 entries"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(indexer_rope_interleave=False), "indexer_rope_interleave"),
        (dict(index_head_dim=32), "index_head_dim=32 is narrower"),
    ],
)
def test_contradicting_fields_are_refused_by_name(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        ModelConfig.from_hf_dict(_glm_dict(**changes), source="glm52/config.json")
    assert "glm52/config.json" in str(err.value)


def test_deepseek_v32_refuses_glm_only_indexer_sharing() -> None:
    d = {"model_type": "deepseek_v32", "indexer_types": ["full", "shared"], "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="DeepSeek-V3.2 runs the indexer in every layer"):
        ModelConfig.from_hf_dict(d)


def _own_records(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's own selections as the engine records them: [B, T, indexer layers, index_topk], keys <= the
    token's position, -1 padding."""
    sel = our_selections(model)
    with torch.no_grad():
        model(ids)
    k = model.config.index_topk
    rows = []
    for i in model.indexer_layer_ids:
        s = sel[f"model.layers.{i}.self_attn"][0].long()
        pos = torch.arange(s.shape[1])[:, None]
        s = torch.where(s <= pos, s, -1)
        rows.append(torch.nn.functional.pad(s, (0, k - s.shape[-1]), value=-1))
    return torch.stack(rows, dim=2)


def test_indexer_replay_is_exact_on_own_records_and_changes_what_foreign_ones_select(tmp_path: Path) -> None:
    dsa_model("glm-shared-indexer").save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = input_ids(seq=13)
    records = _own_records(ours, ids)
    assert records.shape == (2, 13, 3, ours.config.index_topk)  # layers 0, 1, 3 have an indexer
    with torch.no_grad():
        live = ours(ids)
        assert torch.equal(ours(ids, index_replay=records), live)
        assert ours.index_replay_stats().tolist() == [2 * 13 * 3, 2 * 13 * 3, 2 * 13 * 3]
        # Other keys (the earliest ones, where the indexer chose otherwise) change the output; rows of -1 keep it.
        foreign = torch.where(records >= 0, torch.arange(records.shape[-1]).expand_as(records), -1)
        foreign = torch.minimum(foreign, torch.arange(13)[None, :, None, None])
        replayed = ours(ids, index_replay=foreign)
        recorded, agree, total = ours.index_replay_stats().tolist()
        assert recorded == total and agree < recorded and max_diff(replayed, live) > 1e-3
        assert torch.equal(ours(ids, index_replay=torch.full_like(records, -1)), live)
        assert ours.index_replay_stats()[0] == 0
    with pytest.raises(ValueError, match="names keys after its own token"):
        ours(ids, index_replay=records.clamp(min=0) + 20)
    with pytest.raises(ValueError, match="index_replay must have shape"):
        ours(ids, index_replay=records[:, :, :2])


def test_scoring_in_query_chunks_selects_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The indexer scores a few queries at a time (bounded memory); each row's top-k is its own, so chunks of 4
    rows give bit-identical logits to one chunk, still equal to transformers'."""
    from miles_hpc.models import dsa

    hf = dsa_model("dsv32")
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    ids = input_ids(seq=13)
    with torch.no_grad():
        whole = ours(ids)
        monkeypatch.setattr(dsa, "SCORE_ROWS", 4)
        chunked = ours(ids)
        packed = ours(ids[:1], cu_seqlens=torch.tensor([0, 6, 13]))
        monkeypatch.setattr(dsa, "SCORE_ROWS", 256)
        packed_whole = ours(ids[:1], cu_seqlens=torch.tensor([0, 6, 13]))
        ref = hf(ids).logits
    assert torch.equal(chunked, whole) and torch.equal(packed, packed_whole)
    assert max_diff(chunked, ref) < 1e-4
