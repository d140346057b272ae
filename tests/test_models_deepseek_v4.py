"""miles_hpc.models, DeepSeek-V4 (sliding / CSA / HCA attention with sinks, mHC streams, hash and top-k MoE):
parity with transformers 5.24 on several tiny configs (logits, routed experts, gradients), checkpoints in the
Hub's names and in transformers' own save, packed sequences that never share state, routing replay, the legacy
config keys and the refusals; the engine's cached decode (dsv4_state.py) against the one-shot forward."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from test_models_hybrid import check_packed_sequences
from test_models_moe import _hf_routes
from test_models_support import VOCAB, hf_load, hf_model, input_ids, max_diff

from miles_hpc.models import ModelConfig, load_pretrained, save_pretrained
from miles_hpc.models.deepseek_v4 import hub_name, our_name, tiny_config
from miles_hpc.models.hf_io import build_model

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
BASE: dict[str, Any] = dict(
    num_key_value_heads=1,
    head_dim=16,
    q_lora_rank=24,
    n_routed_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    intermediate_size=8,  # transformers' alias of moe_intermediate_size (the helper's default would win)
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=8,
    index_topk=3,
    sliding_window=8,
    compress_rates={CSA: 4, HCA: 8},
    hc_mult=2,
    partial_rotary_factor=0.25,
    num_nextn_predict_layers=0,
)
CASES: dict[str, dict[str, Any]] = {
    "every-kind-yarn": dict(
        num_hidden_layers=4,
        layer_types=[SW, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),  # 128 / 4
    ),
    "csa-only-three-streams-sigmoid": dict(
        num_hidden_layers=3,
        layer_types=[CSA, CSA, CSA],
        mlp_layer_types=["moe", "hash_moe", "moe"],
        compress_rates={CSA: 3, HCA: 8},  # 40 tokens: 13 entries and a partial block
        index_topk=2,
        hc_mult=3,
        o_groups=4,
        q_lora_rank=16,
        sliding_window=5,
        partial_rotary_factor=0.5,
        scoring_func="sigmoid",
        index_n_heads=3,
    ),
    "hca-and-sliding-one-stream": dict(
        num_hidden_layers=3,
        layer_types=[HCA, SW, HCA],
        mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 5},
        hc_mult=1,
        o_groups=1,
        sliding_window=12,
        hc_sinkhorn_iters=3,
        num_experts_per_tok=3,
        routed_scaling_factor=2.0,
    ),
    "tied-head": dict(  # transformers ties DeepSeek-V4's head when asked
        num_hidden_layers=3, layer_types=[SW, CSA, HCA], mlp_layer_types=["moe", "moe", "moe"], tie_word_embeddings=True
    ),
    "legacy-keys-four-streams": dict(
        num_hidden_layers=4,
        compress_ratios=[0, 4, 128, 4, 0],  # releases list the MTP layer too: truncated
        compress_rate_hca=6,
        num_hash_layers=1,
        qk_rope_head_dim=4,
        partial_rotary_factor=None,
        compress_rates=None,
        hc_mult=4,
        index_topk=5,
    ),
}


def _hf(case: str, seed: int = 0) -> Any:
    """A tiny transformers model with random weights, routing tables and correction biases (buffers there)."""
    overrides = {k: v for k, v in {**BASE, **CASES[case]}.items() if v is not None}
    hf = hf_model("deepseek_v4", seed=seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1)
    e, k = hf.config.n_routed_experts, hf.config.num_experts_per_tok
    with torch.no_grad():
        for m in hf.modules():
            if hasattr(m, "tid2eid"):
                m.tid2eid.copy_(torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(VOCAB)]))
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.1 * torch.randn(e, generator=g))
    return hf


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_v4_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    cfg = ours.config
    assert list(cfg.spec.layer_types) == list(hf.config.layer_types)
    assert list(cfg.spec.mlp_layer_types) == list(hf.config.mlp_layer_types)
    assert ours.num_moe_layers == list(hf.config.mlp_layer_types).count("moe")
    ids = input_ids(seq=40)  # several compressed blocks, more CSA entries than index_topk
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(logits, ref) < 1e-4
    assert torch.equal(routed.long(), _hf_routes(hf, ids, kind="DeepseekV4TopKRouter"))  # hash layers: none
    save_pretrained(ours, tmp_path / "ours")
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert not any(n.startswith("model.") for n in f.keys())  # the release's names
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) == 0.0
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("case", ["every-kind-yarn", "csa-only-three-streams-sigmoid"])
def test_deepseek_v4_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids, targets = input_ids(seq=24), input_ids(seq=24, seed=7)
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: m(ids))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    checked = 0
    for name, p in hf.named_parameters():
        if p.grad is None:  # the indexer: its top-k passes no gradient, in transformers as in ours
            assert mine[name].grad is None, name
            continue
        assert max_diff(mine[name].grad, p.grad) <= 1e-4 * p.grad.abs().max().item() + 1e-7, name
        checked += 1
    assert checked > 50


def test_packed_sequences_never_share_state(tmp_path: Path) -> None:
    hf = _hf("every-kind-yarn")
    hf.save_pretrained(tmp_path / "hf")
    check_packed_sequences(load_pretrained(tmp_path / "hf"), tol=1e-5)


def test_routing_replay_reproduces_and_counts(tmp_path: Path) -> None:
    hf = _hf("hca-and-sliding-one-stream")
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ids = input_ids(seq=17)
    with torch.no_grad():
        logits, routed = ours(ids, return_routed_experts=True)
        assert torch.equal(ours(ids, routing_replay=routed), logits)
        assert ours.replay_stats().tolist() == [2 * 17 * 3] * 3
        other = (routed + 1) % ours.config.num_experts  # every record disagrees with the live choice
        assert max_diff(ours(ids, routing_replay=other), logits) > 1e-3
        assert ours.replay_stats().tolist() == [2 * 17 * 3, 0, 2 * 17 * 3]


def test_names_map_both_ways() -> None:
    for ours, hub in (
        ("model.embed_tokens.weight", "embed.weight"),
        ("lm_head.weight", "head.weight"),
        ("model.hc_head.hc_fn", "hc_head_fn"),
        ("model.layers.3.self_attn.compressor.indexer.kv_norm.weight", "layers.3.attn.indexer.compressor.norm.weight"),
        ("model.layers.3.self_attn.compressor.kv_norm.weight", "layers.3.attn.compressor.norm.weight"),
        ("model.layers.0.mlp.experts.5.up_proj.weight", "layers.0.ffn.experts.5.w3.weight"),
        ("model.layers.2.mlp.gate.e_score_correction_bias", "layers.2.ffn.gate.bias"),
        ("model.layers.2.ffn_hc.scale", "layers.2.hc_ffn_scale"),
    ):
        assert hub_name(ours) == hub and hub_name(hub) == hub and our_name(hub) == ours == our_name(ours)
    assert our_name("model.layers.1.attn.wq_b.weight") == "model.layers.1.self_attn.q_b_proj.weight"  # HF's save
    assert hub_name("mtp.0.emb.weight") == "mtp.0.emb.weight"


def test_deepseek_v4_fields_are_checked() -> None:
    raw = _hf("every-kind-yarn").config.to_dict()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"layer_types": [SW, "full_attention", CSA, HCA]}, r"layer_types: unknown entries \['full_attention'\]"),
        ({"layer_types": [SW, CSA, HCA]}, "layer_types has 3 entries for num_hidden_layers=4"),
        ({"mlp_layer_types": ["moe"] * 5}, "mlp_layer_types has 5 entries"),
        ({"mlp_layer_types": ["dense", "moe", "moe", "moe"]}, "mlp_layer_types: unknown entries"),
        ({"layer_types": None, "compress_ratios": [0, 4, 64, 4]}, r"compress_ratios: unknown entries \[64\]"),
        ({"layer_types": None, "compress_ratios": [0, 4]}, "compress_ratios has 2 entries"),
        ({"compress_rates": {CSA: 0, HCA: 8}}, "compress_rates.compressed_sparse_attention must be positive"),
        ({"compress_rates": {CSA: 4, "sliding": 8}}, "compress_rates: unknown layer types"),
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"o_groups": 3}, "o_groups=3 must divide"),
        ({"index_head_dim": 2}, "index_head_dim=2 is narrower"),
        ({"num_experts_per_tok": 7}, "num_experts_per_tok=7"),
        ({"q_lora_rank": None}, "q_lora_rank must be positive"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic RoPE"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf_dict({**raw, **change})
    # transformers ignores these: so do we (one key-value head, no attention bias, one shared expert, renormalised)
    ignored = {"num_key_value_heads": 4, "attention_bias": True, "n_shared_experts": 2, "norm_topk_prob": False}
    cfg = ModelConfig.from_hf_dict({**raw, **ignored})
    assert cfg.num_key_value_heads == 1 and not cfg.qkv_bias and cfg.n_shared_experts == 1 and cfg.norm_topk_prob


def test_legacy_and_default_keys_fold_as_transformers() -> None:
    hf_cfg = _hf("legacy-keys-four-streams").config
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    assert list(cfg.spec.layer_types) == [SW, CSA, HCA, CSA] == list(hf_cfg.layer_types)
    assert list(cfg.spec.mlp_layer_types) == ["hash_moe", "moe", "moe", "moe"]
    assert cfg.spec.hca_rate == 6 and cfg.rotary_dim == 4
    bare = ModelConfig.from_hf_dict({"model_type": "deepseek_v4"})  # DeepseekV4Config's defaults
    assert bare.head_dim == 512 and bare.rotary_dim == 64 and bare.num_hidden_layers == 43
    assert bare.spec.layer_types[:4] == (HCA, HCA, HCA, CSA) and bare.spec.mlp_layer_types[:4] == ("hash_moe",) * 3 + (
        "moe",
    )


def test_tiny_config_has_every_kind_and_loads_in_transformers(tmp_path: Path) -> None:
    cfg = ModelConfig.from_hf_dict(tiny_config())
    assert set(cfg.spec.layer_types) == {SW, CSA, HCA} and set(cfg.spec.mlp_layer_types) == {"hash_moe", "moe"}
    torch.manual_seed(3)
    ours = build_model(cfg)
    sinks = [p for n, p in ours.named_parameters() if n.endswith(("sinks", "position_bias", "hc_base"))]
    assert sinks and all(not p.any() for p in sinks)  # transformers' init, not CausalLM's generic one
    table = ours.model.layers[0].mlp.gate.tid2eid
    assert table.dtype == torch.long and all(len(set(row.tolist())) == row.numel() for row in table[:20])
    save_pretrained(ours, tmp_path / "tiny")
    ids = input_ids(seq=40)
    with torch.no_grad():
        logits = ours(ids)
        assert torch.isfinite(logits).all()
        assert max_diff(hf_load(tmp_path / "tiny")(ids).logits, logits) < 1e-5


def test_the_tiny_presets_prefixes_score_as_the_whole_sequence() -> None:
    """What the engine computes (a prefix) equals what the trainer computes (the whole sample) row for row: with
    the preset's 16 indexer heads no exact-zero score ties reach torch.topk, whose tie-breaking depends on the row's
    length (with 2 heads, rows 21+ of a 40-token sequence moved by 0.055 when cut at 32: docs/models.md)."""
    torch.manual_seed(0)
    ours = build_model(ModelConfig.from_hf_dict(tiny_config()).replace(dtype=None)).eval()
    ids = torch.randint(0, 300, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = ours(ids)
        for cut in range(1, 64, 5):
            assert max_diff(ours(ids[:, :cut]), whole[:, :cut]) < 1e-5, cut


# ---------------------------------------------------------------- the engine's cached decode (dsv4_state.py)


def _ours(case: str) -> Any:
    """Our model of a CASES config with 16 indexer heads (or "tiny": the preset), fp32, no transformers: the
    preset's init (std 0.02), then random sinks, pooling position biases and correction biases (zero at init,
    which would hide a slot or sink mistake) and decisive routers (no near-tie flips on rounding noise). With 2 or
    3 indexer heads the full forward itself is not prefix-consistent (exact-zero score ties break by the row's
    length: the tiny preset's docstring), so no cache could equal both a prefix's forward and the whole's."""
    if case == "tiny":
        raw = tiny_config()
    else:
        raw = {"model_type": "deepseek_v4", "vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4}
        raw.update(max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
        raw.update({k: v for k, v in {**BASE, **CASES[case]}.items() if v is not None}, index_n_heads=16)
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf_dict(raw).replace(dtype=None)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = {"sinks": 0.5, "position_bias": 0.5, "mlp.gate.weight": 0.5, "correction_bias": 0.1}
            for suffix, std in scale.items():
                if name.endswith(suffix):
                    p.copy_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Many small calls: intra-op threads only contend (10x slower on a busy 2-core runner)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _splits(total: int, decodes: int, seed: int) -> list[int]:
    """Random prefill chunk sizes (1..17: inside and across blocks of 3..16 tokens), then 1-token decodes."""
    rng = random.Random(seed)
    sizes: list[int] = []
    while sum(sizes) < total - decodes:
        sizes.append(min(rng.randint(1, 17), total - decodes - sum(sizes)))
    return sizes + [1] * decodes


def _step(model: Any, ids: torch.Tensor, lengths: list[int], states: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """One engine call: the packed new tokens ids [1, T] of sequences of `lengths`, continuing `states`."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    return model(ids, cu_seqlens=cu, family_states=states, return_routed_experts=True)


@pytest.mark.parametrize("case", ["tiny", *CASES])
def test_chunked_decode_equals_the_full_forward(case: str, one_thread: None) -> None:
    """Any split of a sequence into prefill chunks and 1-token decodes (boundaries inside and across compression
    blocks) gives the one-shot forward's logits and routes, row for row; every config at 16 indexer heads (_ours)."""
    model = _ours(case)
    total = 66
    assert model.config.spec.index_n_heads == 16
    ids = torch.randint(0, VOCAB, (1, total), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(ids, return_routed_experts=True)
        for seed in (0, 1):
            state, start = model.model.new_state(), 0
            for n in _splits(total, decodes=12, seed=seed):
                logits, routes = _step(model, ids[:, start : start + n], [n], [state])
                ref_logits, ref_routes = whole
                assert max_diff(logits, ref_logits[:, start : start + n]) < 1e-5, (case, seed, start, n)
                assert torch.equal(routes, ref_routes[:, start : start + n]), (case, seed, start, n)
                start += n
                assert state.length == start


def test_packed_sequences_with_different_histories_decode_as_their_own(one_thread: None) -> None:
    """Three sequences at different lengths (one fresh, one empty this step) advance in one packed call per step,
    each row equal to its own sequence's full forward; a state whose layers disagree is refused."""
    model = _ours("tiny")
    seqs = [torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(n)) for n in (61, 45, 30)]
    states = [model.model.new_state() for _ in seqs]
    plan = [[29, 17, 0], [5, 1, 9], [0, 3, 13], [1, 1, 1], [6, 4, 0], [1, 1, 7], *[[1, 1, 0]] * 3]
    with torch.no_grad():
        whole = [model(seq, return_routed_experts=True) for seq in seqs]
        for lengths in plan:
            starts = [state.length for state in states]
            row = torch.cat([seq[:, s : s + n] for seq, s, n in zip(seqs, starts, lengths, strict=True)], dim=1)
            logits, routes = _step(model, row, lengths, states)
            at = 0
            for (ref, ref_routes), s, n in zip(whole, starts, lengths, strict=True):
                if n == 0:  # nothing new for this one: its state must not move (checked by the lengths below)
                    continue
                assert max_diff(logits[:, at : at + n], ref[:, s : s + n]) < 1e-5, (lengths, s)
                assert torch.equal(routes[:, at : at + n], ref_routes[:, s : s + n]), (lengths, s)
                at += n
        assert [state.length for state in states] == [sum(p[i] for p in plan) for i in range(3)]
        with pytest.raises(ValueError, match="2 states for B=1 and 3 packed"):
            _step(model, row, lengths, states[:2])
        states[0].layers[1].length += 1
        with pytest.raises(ValueError, match="disagree on its length"):
            _step(model, row, lengths, states)


def test_the_cache_keeps_a_window_and_grows_an_entry_per_block(one_thread: None) -> None:
    """Decoding token by token, every layer holds exactly (dsv4_state.py): the last sliding_window - 1 kv vectors,
    one entry per complete block, the partial block's kv and gate rows, and (CSA, main and indexer) the last
    complete block's first halves; nbytes() is that sum, 4 bytes a float, so nothing pins a chunk's tensors."""
    model = _ours("tiny")
    spec, d = model.config.spec, model.config.head_dim
    ids = torch.randint(0, 300, (1, 80), generator=torch.Generator().manual_seed(2))
    state = model.model.new_state()

    def floats(kind: str, length: int, width: int) -> int:
        rate = spec.compress_rate(kind)
        pairs = 2 if kind == CSA else 1  # CSA rows carry both halves; its overlap keeps [rate, width] kv and gate
        overlap = 2 * rate * width if kind == CSA and length >= rate else 0
        return (length // rate) * width + 2 * (length % rate) * pairs * width + overlap

    with torch.no_grad():
        for length in range(1, 81):
            _step(model, ids[:, length - 1 : length], [1], [state])
            expected = 0
            for kind, layer in zip(spec.layer_types, state.layers, strict=True):
                assert layer.window.shape == (min(length, spec.sliding_window - 1), d)
                expected += layer.window.numel()
                assert (layer.entries is None) == (kind == SW) and (layer.index is None) == (kind != CSA)
                if layer.entries is not None:
                    assert layer.entries.entries.shape == (length // spec.compress_rate(kind), d)
                    expected += floats(kind, length, d)
                if layer.index is not None:
                    assert layer.index.entries.shape == (length // spec.csa_rate, spec.index_head_dim)
                    expected += floats(kind, length, spec.index_head_dim)
            assert state.nbytes() == 4 * expected, length
