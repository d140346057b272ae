"""megatron-core backend for the DeepSeek-V3 family (Kimi-K2 too): multi-latent attention (MLA) with the router and
shared experts of GLM-4.5 (train/mcore_weights.py, train/megatron.py). The HF <-> megatron mapping of MLA's
projections and its p2p boxes (pure), megatron's `GPTModel` computing what our `CausalLM` computes (q LoRA or not,
RoPE on interleaved pairs or halves, plain or yarn RoPE; TP 1 and 2, EP 2), and `MegatronTrainer` stepping like
`FSDPTrainer`.

The model runs reuse tests/mcore_worker.py (megatron-core 0.16's MLA needs one more test-only patch, in
conftest.megatron_cpu_shims).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_megatron import _compare_step_with_fsdp, _compare_with_ours, assert_round_trip, tiny_config  # noqa: E402
from test_megatron import test_shard_boxes_hold_what_each_rank_holds as check_boxes  # noqa: E402
from test_train_fsdp import world  # noqa: E402,F401

from miles_hpc.models import build_model, iter_hf_tensors, save_pretrained  # noqa: E402
from miles_hpc.train.mcore_weights import from_mcore, mcore_rules, to_mcore  # noqa: E402

ARCH = "deepseek_v3"
DENSE = {"first_k_dense_replace": 2}  # both tiny layers dense: MLA alone, without sequence parallelism
NO_Q_LORA = {"q_lora_rank": None}  # one q_proj (DeepSeek-V2-Lite style) instead of q_a/q_b
HALVES = {"rope_interleave": False}  # RoPE rotates halves, not interleaved pairs
# yarn as DeepSeek-V3/Kimi-K2 have it, with mscale != mscale_all_dim so both of megatron's factors are checked, and
# without mscale_all_dim (cos/sin scaled by mscale(factor), softmax unscaled); original_max_position_embeddings
# small enough that the ramp reaches the tiny rotary dims
YARN = {
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.9,
        "mscale_all_dim": 0.7,
    }
}
YARN_PLAIN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}}


# ---------------------------------------------------------------- mapping (pure)
@pytest.mark.parametrize("overrides", [{}, NO_Q_LORA, HALVES, {**NO_Q_LORA, **HALVES}])
@pytest.mark.parametrize("tp", [1, 2])
def test_mla_mapping_round_trips(overrides: dict, tp: int) -> None:
    assert_round_trip(tiny_config(ARCH, **overrides), tp)


def test_mla_layout_follows_megatron() -> None:
    """Rows per TP rank, whole heads of q (tiny: 4 heads of nope 16 + rope 8); kv_a's rotary rows interleaved for
    rope_interleave=False (megatron row 2i = HF row i, 2i+1 = HF row d/2 + i), as they are otherwise."""
    cfg = tiny_config(ARCH, **HALVES)
    hf = {k: v.clone() for k, v in iter_hf_tensors(build_model(cfg))}
    rules = {r.mcore: r for r in mcore_rules(cfg)}
    att, mc = "model.layers.0.self_attn.", "decoder.layers.0.self_attention."
    q_up = to_mcore(rules[mc + "linear_q_up_proj.weight"], hf, cfg, 1, 2)  # rank 1: heads 2 and 3
    head = hf[att + "q_b_proj.weight"][2 * 24 : 3 * 24]
    assert torch.equal(q_up[:16], head[:16])  # the nope part as it is
    assert torch.equal(q_up[16:24:2], head[16:20]) and torch.equal(q_up[17:24:2], head[20:24])
    kv_a = hf[att + "kv_a_proj_with_mqa.weight"]  # 32 latent rows, then 8 rotary rows
    kv_down = to_mcore(rules[mc + "linear_kv_down_proj.weight"], hf, cfg, 1, 2)  # rows 20..39
    assert torch.equal(kv_down[:12], kv_a[20:32])
    assert torch.equal(kv_down[12::2], kv_a[32:36]) and torch.equal(kv_down[13::2], kv_a[36:40])
    interleaved = tiny_config(ARCH)
    rule = next(r for r in mcore_rules(interleaved) if r.mcore == mc + "linear_kv_down_proj.weight")
    assert torch.equal(to_mcore(rule, hf, interleaved, 1, 2), kv_a[20:])
    assert torch.equal(from_mcore(rule, [to_mcore(rule, hf, cfg, r, 2) for r in range(2)], cfg)[rule.hf[0]], kv_a)


def test_mla_rotary_rows_must_stay_on_one_rank() -> None:
    cfg = tiny_config(ARCH, **HALVES)  # kv_a: 40 rows; at TP 8 the rotary rows 32..39 span ranks 6 and 7
    rule = next(r for r in mcore_rules(cfg) if r.mcore.endswith("linear_kv_down_proj.weight"))
    hf = dict(iter_hf_tensors(build_model(cfg)))
    with pytest.raises(NotImplementedError, match="rope_interleave=False.*straddle"):
        to_mcore(rule, hf, cfg, 0, 8)
    to_mcore(rule, hf, tiny_config(ARCH), 0, 8)  # interleaved: rows as they are, any split


@pytest.mark.parametrize(
    "overrides,tp,ep", [({}, 1, 2), ({}, 2, 1), ({**NO_Q_LORA, **HALVES}, 2, 1), ({**HALVES, **DENSE}, 2, 2)]
)
def test_mla_shard_boxes_hold_what_each_rank_holds(overrides: dict, tp: int, ep: int) -> None:
    """test_megatron's generic p2p box check on MLA's rules (the rotary reordering included)."""
    check_boxes(ARCH, overrides, tp, ep)


def test_mla_attention_bias_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="attention_bias"):
        mcore_rules(tiny_config(ARCH, attention_bias=True))


# ---------------------------------------------------------------- megatron's model on our weights
@pytest.mark.parametrize(
    "overrides,tp,ep",
    [
        ({}, 1, 1),
        ({}, 1, 2),
        (NO_Q_LORA, 1, 1),
        (HALVES, 1, 1),
        (YARN, 1, 1),
        (YARN_PLAIN, 1, 1),
        (DENSE, 2, 1),
        ({**DENSE, **NO_Q_LORA, **HALVES}, 2, 1),
        ({**DENSE, **YARN}, 2, 1),
        ({}, 2, 1),
        ({**NO_Q_LORA, **YARN}, 2, 2),
    ],
)
@pytest.mark.process
def test_megatron_mla_matches_ours(overrides: dict, tp: int, ep: int, tmp_path: Path) -> None:
    """Same logits, loss and HF-named gradients as our CausalLM (fp32, packed sequences, random router correction
    bias) and the weights gathered back bit for bit: MLA with and without q LoRA, both RoPE layouts, plain and yarn
    RoPE; TP 2 on the all-dense variant (MLA split by heads) and on the MoE one (sequence parallelism: the latent
    norms, the rotary key and the experts see each rank's chunk of the tokens), alone and with EP 2."""
    _compare_with_ours(tiny_config(ARCH, **overrides), tp, tmp_path, "cpu", atol=2e-5, ep=ep)


@pytest.mark.gpu
def test_megatron_mla_matches_ours_gpu(tmp_path: Path) -> None:
    """The same on a GPU (NCCL, megatron's CUDA buffers, no CPU shims): MLA with q LoRA and yarn, MoE layer."""
    _compare_with_ours(tiny_config(ARCH, **YARN), 1, tmp_path, "cuda", atol=1e-4)


def test_mla_unmapped_rope_scaling_says_so() -> None:
    pytest.importorskip("megatron.core")
    from miles_hpc.train.mcore_mla import mla_kwargs

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    with pytest.raises(NotImplementedError, match="llama3"):
        mla_kwargs(tiny_config(ARCH, rope_scaling=llama3))
    with pytest.raises(NotImplementedError, match="attention_factor"):
        mla_kwargs(tiny_config(ARCH, rope_scaling={**YARN["rope_scaling"], "attention_factor": 1.2}))
    with pytest.raises(NotImplementedError, match="truncate"):
        mla_kwargs(tiny_config(ARCH, rope_scaling={**YARN["rope_scaling"], "truncate": False}))
    kw = mla_kwargs(tiny_config(ARCH, **YARN_PLAIN))  # cos/sin by mscale(4, 1) / mscale(4, 0), softmax as is
    assert (kw["rope_type"], kw["mscale"], kw["mscale_all_dim"]) == ("yarn", 1.0, 0.0)


# ---------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def tiny_mla_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from miles_hpc.models.presets import init_model

    root = tmp_path_factory.mktemp("tiny_mla")
    torch.manual_seed(0)
    save_pretrained(build_model(tiny_config(ARCH, **DENSE)), root / "dense")
    return {"moe": init_model(ARCH, "tiny", root / "moe"), "dense": root / "dense"}


@pytest.mark.parametrize(
    "world_size,tp,ep,model", [(1, 1, 1, "moe"), (2, 1, 2, "moe"), (2, 2, 1, "dense"), (4, 2, 2, "moe")]
)
@pytest.mark.process
def test_mla_trainer_step_equals_fsdp(
    world: None, tiny_mla_models: dict[str, Path], tmp_path: Path, world_size: int, tp: int, ep: int, model: str
) -> None:
    """MegatronTrainer and FSDPTrainer (one rank) on the same batch and DeepSeek-V3 weights: the same log-probs,
    step metrics and weights after two mini-batches (test_megatron's check), on one rank, with the experts split
    over two ranks, with MLA split over two TP ranks, and the MoE model at TP 2 x EP 2 (sequence parallelism)."""
    _compare_step_with_fsdp(tiny_mla_models[model], tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep)


@pytest.mark.parametrize("world_size,tp,cp", [(2, 1, 2), (4, 2, 2)])
@pytest.mark.process
def test_mla_context_parallel_step_equals_fsdp(
    world: None, tiny_mla_models: dict[str, Path], tmp_path: Path, world_size: int, tp: int, cp: int
) -> None:
    """DeepSeek-V3's MoE at CP 2, and CP 2 x TP 2 (sequence parallelism within each share), R3 on: MLA's core
    attention replaced by the CP one (its own softmax scale, v head width), the rotary key sliced per CP rank by
    megatron's MLA; the same step as FSDP's."""
    _compare_step_with_fsdp(tiny_mla_models["moe"], tmp_path, world_size, tp, False, "cpu", atol=1e-5, r3=True, cp=cp)


@pytest.mark.parametrize("granularity", ["full", "selective"])
@pytest.mark.process
def test_mla_activation_recompute_trains_the_same(
    world: None, tiny_mla_models: dict[str, Path], tmp_path: Path, granularity: str
) -> None:
    """Megatron's full and selective (core attention) recompute on DeepSeek-V3's MoE at TP 2 (sequence
    parallelism), R3 on: the same step as FSDP's."""
    _compare_step_with_fsdp(
        tiny_mla_models["moe"], tmp_path, 2, 2, False, "cpu", atol=1e-5, r3=True, recompute=granularity
    )


@pytest.mark.gpu
def test_mla_trainer_step_equals_fsdp_gpu(world: None, tiny_mla_models: dict[str, Path], tmp_path: Path) -> None:
    """On a GPU megatron's own optimizer steps (fp32): the same step as the FSDP backend's on the CPU."""
    _compare_step_with_fsdp(tiny_mla_models["moe"], tmp_path, 1, 1, False, "cuda", atol=1e-4)
