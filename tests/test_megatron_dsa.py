"""megatron-core backend for the DeepSeek sparse attention families, DeepSeek-V3.2 (`deepseek_v32`: the indexer in
every layer, its RoPE on halves) and GLM-5 (`glm_moe_dsa`: interleaved RoPE, GLM-5.2's full and shared indexer
layers): MLA + DSA (train/mcore_dsa.py) with GLM's router and the multi-token-prediction layer held in megatron's
MTP modules. The HF <-> megatron mapping (indexers on full layers only, the MTP layer) and its p2p boxes (pure),
megatron's `GPTModel` computing what our `CausalLM` computes at a context longer than index_topk (TP 1 and 2, EP 2),
`MegatronTrainer` stepping like `FSDPTrainer` (TP 2, EP 2, R3), and the indexers and MTP layer left untrained.

The model runs reuse tests/mcore_worker.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_megatron  # noqa: E402
from test_megatron import (  # noqa: E402
    LENGTHS,
    TRAIN_LENGTHS,
    _compare_step_with_fsdp,
    _compare_with_ours,
    assert_round_trip,
    run_fsdp_once,
    tiny_config,
)
from test_megatron import test_shard_boxes_hold_what_each_rank_holds as check_boxes  # noqa: E402
from test_megatron_mla import YARN  # noqa: E402
from test_train_fsdp import world  # noqa: E402,F401

from miles_hpc.models import build_model, save_pretrained  # noqa: E402
from miles_hpc.planner.mcore_layout import StageLayout  # noqa: E402
from miles_hpc.train.mcore_weights import is_frozen, mcore_rules  # noqa: E402

ARCHS = ("glm_moe_dsa", "deepseek_v32")
# All-dense variants for TP 2 without sequence parallelism (MoE under TP runs with it): decoder layers dense, and the
# MTP layer too (it follows first_k_dense_replace).
DENSE = {
    "glm_moe_dsa": {"mlp_layer_types": ["dense"] * 4, "first_k_dense_replace": 5},
    "deepseek_v32": {"first_k_dense_replace": 4},
}
TOPK = {"index_topk": 6}  # well below the packed sequences (7, 12, 25 tokens): most queries see a subset
# eps far from the latent / k_norm's fixed 1e-6: megatron's default (layernorm_epsilon) there would show
BIG_EPS = {"rms_norm_eps": 0.05}
MTP = {"num_nextn_predict_layers": 1}  # DeepSeek-V3 with its release's MTP layer (the tiny preset has none)


def test_contexts_exceed_index_topk() -> None:
    """The comparisons below run sequences longer than index_topk, so the top-k selection drops keys."""
    for arch in ARCHS:
        assert max(LENGTHS) > tiny_config(arch).index_topk and max(TRAIN_LENGTHS) > tiny_config(arch).index_topk


# ---------------------------------------------------------------- mapping (pure)
@pytest.mark.parametrize("arch,overrides", [(a, {}) for a in ARCHS] + [("deepseek_v3", MTP)])
@pytest.mark.parametrize("tp", [1, 2])
def test_dsa_mapping_round_trips(arch: str, overrides: dict, tp: int) -> None:
    """Every HF tensor (indexers, the MTP layer included; DeepSeek-V3's MTP layer too) has one megatron home and
    comes back bit for bit."""
    assert_round_trip(tiny_config(arch, **overrides), tp)


def test_indexers_on_full_layers_and_mtp_mapped() -> None:
    cfg = tiny_config("glm_moe_dsa")  # indexer_types full, shared, full, shared; one MTP layer (layer 4)
    rules = mcore_rules(cfg)
    indexed = sorted({r.mcore.split(".self_attention.")[0] for r in rules if ".core_attention.indexer." in r.mcore})
    assert indexed == ["decoder.layers.0", "decoder.layers.2", "mtp.layers.0.transformer_layer"]
    by_hf = {n: r for r in rules for n in r.hf}
    assert by_hf["model.layers.4.eh_proj.weight"].mcore == "mtp.layers.0.eh_proj.weight"
    assert by_hf["model.layers.4.shared_head.norm.weight"].mcore == "mtp.layers.0.final_layernorm.weight"
    assert by_hf["model.layers.4.mlp.experts.3.down_proj.weight"].mcore == (
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2.weight"
    )
    frozen = {r.mcore for r in rules if is_frozen(r.mcore)}
    assert all(".indexer." in n or n.startswith("mtp.") for n in frozen)
    assert len(frozen) == 2 * 5 + sum(r.mcore.startswith("mtp.") for r in rules)  # 2 decoder indexers, MTP


@pytest.mark.parametrize("arch,tp,ep", [("glm_moe_dsa", 2, 1), ("glm_moe_dsa", 1, 2), ("deepseek_v32", 2, 2)])
def test_dsa_shard_boxes_hold_what_each_rank_holds(arch: str, tp: int, ep: int) -> None:
    check_boxes(arch, {}, tp, ep)


def test_indexer_selects_in_row_chunks_as_whole(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The megatron indexer scores a sequence's queries in chunks of rows (the float32 scores bounded by
    INDEXER_SCORE_ELEMENTS): one row at a time it selects what the whole sequence at once does, wherever the
    top-k is not a near tie (the matmul's shape may round differently), and the same shape [b, T, K]."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    from miles_hpc.train import mcore_cpu, mcore_dsa, mcore_model

    mcore_cpu.enable()
    mcore_model.init_model_parallel(1, 1)
    try:
        torch.manual_seed(0)
        cfg = tiny_config("glm_moe_dsa", index_topk=4)
        model = mcore_model.build_gpt(cfg)
        indexer = model.decoder.layers[0].self_attention.core_attention.indexer
        spans = [(0, 9), (9, 30), (30, 33)]
        x, qr = torch.randn(33, 1, cfg.hidden_size), torch.randn(33, 1, cfg.q_lora_rank)
        whole = indexer.select(x, qr, spans)
        monkeypatch.setattr(mcore_dsa, "INDEXER_SCORE_ELEMENTS", 1)  # one query row per chunk
        rows = indexer.select(x, qr, spans)
        assert rows.shape == whole.shape == (1, 33, 4)
        q, k, w = indexer._project(x, qr)
        clear = 0
        for s, e in spans:
            scores = indexer._compute_index_scores(q[s:e], w[s:e], k[s:e])[0]
            scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
            for i in range(e - s):
                ranked = scores[i, : i + 1].sort(descending=True).values  # the keys row i sees
                n = min(4, i + 1)
                if n < i + 1 and (ranked[n - 1] - ranked[n]).abs() < 1e-4:
                    continue  # a near tie: either pick is right
                clear += 1
                seen = [{p for p in picks[0, s + i].tolist() if p <= s + i} for picks in (rows, whole)]
                assert seen[0] == seen[1] and len(seen[0]) == n, (s, i, seen)
        assert clear > 20
    finally:
        parallel_state.destroy_model_parallel()


def test_pipeline_stage_starting_with_a_shared_layer_is_refused() -> None:
    pytest.importorskip("megatron.core")
    from miles_hpc.train.mcore_dsa import check_dsa_pipeline

    small = {"num_hidden_layers": 6, "indexer_types": ["full", "full", "shared", "shared", "full", "shared"]}
    cfg = tiny_config("glm_moe_dsa", **small, mlp_layer_types=["dense"] + ["sparse"] * 5)
    with pytest.raises(NotImplementedError, match=r"indexer_types\[3\] is 'shared' and starts stage 1"):
        check_dsa_pipeline(cfg, StageLayout(2, 6))
    check_dsa_pipeline(cfg, StageLayout(1, 6))
    check_dsa_pipeline(tiny_config("glm_moe_dsa"), StageLayout(2, 4))  # stage 1 starts at layer 2, a full one
    # 12 layers: the stages of PP 3 start at layers 4 and 8 (full); its virtual chunks of 2 layers at 2 (shared) too
    twelve = {"num_hidden_layers": 12, "indexer_types": ["full", "full", "shared", "full"] * 3}
    cfg = tiny_config("glm_moe_dsa", **twelve, mlp_layer_types=["dense"] + ["sparse"] * 11)
    check_dsa_pipeline(cfg, StageLayout(3, 12))
    with pytest.raises(
        NotImplementedError, match=r"indexer_types\[2\] is 'shared' and starts stage 1's virtual chunk 0"
    ):
        check_dsa_pipeline(cfg, StageLayout(3, 12, vpp=2))


# ---------------------------------------------------------------- megatron's model on our weights
@pytest.mark.parametrize(
    "arch,overrides,tp,ep",
    [
        ("glm_moe_dsa", {}, 1, 1),
        ("glm_moe_dsa", {**TOPK, **BIG_EPS}, 1, 2),
        ("glm_moe_dsa", {**DENSE["glm_moe_dsa"], **TOPK}, 2, 1),
        ("deepseek_v32", TOPK, 1, 2),
        ("deepseek_v32", {**TOPK, **YARN}, 1, 1),
        ("deepseek_v32", {**DENSE["deepseek_v32"], **BIG_EPS}, 2, 1),
        ("glm_moe_dsa", TOPK, 2, 1),
        ("deepseek_v32", {**TOPK, **BIG_EPS}, 2, 2),
    ],
)
@pytest.mark.process
def test_megatron_dsa_matches_ours(arch: str, overrides: dict, tp: int, ep: int, tmp_path: Path) -> None:
    """Same logits, loss and HF-named gradients as our CausalLM (fp32, packed sequences, random router correction
    bias), no gradient for the indexers and the MTP layer, and the weights gathered back bit for bit; DeepSeek-V3.2
    also with yarn RoPE (as its release has it), which its indexer's RoPE shares with MLA."""
    _compare_with_ours(tiny_config(arch, **overrides), tp, tmp_path, "cpu", atol=2e-5, ep=ep)


@pytest.mark.gpu
def test_megatron_dsa_matches_ours_gpu(tmp_path: Path) -> None:
    """The same on a GPU (NCCL, megatron's CUDA buffers, no CPU shims): GLM-5 tiny, EP 1."""
    _compare_with_ours(tiny_config("glm_moe_dsa", **TOPK), 1, tmp_path, "cuda", atol=1e-4)


@pytest.mark.process
def test_mla_latent_norms_take_transformers_eps(tmp_path: Path) -> None:
    """DeepSeek-V3 (with an MTP layer, held) and rms_norm_eps far from 1e-6: the latent norms keep transformers'
    1e-6 (megatron would build them with rms_norm_eps)."""
    _compare_with_ours(tiny_config("deepseek_v3", **BIG_EPS, **MTP), 1, tmp_path, "cpu", atol=2e-5, ep=2)


# ---------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def tiny_dsa_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_dsa")
    out = {}
    for arch in ARCHS:
        for name, overrides in ((arch, TOPK), (f"{arch}-dense", {**DENSE[arch], **TOPK})):
            torch.manual_seed(0)
            save_pretrained(build_model(tiny_config(arch, **overrides)), root / name)
            out[name] = root / name
    return out


@pytest.mark.parametrize(
    "model,world_size,tp,ep,pp",
    [
        ("glm_moe_dsa-dense", 2, 2, 1, 1),
        ("glm_moe_dsa", 2, 1, 2, 1),
        ("deepseek_v32-dense", 2, 2, 1, 1),
        ("deepseek_v32", 2, 1, 2, 1),
        ("glm_moe_dsa", 2, 1, 1, 2),
        ("glm_moe_dsa", 4, 2, 2, 1),
    ],
)
@pytest.mark.process
def test_dsa_trainer_step_equals_fsdp(
    world: None,
    tiny_dsa_models: dict[str, Path],
    tmp_path: Path,
    model: str,
    world_size: int,
    tp: int,
    ep: int,
    pp: int,
) -> None:
    """MegatronTrainer and FSDPTrainer (one rank) on the same batch and weights: the same log-probs, step metrics
    and weights after two mini-batches, the indexers and the MTP layer unchanged in both. TP 2 on the all-dense
    variants, EP 2 on the MoE ones, TP 2 x EP 2 on GLM-5's (sequence parallelism: each TP rank's indexers score the
    whole row); PP 2 on GLM-5 (stage 1 starts with a full indexer layer; the MTP layer on the last stage)."""
    _compare_step_with_fsdp(tiny_dsa_models[model], tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, pp=pp)


@pytest.mark.parametrize(
    "model,tp,ep,mode",
    [
        ("glm_moe_dsa-dense", 2, 1, "sparse"),
        ("deepseek_v32", 1, 2, "sparse"),
        ("glm_moe_dsa", 1, 2, "dense"),
        ("glm_moe_dsa", 2, 1, "sparse"),
    ],
)
@pytest.mark.process
def test_indexer_loss_step_equals_fsdp(
    world: None,
    tiny_dsa_models: dict[str, Path],
    tmp_path: Path,
    model: str,
    tp: int,
    ep: int,
    mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """train.indexer_loss_coef on both backends (megatron's compute_dsa_indexer_loss, ours): the same step, the
    indexers trained alike (every indexer tensor changed, equal in both), the same dsa/indexer_kl; GLM-5's MoE at
    TP 2 too, where the indexers, replicated over TP, train on the whole row gathered from the sequence chunks."""
    monkeypatch.setenv("MCORE_INDEXER_MODE", mode)  # train.indexer_loss, for the workers and the FSDP reference
    m = _compare_step_with_fsdp(
        tiny_dsa_models[model], tmp_path, 2, tp, False, "cpu", atol=1e-5, ep=ep, indexer_loss=1.0
    )
    assert m["dsa/indexer_kl"] > 0


@pytest.mark.parametrize("arch,world_size,tp", [(a, 2, 1) for a in ARCHS] + [("deepseek_v32", 4, 2)])
@pytest.mark.process
def test_dsa_r3_replays_recorded_experts_like_fsdp(
    world: None, tiny_dsa_models: dict[str, Path], tmp_path: Path, arch: str, world_size: int, tp: int
) -> None:
    """R3 on the DSA families' MoE layers at EP 2, and at TP 2 x EP 2 (each TP rank replays the records of its chunk
    of the tokens): the same step, coverage and agreement as FSDP's."""
    metrics = _compare_step_with_fsdp(
        tiny_dsa_models[arch], tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=2, r3=True
    )
    ref = run_fsdp_once(str(tiny_dsa_models[arch]), r3=True)["metrics"]
    for key in ("r3/coverage", "r3/topk_agreement"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-9), key
    assert metrics["r3/topk_agreement"] < 0.5


@pytest.mark.parametrize(
    "model,world_size,tp,ep,pp,r3,indexer_loss",
    [
        ("glm_moe_dsa", 2, 2, 1, 1, True, 0.0),
        ("deepseek_v32", 2, 1, 2, 1, False, 1.0),
        ("glm_moe_dsa", 2, 1, 1, 2, False, 0.0),
    ],
)
@pytest.mark.process
def test_dsa_activation_recompute_trains_the_same(
    world: None,
    tiny_dsa_models: dict[str, Path],
    tmp_path: Path,
    model: str,
    world_size: int,
    tp: int,
    ep: int,
    pp: int,
    r3: bool,
    indexer_loss: float,
) -> None:
    """Full activation recompute on the DSA families: GLM-5's shared layers (1 and 3) recomputed in backward, after
    their full layer's forward and before its recompute, use the selection of their own micro-batch's forward, so
    the step equals FSDP's: under TP 2 with sequence parallelism and R3, with the indexer loss (computed once, in
    the checkpointed forward) at EP 2, and at PP 2, where the 1F1B schedule runs a micro-batch's forward before the
    previous one's backward."""
    m = _compare_step_with_fsdp(
        tiny_dsa_models[model],
        tmp_path,
        world_size,
        tp,
        False,
        "cpu",
        atol=1e-5,
        ep=ep,
        pp=pp,
        r3=r3,
        indexer_loss=indexer_loss,
        recompute="full",
    )
    if indexer_loss:
        assert m["dsa/indexer_kl"] > 0


@pytest.mark.parametrize(
    "model,world_size,tp,ep,r3,recompute",
    [
        ("glm_moe_dsa", 2, 1, 1, True, None),
        ("glm_moe_dsa", 4, 2, 1, False, "full"),  # CP 2 x TP 2 (sequence parallelism), recomputed
        ("deepseek_v32", 4, 1, 2, True, None),  # CP 2 x EP 2, yarn-free RoPE on halves
    ],
)
@pytest.mark.process
def test_dsa_context_parallel_step_equals_fsdp(
    world: None,
    tiny_dsa_models: dict[str, Path],
    tmp_path: Path,
    model: str,
    world_size: int,
    tp: int,
    ep: int,
    r3: bool,
    recompute: str | None,
) -> None:
    """CP 2 on the DSA families: each full layer's indexer selects over the whole row (its inputs gathered over the
    CP ranks, its RoPE unsliced), each rank attends its queries over the gathered keys (GLM-5's shared layers too);
    the same step as FSDP's, with R3, under TP 2 with recompute, and at EP 2."""
    _compare_step_with_fsdp(
        tiny_dsa_models[model],
        tmp_path,
        world_size,
        tp,
        False,
        "cpu",
        atol=1e-5,
        ep=ep,
        r3=r3,
        cp=2,
        recompute=recompute,
    )


@pytest.mark.gpu
def test_tiny_glm5_loop_with_megatron_on_one_gpu(tmp_path: Path) -> None:
    """`miles-hpc run` with the megatron trainer on GLM-5 tiny (MLA + DSA, R3, the indexer loss) on GPU 0, in a
    plain run without the test suite's megatron shims (megatron-core 0.16's TE-less MLA failed to build there, the
    indexer's LayerNorm refused bf16 inputs, the distributed optimizer saved the mixed fp32/bf16 groups' states
    under other parameters' places: all three fixed), then resumed from its checkpoint. On the GPU the engine's and
    the trainer's routers differ on near ties, so R3's agreement is high but not 1."""
    import json

    run_dir = tmp_path / "run"
    extra = ("model.init_arch=glm_moe_dsa", "algo.routing_replay=true", "train.indexer_loss_coef=1.0")
    proc = test_megatron._megatron_run(run_dir, 2, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [0, 1]
    assert all(r["dsa/indexer_kl"] > 0 and r["r3/coverage"] > 0.5 and r["r3/topk_agreement"] > 0.9 for r in m), m
    assert json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())["backend"] == "megatron"
    proc = test_megatron._megatron_run(run_dir, 3, *extra)
    assert proc.returncode == 0 and "resumed from" in proc.stdout + proc.stderr, proc.stderr[-3000:]


def test_mtp_loss_is_refused() -> None:
    """The MTP layers are held, not trained, by this backend: train.mtp_loss_coef says so (before any process
    group or checkpoint is touched)."""
    pytest.importorskip("megatron.core")
    from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
    from miles_hpc.train.megatron import MegatronTrainer

    with pytest.raises(NotImplementedError, match=r"train.mtp_loss_coef=0.1.*train.backend=fsdp"):
        MegatronTrainer("unused", TrainConfig(mtp_loss_coef=0.1), AlgoConfig(), MegatronConfig(), device="cpu", seed=0)
