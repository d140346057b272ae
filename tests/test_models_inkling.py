"""miles_hpc.models, Inkling (inkling_text: sliding-window and global attention with relative logits and short
convolutions, dense and shared-expert-sink MoE MLPs, normed embedding, muP-scaled and padded head): parity with
transformers 5.24 on several tiny configs (logits, routed experts, gradients), checkpoints both ways, packed
sequences that never share state, routing replay, the config's derivations and its refusals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_models_hybrid import check_packed_sequences
from test_models_moe import _hf_routes
from test_models_support import VOCAB, hf_load, input_ids, max_diff, randomize_

from miles_hpc.models import ModelConfig, load_pretrained, save_pretrained
from miles_hpc.models.inkling import InklingSpec, tiny_config, trim_logits

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    swa_num_attention_heads=2,
    swa_num_key_value_heads=1,
    swa_head_dim=12,
    d_rel=3,
    moe_intermediate_size=16,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=2,
    max_position_embeddings=256,
)
CASES: dict[str, dict[str, Any]] = {
    # every kind: sliding and global layers of different head layouts, dense and MoE, log scaling, padded head
    "mixed-padded-logscale": dict(
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        sliding_window_size=5,
        rel_extent=7,
        log_scaling_n_floor=4,
        log_scaling_alpha=0.3,
        unpadded_vocab_size=90,
        logits_mup_width_multiplier=3.0,
        route_scale=2.0,
    ),
    # global attention only, dense only, a 2-tap convolution, MQA
    "global-dense-conv2": dict(
        num_hidden_layers=2,
        layer_types=["hybrid", "hybrid"],
        mlp_layer_types=["dense", "dense"],
        num_key_value_heads=1,
        conv_kernel_size=2,
        rel_extent=3,
    ),
    # transformers' derivations: layer_types from local_layer_ids, mlp_layer_types from dense_mlp_idx, the
    # `dense_intermediate_size` spelling (then intermediate_size is the experts' width), `sconv_kernel_size`
    "derived-keys-top1": dict(
        num_hidden_layers=3,
        local_layer_ids=[0, 2],
        dense_mlp_idx=1,
        intermediate_size=16,
        dense_intermediate_size=40,
        moe_intermediate_size=None,
        sconv_kernel_size=3,
        sliding_window_size=8,
        rel_extent=11,
        num_experts_per_tok=1,
        n_shared_experts=1,
        n_routed_experts=4,
    ),
    # one-tap convolutions, window and extents past the sequence, equal head layouts, log scaling from the start
    "wide-window-conv1": dict(
        num_hidden_layers=3,
        layer_types=["hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=8,
        conv_kernel_size=1,
        sliding_window_size=64,
        rel_extent=64,
        log_scaling_n_floor=1,
        unpadded_vocab_size=VOCAB,
        num_experts_per_tok=3,
    ),
}


def _hf(case: str, seed: int = 0) -> Any:
    """A tiny transformers InklingForCausalLM, fp32, eager attention, every weight random (the scalar gains and
    the router's correction bias too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {k: v for k, v in {**BASE, **CASES[case]}.items() if v is not None}
    torch.manual_seed(seed)
    config = AutoConfig.for_model("inkling_text", **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("global_scale"):
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
    return model.eval()


def _ours(case: str, tmp_path: Path) -> tuple[Any, Any]:
    hf = _hf(case)
    hf.save_pretrained(tmp_path / "hf")
    return hf, load_pretrained(tmp_path / "hf")


def _fused_experts_saved() -> bool:
    """hf_io writes the routed experts fused, as transformers holds and saves them for this family (the hook
    `inkling.FUSED_EXPERTS`, which hf_io.hf_parts must honour: see the family's report)."""
    from miles_hpc.models.hf_io import hf_parts

    cfg = ModelConfig.from_hf_dict(tiny_config())
    return len(hf_parts(cfg, "model.layers.1.mlp.experts.down_proj", (8, 64, 32))) == 1


@pytest.mark.parametrize("case", list(CASES))
def test_inkling_matches_transformers_and_round_trips(case: str, tmp_path: Path) -> None:
    hf, ours = _ours(case, tmp_path)
    cfg = ours.config
    assert list(cfg.spec.layer_types) == list(hf.config.layer_types)
    assert list(cfg.spec.mlp_layer_types) == list(hf.config.mlp_layer_types)
    assert cfg.intermediate_size == hf.config.intermediate_size
    assert cfg.moe_intermediate_size == hf.config.moe_intermediate_size
    ids = input_ids(seq=40)  # longer than the windows and extents of most cases
    with torch.no_grad():
        ref = hf(ids).logits
        logits, routed = ours(ids, return_routed_experts=True)
    assert max_diff(trim_logits(cfg, logits), ref) < 1e-4
    if ours.num_moe_layers:
        assert torch.equal(routed.long(), _hf_routes(hf, ids))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    save_pretrained(ours, tmp_path / "ours")
    with torch.no_grad():  # our loader reads what we write
        assert max_diff(load_pretrained(tmp_path / "ours")(ids), logits) == 0.0
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "ours")(ids).logits, ref) == 0.0


@pytest.mark.parametrize("case", ["mixed-padded-logscale", "derived-keys-top1"])
def test_inkling_gradients_match_transformers(case: str, tmp_path: Path) -> None:
    hf, ours = _ours(case, tmp_path)
    ids, targets = input_ids(seq=24), input_ids(seq=24, seed=7) % 90
    for model, logits in ((hf, lambda m: m(ids).logits), (ours, lambda m: trim_logits(ours.config, m(ids)))):
        torch.nn.functional.cross_entropy(logits(model).flatten(0, 1), targets.flatten()).backward()
    mine = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        assert p.grad is not None, name
        assert max_diff(mine[name].grad, p.grad) <= 1e-4 * p.grad.abs().max().item() + 1e-7, name


def test_packed_sequences_share_nothing(tmp_path: Path) -> None:
    """Convolutions, relative logits, windows and log scaling all restart at each packed sequence."""
    _, ours = _ours("mixed-padded-logscale", tmp_path)
    check_packed_sequences(ours, tol=1e-5)


def test_routing_replay(tmp_path: Path) -> None:
    _, ours = _ours("mixed-padded-logscale", tmp_path)
    ids = input_ids(seq=30)
    n = ids.numel()
    with torch.no_grad():
        logits, routed = ours(ids, return_routed_experts=True)
        assert torch.equal(ours(ids, routing_replay=routed), logits)
        assert ours.replay_stats().tolist() == [n * ours.num_moe_layers] * 3
        partial = routed.clone()
        partial[:, ::3] = -1  # no record: the live choice
        assert torch.equal(ours(ids, routing_replay=partial), logits)
        unrecorded = ids[:, ::3].numel() * ours.num_moe_layers
        assert ours.replay_stats().tolist() == [n * ours.num_moe_layers - unrecorded] * 2 + [n * ours.num_moe_layers]
    other = (routed + 1) % ours.config.num_experts  # different experts: used, counted as disagreeing
    forced = ours(ids, routing_replay=other)
    assert max_diff(forced, logits) > 1e-3
    stats = ours.replay_stats()
    assert stats[0] == n * ours.num_moe_layers and stats[1] < stats[0]
    forced.float().pow(2).mean().backward()  # the gate weights at replayed ids stay differentiable
    assert ours.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def _raw(case: str = "mixed-padded-logscale") -> dict[str, Any]:
    return _hf(case).config.to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(layer_types=["hybrid"] * 3), "layer_types has 3 entries"),
        (dict(layer_types=["hybrid", "sliding", "hybrid", "hybrid"]), "layer_types: unknown entries"),
        (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), "mlp_layer_types: unknown entries"),
        (dict(swa_num_attention_heads=3, swa_num_key_value_heads=2), "swa_num_attention_heads=3 is not a multiple"),
        (dict(sliding_window_size=0), "sliding_window_size must be positive"),
        (dict(conv_kernel_size=0), "conv_kernel_size must be positive"),
        (dict(rel_extent=0), "rel_extent must be positive"),
        (dict(n_shared_experts=0), "n_shared_experts=0"),
        (dict(num_experts_per_tok=7), "num_experts_per_tok=7"),
        (dict(shared_expert_sink=False), "shared_expert_sink"),
        (dict(unpadded_vocab_size=VOCAB + 1), "unpadded_vocab_size"),
        (dict(log_scaling_n_floor=0), "log_scaling_n_floor"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_inkling_fields_are_checked(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict({**_raw(), **change})


def test_inkling_config_keys() -> None:
    """transformers' aliases and defaults; no tied head (transformers ties none, whatever the file says)."""
    raw = _raw()
    cfg = ModelConfig.from_hf_dict({**raw, "tie_word_embeddings": True, "sconv_kernel_size": 3})
    assert not cfg.tie_word_embeddings and cfg.spec.conv_kernel_size == 3
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        cfg.replace(tie_word_embeddings=True)
    minimal = ModelConfig.from_hf_dict({"model_type": "inkling_text", "num_hidden_layers": 12})
    assert minimal.spec.layer_types == ("hybrid_sliding",) * 5 + ("hybrid",) + ("hybrid_sliding",) * 5 + ("hybrid",)
    assert minimal.num_experts == 256 and minimal.n_shared_experts == 2 and minimal.spec.route_scale == 8.0
    assert (minimal.bos_token_id, minimal.eos_token_id) == (1, 2)
    assert isinstance(minimal.spec, InklingSpec) and hash(minimal)
    from transformers import AutoConfig

    back = AutoConfig.for_model(**cfg.to_hf_dict())
    assert type(back).__name__ == "InklingTextConfig" and back.conv_kernel_size == 3


def test_multimodal_config_names_its_text_model() -> None:
    """An InklingConfig (`inkling_mm_model`) carries the text model under `text_config`: parsed as that text model
    (families.WRAPPERS; its tensors: tests/test_models_inkling_release.py)."""
    from transformers import InklingConfig

    text = {k: v for k, v in _raw().items() if k != "architectures"}
    wrapped = InklingConfig(text_config=text).to_dict()
    alone = ModelConfig.from_hf_dict(wrapped["text_config"])
    assert alone == ModelConfig.from_hf_dict(_raw())
    assert ModelConfig.from_hf_dict(wrapped) == alone


def test_tiny_config_has_every_kind_and_loads_in_transformers(tmp_path: Path) -> None:
    from miles_hpc.models.hf_io import build_model

    cfg = ModelConfig.from_hf_dict(tiny_config())
    assert set(cfg.spec.layer_types) == {"hybrid", "hybrid_sliding"}
    assert set(cfg.spec.mlp_layer_types) == {"dense", "sparse"}
    torch.manual_seed(3)
    ours = build_model(cfg.replace(dtype=None))
    ids = input_ids(seq=40) % 500
    with torch.no_grad():
        logits = trim_logits(cfg, ours(ids))
    assert logits.shape[-1] == 500 and torch.isfinite(logits).all()
    save_pretrained(ours, tmp_path / "tiny")
    with torch.no_grad():
        assert max_diff(hf_load(tmp_path / "tiny")(ids).logits, logits) < 1e-5


def test_attention_in_query_chunks_equals_one_pass(tmp_path: Path) -> None:
    """Long sequences attend a chunk of queries at a time (bounded bias memory): same logits and gradients."""
    _, ours = _ours("mixed-padded-logscale", tmp_path)
    ids, cu = input_ids(batch=1, seq=40), torch.tensor([0, 13, 40])
    whole = ours(ids, cu_seqlens=cu)
    whole.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in ours.named_parameters() if p.grad is not None}
    ours.zero_grad()
    for layer in ours.model.layers:
        layer.self_attn.chunk = 6  # smaller than the window + chunk, not dividing the sequences
    chunked = ours(ids, cu_seqlens=cu)
    chunked.float().pow(2).mean().backward()
    assert max_diff(chunked, whole) < 1e-5
    for n, p in ours.named_parameters():
        if n in grads:
            assert max_diff(p.grad, grads[n]) <= 1e-5 * grads[n].abs().max().item() + 1e-8, n


# Incremental decode (InklingBackbone.new_state / run(states=...)): chunked feeding equals the one-shot forward.


@pytest.fixture
def one_thread() -> Any:
    """Hundreds of tiny forwards: one intra-op thread is ~20x faster than several on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_model(case: str, **changes: Any) -> Any:
    """Our model of a CASES config (with `changes`), fp32, every weight random; no checkpoint round trip."""
    from miles_hpc.models.hf_io import build_model

    model = build_model(ModelConfig.from_hf_dict({**_raw(case), **changes}), dtype=torch.float32)
    with torch.no_grad():
        randomize_(model, 3)
    return model.eval()


def _chunks(total: int, seed: int) -> list[int]:
    """A split of `total` tokens: prefill chunks of several sizes among 1-token decodes, in a random order."""
    g = torch.Generator().manual_seed(seed)
    sizes, left = [], total
    while left:
        n = min(left, (7, 1, 1, 5, 1, 13, 1, 2, 1, 3)[int(torch.randint(0, 10, (1,), generator=g))])
        sizes.append(n)
        left -= n
    return sizes


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_decode_equals_one_shot(case: str, one_thread: None) -> None:
    """Any split of a sequence (53 tokens: past every window and relative extent but wide-window-conv1's) into
    calls that continue a state gives the one-shot forward's logits and routed experts, row for row."""
    model = _random_model(case)
    total = 53
    ids = input_ids(batch=1, seq=total, seed=5)
    with torch.no_grad():
        full, routed = model(ids, return_routed_experts=True)
        for split in (_chunks(total, 0), _chunks(total, 1), [30] + [1] * (total - 30), [1] * 6 + [total - 6]):
            state, at = model.model.new_state(), 0
            for n in split:
                rows = slice(at, at + n)
                out, ids_out = model(
                    ids[:, rows], cu_seqlens=torch.tensor([0, n]), family_states=[state], return_routed_experts=True
                )
                assert max_diff(out, full[:, rows]) < 1e-5, (split, at)
                assert torch.equal(ids_out, routed[:, rows]), (split, at)
                at += n
                assert state.length == at


def test_packed_states_with_different_histories(one_thread: None) -> None:
    """Three sequences at different lengths (one fresh), packed in calls of 1 and several new tokens each, and a
    sequence with no new tokens in a call: each sequence's rows equal its own one-shot forward's. Attention runs 4
    query rows at a time here, so a chunk of new rows also starts past the cached keys."""
    model = _random_model("mixed-padded-logscale")
    for layer in model.model.layers:
        layer.self_attn.chunk = 4
    seqs = [input_ids(batch=1, seq=n, seed=s) for n, s in ((40, 11), (30, 12), (36, 13))]
    with torch.no_grad():
        full = [model(seq, return_routed_experts=True) for seq in seqs]
        states = [model.model.new_state() for _ in seqs]
        for state, seq, n in zip(states[:2], seqs[:2], (12, 19), strict=True):  # histories 12, 19 and 0 tokens
            model(seq[:, :n], family_states=[state])
        for news in ((1, 6, 1), (5, 1, 3), (1, 0, 1), (2, 1, 13), (1, 1, 1)):
            starts = [s.length for s in states]
            row = torch.cat([seq[:, a : a + n] for seq, a, n in zip(seqs, starts, news, strict=True)], dim=1)
            cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
            out, routed = model(row, cu_seqlens=cu, family_states=states, return_routed_experts=True)
            for i, (a, n) in enumerate(zip(starts, news, strict=True)):
                mine, ref = slice(int(cu[i]), int(cu[i + 1])), slice(a, a + n)
                assert states[i].length == a + n
                if not n:
                    continue
                assert max_diff(out[:, mine], full[i][0][:, ref]) < 1e-5, (news, i)
                assert torch.equal(routed[:, mine], full[i][1][:, ref]), (news, i)
        with pytest.raises(ValueError, match="states: 2 for 3 sequences"):
            model(row, cu_seqlens=cu, family_states=states[:2])


def test_sliding_state_stays_bounded(one_thread: None) -> None:
    """A sliding-only model's state stops growing once the window is full (window - 1 keys and values, K - 1
    convolution inputs per layer); a global layer's grows by one key and value per token."""
    sliding = _random_model("mixed-padded-logscale", layer_types=["hybrid_sliding"] * 4)
    mixed = _random_model("mixed-padded-logscale")
    ids = input_ids(batch=1, seq=30, seed=4)
    sizes: dict[str, list[int]] = {"sliding": [], "mixed": []}
    with torch.no_grad():
        for name, model in (("sliding", sliding), ("mixed", mixed)):
            state = model.model.new_state()
            for i in range(ids.shape[1]):
                model(ids[:, i : i + 1], family_states=[state])
                sizes[name].append(state.nbytes())
    cfg = sliding.config
    s = cfg.spec
    kv = 2 * (s.sliding_window_size - 1) * s.swa_num_key_value_heads * s.swa_head_dim
    conv = (s.conv_kernel_size - 1) * (2 * s.swa_num_key_value_heads * s.swa_head_dim + 2 * cfg.hidden_size)
    assert sizes["sliding"][s.sliding_window_size :] == [4 * (kv + conv) * 4] * (30 - s.sliding_window_size)
    global_kv = 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 2  # per token: k and v, fp32, two global layers
    assert [b - a for a, b in zip(sizes["mixed"][10:], sizes["mixed"][11:])] == [global_kv] * 19
