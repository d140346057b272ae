"""Virtual pipeline stages (`megatron.virtual_pipeline`, megatron's interleaved schedule): the chunk layout and the
schedule's grouping as pure functions checked against megatron-core's own, and the trainer's step on CPU/gloo
equal to FSDP's (tests/mcore_worker.py under MCORE_PP / MCORE_VPP)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_hpc.config.loader import ConfigError
from miles_hpc.config.megatron import MegatronConfig
from miles_hpc.models import build_model, save_pretrained
from miles_hpc.planner.layouts import Batch, Layout, MemoryOptions, layout_problems, rank_elements, rank_memory
from miles_hpc.planner.mcore_layout import StageLayout

sys.path.insert(0, str(Path(__file__).parent))
from conftest import has_megatron, require  # noqa: E402
from test_megatron import _compare_step_with_fsdp, run_fsdp_once, tiny_config  # noqa: E402
from test_train_fsdp import world  # noqa: E402,F401

MEGATRON = has_megatron()


# ---------------------------------------------------------------- pure layouts
SHAPES = [(p, v, p * v * k) for p in (3, 4, 8) for v in (2, 3, 4) for k in (1, 2, 3)]


@pytest.mark.parametrize("pp,vpp,layers", SHAPES)
def test_chunks_hold_megatrons_layers(pp: int, vpp: int, layers: int) -> None:
    """Every decoder layer is in exactly one chunk, at the offset megatron-core gives that chunk
    (`get_transformer_layer_offset`), under its local name; the embedding on stage 0's first chunk, the final norm
    and output layer on the last stage's last chunk, a tied embedding's copy there too."""
    require(MEGATRON, "megatron-core (the megatron extra)")
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    layout = StageLayout(pp, layers, tied_embeddings=True, vpp=vpp)
    mcfg = SimpleNamespace(
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers=layers,
        num_layers_in_first_pipeline_stage=None,
        num_layers_in_last_pipeline_stage=None,
        pipeline_model_parallel_layout=None,
        account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False,
    )
    seen = []
    for stage, chunk in itertools.product(range(pp), range(vpp)):
        offset = get_transformer_layer_offset(mcfg, vp_stage=chunk, pp_rank=stage)
        for local in range(layout.per_chunk):
            i = layout.layer_index(stage, local, chunk)
            assert i == offset + local
            name = f"decoder.layers.{i}.mlp.linear_fc1.weight"
            assert layout.place_of(name) == (stage, chunk)
            assert layout.copies(name, stage) == [(chunk, f"decoder.layers.{local}.mlp.linear_fc1.weight")]
            assert all(layout.copies(name, s) == [] for s in range(pp) if s != stage)
            seen.append(i)
    assert sorted(seen) == list(range(layers))
    assert layout.copies("embedding.word_embeddings.weight", 0) == [(0, "embedding.word_embeddings.weight")]
    assert layout.copies("embedding.word_embeddings.weight", pp - 1) == [(vpp - 1, "output_layer.weight")]
    assert layout.place_of("decoder.final_layernorm.weight") == (pp - 1, vpp - 1)
    assert layout.chunk_starts() == [c * layout.per_chunk for c in range(1, pp * vpp)]
    # the planner's view of a stage is the same set of layers
    plan = Layout(pp=pp, vpp=vpp, dp=1)
    for stage in range(pp):
        mine = {layout.layer_index(stage, k, c) for c in range(vpp) for k in range(layout.per_chunk)}
        assert set(plan.stage_layers(layers, stage)) == mine


def test_layouts_that_cannot_be_chunked_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pipeline_parallel=3 x megatron.virtual_pipeline=2 does not divide"):
        StageLayout(3, 8, vpp=2)
    for pp in (1, 2):  # at 2 stages megatron-core's interleaved schedule crosses the two ranks' messages
        with pytest.raises(ValueError, match=r"virtual_pipeline=2 needs megatron.pipeline_parallel >= 3"):
            StageLayout(pp, 4, vpp=2)
        with pytest.raises(ConfigError, match=r"virtual_pipeline"):
            MegatronConfig(pipeline_parallel=pp, virtual_pipeline=2)
    with pytest.raises(ConfigError, match=r"virtual_pipeline"):
        MegatronConfig(pipeline_parallel=3, virtual_pipeline=0)
    MegatronConfig(pipeline_parallel=3, virtual_pipeline=2)
    assert Layout(pp=2, vpp=2).world == 2
    assert "VPP 2 needs PP >= 3" in " ".join(layout_problems(tiny_config("qwen3").to_hf_dict(), Layout(pp=2, vpp=2)))


@pytest.mark.parametrize("pp", [3, 4, 8])
def test_interleaved_micro_batches_are_groups_of_the_stages(pp: int) -> None:
    """The interleaved schedule runs a multiple of PP micro-batches (megatron's default grouping), at least ours
    and 2 PP, fewer than PP more than ours above 2 PP; then no stage has all its chunk forwards in the warm-up
    (megatron's `get_pp_rank_microbatches`) for any number of virtual stages."""
    require(MEGATRON, "megatron-core (the megatron extra)")
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    from miles_hpc.train.mcore_pipeline import interleaved_count

    for m in range(1, 6 * pp + 1):
        n = interleaved_count(m, pp)
        assert n % pp == 0 and n >= max(m, 2 * pp)
        assert n < m + pp or n == 2 * pp
        for vpp, stage in itertools.product((2, 3, 4), range(pp)):
            group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
            comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
            _, all_in_warmup, _, remaining = get_pp_rank_microbatches(n, vpp, pp, p2p_communicator=comm)
            assert not all_in_warmup and remaining > 0


@pytest.mark.parametrize("pp,vpp", [(2, 1), (3, 2), (4, 2), (4, 3), (8, 4)])
def test_planner_counts_megatrons_warmup(pp: int, vpp: int) -> None:
    """The chunk forwards a stage holds at the peak (`Layout.chunks_in_flight`) are megatron's warm-up plus the one
    of the first 1F1B step (`get_pp_rank_microbatches`, enough micro-batches); with virtual stages stage 0 holds
    (1 + (PP - 1) / (PP VPP)) times the activations of 1F1B (the planner's figure for a model of equal layers)."""
    require(MEGATRON, "megatron-core (the megatron extra)")
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    layout = Layout(pp=pp, vpp=vpp, dp=1)
    for stage in range(pp):
        group = SimpleNamespace(size=lambda: pp, rank=lambda s=stage: s)
        comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
        _, _, warmup, _ = get_pp_rank_microbatches(8 * pp, vpp, pp, p2p_communicator=comm)
        assert layout.chunks_in_flight(stage) == warmup + 1
    cfg = {**json.loads(json.dumps(tiny_config("qwen3", num_hidden_layers=pp * vpp * 2).to_hf_dict()))}
    opts, batch = MemoryOptions(mixed_precision=False), Batch(seq_len=64)
    flat = rank_memory(cfg, Layout(pp=pp, dp=1), opts, batch)
    inter = rank_memory(cfg, layout, opts, batch)
    assert inter.activation_terms["layers"] == pytest.approx(
        flat.activation_terms["layers"] * (1 + (pp - 1) / (pp * vpp)) if vpp > 1 else flat.activation_terms["layers"],
        rel=1e-6,
    )


def test_planner_counts_a_chunked_stages_tensors() -> None:
    """A stage's elements under virtual stages are those of its chunks' layers (GLM-4.5: the first layer dense)."""
    hf = tiny_config("glm4_moe", num_hidden_layers=12).to_hf_dict()
    # stage 0 holds layers 0, 1 (dense, MoE) and 6, 7; stage 1 layers 2, 3, 8, 9 (all MoE)
    layout = Layout(pp=3, vpp=2, dp=1)
    assert layout.stage_layers(12, 0) == [0, 1, 6, 7]
    e0 = rank_elements(hf, layout, 0).expert_trained
    e1 = rank_elements(hf, layout, 1).expert_trained
    assert e0 * 4 == e1 * 3  # three MoE layers against four


# ---------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def deep_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny presets with enough layers for chunks of one layer: qwen3 (tied embeddings), GLM-4.5 (first layer
    dense) and DeepSeek-V3.2 (MLA, DSA, an MTP layer) with 6, qwen3_moe with 8."""
    out = {}
    for arch, layers in [("qwen3", 6), ("qwen3_moe", 8), ("glm4_moe", 6), ("deepseek_v32", 6)]:
        path = tmp_path_factory.mktemp(f"{arch}_{layers}") / "model"
        save_pretrained(build_model(tiny_config(arch, num_hidden_layers=layers)), path)
        out[f"{arch}_{layers}"] = path
    return out


@pytest.mark.parametrize(
    "world_size,tp,ep,pp,vpp,model,r3",
    [
        (3, 1, 1, 3, 2, "qwen3_6", False),  # the tied embedding's copy on the last stage's last chunk
        (4, 1, 1, 4, 2, "qwen3_moe_8", True),  # micro-batches padded to a multiple of 4 stages
        (3, 1, 1, 3, 2, "glm4_moe_6", True),  # the dense layer in stage 0's first chunk
        (3, 1, 1, 3, 2, "deepseek_v32_6", True),  # MLA + DSA, each chunk starting with a full layer; MTP held last
    ],
)
@pytest.mark.process
def test_virtual_pipeline_step_equals_fsdp(
    world: None,
    deep_models: dict[str, Path],
    tmp_path: Path,
    world_size: int,
    tp: int,
    ep: int,
    pp: int,
    vpp: int,
    model: str,
    r3: bool,
) -> None:
    """megatron.virtual_pipeline: each stage's layers in `vpp` chunks (megatron's interleaved 1F1B schedule, the
    micro-batches padded to a multiple of the stages): the same log-probs, metrics and weights after a train step of two
    mini-batches as FSDP on one rank, the p2p shard map holding what rank 0's chunks hold, and the planner counting
    rank 0's elements; with R3 each chunk replays its layers' records (coverage and agreement as FSDP's)."""
    path = deep_models[model]
    metrics = _compare_step_with_fsdp(
        path, tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, pp=pp, vpp=vpp, r3=r3
    )
    if r3:
        ref = run_fsdp_once(str(path), r3=True)["metrics"]
        for key in ("r3/coverage", "r3/topk_agreement"):
            assert metrics[key] == pytest.approx(ref[key], abs=1e-9), key
