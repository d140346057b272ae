"""The megatron layout planner (planner/layouts.py): what a rank holds equals the megatron layout's boxes, the memory
terms follow the options, the offload search is the smallest fraction that fits, and `prepare` refuses a layout that
does not fit, naming the keys. (tests/test_megatron.py checks `rank_elements` against the parameters megatron builds
in every layout its step tests run.)"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from miles_hpc.config import load_config
from miles_hpc.config.loader import ConfigError
from miles_hpc.launch.layout_check import check_train_layout, configured
from miles_hpc.models import ModelConfig
from miles_hpc.models.presets import preset_config
from miles_hpc.planner.accounting import model_tensors
from miles_hpc.planner.estimate import load_model_config
from miles_hpc.planner.layouts import (
    NODES,
    Batch,
    Layout,
    MemoryOptions,
    Node,
    evaluate,
    fit_options,
    layout_problems,
    min_offload,
    rank_elements,
    rank_memory,
    search,
)
from miles_hpc.planner.mcore_layout import StageLayout, is_frozen, mcore_boxes, mcore_rules, padded_vocab_size

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa"]


def _by_boxes(cfg: dict, layout: Layout, stage: int) -> tuple[int, int]:
    """(trained, frozen) elements of TP rank 0 / EP rank 0 of `stage`, summed over `mcore_boxes` (the padded
    vocabulary rows counted, as megatron allocates them)."""
    mc = ModelConfig.from_hf_dict(cfg)
    shapes = model_tensors(cfg).all()
    stages = StageLayout(layout.pp, mc.num_hidden_layers, mc.tie_word_embeddings)
    out = [0, 0]
    for rule in mcore_rules(mc):
        held = len(stages.copies(rule.mcore, stage))
        if not held:
            continue
        if rule.kind == "vocab":
            n = padded_vocab_size(mc.vocab_size, layout.tp) // layout.tp * shapes[rule.hf[0]][1]
        else:
            boxes = mcore_boxes(rule, shapes, mc, 0, layout.tp, 0, layout.ep)
            n = sum(b.numel for b in boxes.values())
        out[int(is_frozen(rule.mcore))] += held * n
    return out[0], out[1]


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (1, 1, 4)])
def test_rank_elements_are_the_boxes(arch: str, tp: int, pp: int, ep: int) -> None:
    cfg = preset_config(arch, "tiny")
    mc = ModelConfig.from_hf_dict(cfg)
    layout = Layout(tp=tp, pp=pp, ep=ep if mc.num_experts else 1, dp=4)
    assert not layout_problems(cfg, layout, limits=False), layout  # every tiny preset splits this way
    for stage in range(pp):
        el = rank_elements(cfg, layout, stage)
        trained, frozen = _by_boxes(cfg, layout, stage)
        assert el.dense_trained + el.expert_trained == trained, (stage, layout)
        assert el.dense_frozen + el.expert_frozen == frozen, (stage, layout)


def test_memory_terms_follow_the_options() -> None:
    cfg = preset_config("qwen3_moe", "tiny")
    layout, batch = Layout(tp=2, ep=2, dp=2), Batch(seq_len=64)
    base = rank_memory(cfg, layout, MemoryOptions(), batch)
    el = base.elements
    trained = el.dense_trained + el.expert_trained
    assert base.weights == 2 * el.total and base.grads == 4 * trained
    shard = el.dense_trained / 2 + el.expert_trained / 2  # DP 2 for dense, expert-DP (2 x 2 / 2) for experts
    assert base.optimizer_gpu == int(12 * shard) and base.optimizer_host == 0
    plain = rank_memory(cfg, layout, MemoryOptions(distributed_optimizer=False), batch)
    assert plain.optimizer_gpu == 12 * trained
    half = rank_memory(cfg, layout, MemoryOptions(offload_fraction=0.5), batch)
    assert half.optimizer_host == int(0.5 * 16 * shard)
    assert half.optimizer_gpu == int(0.5 * 12 * shard + 0.5 * 4 * shard)  # the fp32 master stays without PA
    aware = rank_memory(cfg, layout, MemoryOptions(offload_fraction=0.5, precision_aware=True), batch)
    assert aware.optimizer_gpu == int(0.5 * 12 * shard)
    bf16 = rank_memory(
        cfg, layout, MemoryOptions(main_grads_bf16=True, precision_aware=True, offload_fraction=1), batch
    )
    assert bf16.grads == 2 * trained and bf16.optimizer_gpu == 0
    full = rank_memory(cfg, layout, MemoryOptions(recompute="full"), batch)
    assert full.activations < base.activations and set(full.activation_terms) >= {"layer_inputs", "recompute"}
    # Without CP the core attention is SDPA per sequence (train/mcore_attention.py): no softmax kept, so selective
    # recompute saves nothing. Under CP (the masked softmax): every layer's saved set but the softmax, one layer's
    # softmax recomputed at a time.
    selective = rank_memory(cfg, layout, MemoryOptions(recompute="selective"), batch)
    assert selective.activations == base.activations and base.activation_terms["attention_backward"] == 0
    cp = replace(layout, cp=2, dp=1)
    base, full = (rank_memory(cfg, cp, MemoryOptions(recompute=r), batch) for r in ("none", "full"))
    selective = rank_memory(cfg, cp, MemoryOptions(recompute="selective"), batch)
    assert full.activations < selective.activations < base.activations
    mc = ModelConfig.from_hf_dict(cfg)
    probs = (mc.num_attention_heads // cp.tp) * batch.seq_len**2 // 2 * (4 + 2)  # float32 softmax + its bf16 copy
    assert selective.activation_terms["recompute"] == probs
    assert base.activation_terms["layers"] - selective.activation_terms["layers"] == mc.num_hidden_layers * probs


def test_min_offload_is_the_smallest_step_that_fits() -> None:
    cfg = preset_config("qwen3_moe", "tiny")
    layout, batch = Layout(ep=2, dp=2), Batch(seq_len=64)
    opts = MemoryOptions(precision_aware=True, offload_fraction=1.0)
    none = rank_memory(cfg, layout, dataclasses.replace(opts, offload_fraction=0.0), batch)
    # a GPU that holds the rest and 40% of the optimizer states (at the planner's usable share)
    gb = (none.gpu - 0.6 * none.optimizer_gpu) / 0.9 / 1e9
    node = Node(name="t", gpus=2, gpu_mem_gb=gb, host_mem_gb=1e6)
    f = min_offload(cfg, layout, opts, batch, node)
    assert f == pytest.approx(0.6)
    assert evaluate(cfg, layout, dataclasses.replace(opts, offload_fraction=f), batch, node).fits
    assert not evaluate(cfg, layout, dataclasses.replace(opts, offload_fraction=f - 0.05), batch, node).fits
    tight = dataclasses.replace(node, host_mem_gb=1e-6)
    c = fit_options(cfg, layout, batch, tight)
    assert not c.fits and any("host memory short by" in p for p in c.problems)


def test_layout_problems_name_the_size() -> None:
    cfg = preset_config("qwen3_moe", "tiny")
    mc = ModelConfig.from_hf_dict(cfg)
    got = layout_problems(cfg, Layout(tp=1, pp=3, ep=3, dp=3))
    assert f"PP 3 does not divide the {mc.num_hidden_layers} decoder layers" in got
    assert f"EP 3 does not divide the {mc.num_experts} routed experts" in got
    dsa = preset_config("glm_moe_dsa", "tiny")
    assert not layout_problems(dsa, Layout(tp=2))  # MLA MoE under TP: built (sequence parallelism)
    assert not layout_problems(dsa, Layout(tp=1, cp=2))  # CP: built for the MLA families too
    batch, node = Batch(seq_len=64), Node(name="t", gpus=2, gpu_mem_gb=80, host_mem_gb=100)
    selective = evaluate(dsa, Layout(tp=2), MemoryOptions(recompute="selective"), batch, node)
    assert any("recompute_granularity=selective with glm_moe_dsa" in p for p in selective.problems)
    assert evaluate(dsa, Layout(tp=2), MemoryOptions(recompute="full"), batch, node).fits


def test_glm52_on_32_gpus() -> None:
    """The issue's question: on 32 GB300 the trainer as built has a layout that fits (MLA MoE under TP, full
    recompute with DSA, offload); without recompute it does not fit (the activations of megatron's unfused
    attention); on 32 MI300X host memory is short."""
    cfg, _ = load_model_config("glm52")
    batch = Batch()
    best = search(cfg, 32, NODES["gb300"], batch)[0]
    assert best.fits and best.layout == Layout(tp=4, ep=32, dp=8) and best.memory is not None
    assert best.options.recompute == "full" and 0 < best.options.offload_fraction < 1
    assert best.memory.gpu <= NODES["gb300"].gpu_bytes and best.memory.optimizer_host * 4 <= NODES["gb300"].host_bytes
    assert search(cfg, 32, NODES["gb300"], batch, limits=False)[0] == best  # nothing unbuilt would do better
    kept = evaluate(cfg, best.layout, dataclasses.replace(best.options, recompute="none"), batch, NODES["gb300"])
    assert not kept.fits and "GPU memory short" in kept.problems[0]
    mi = search(cfg, 32, NODES["mi300x"], batch, limits=False)
    assert not mi[0].fits and any("host memory short by" in p for p in mi[0].problems)
    assert all(math.isfinite(c.short_gb) or c.memory is None for c in mi)


def test_the_flagship_carries_the_planners_best_layout(tmp_path: Path) -> None:
    """configs/experiments/glm52_64gpu.yaml: its megatron layout and memory options are the planner's best for its
    training nodes (slurm.gpus_per_node, gpu_memory_gb, host_memory_gb: a b300 node), and `prepare`'s check passes
    once the checkpoint's config.json is readable."""
    model = tmp_path / "glm52"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(load_model_config("glm52")[0]))
    cfg = load_config(REPO / "configs" / "experiments" / "glm52_64gpu.yaml", [f"model.path={model}"])
    layout, opts, batch = configured(cfg)
    node = Node(name="flagship", gpus=cfg.slurm.gpus_per_node, gpu_mem_gb=288, host_mem_gb=2048)
    assert (cfg.slurm.gpu_memory_gb, cfg.slurm.host_memory_gb) == (288, 2048)
    best = search(load_model_config("glm52")[0], cfg.train.world_size, node, batch)[0]
    assert best.fits and (best.layout, best.options) == (layout, opts)
    assert "fits" in check_train_layout(cfg)


def test_prepare_refuses_a_layout_that_does_not_fit(tmp_path: Path) -> None:
    """`prepare`'s check names the keys and the planner's best layout; one that fits passes."""
    model = tmp_path / "glm52"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(load_model_config("glm52")[0]))
    over = [
        f"model.path={model}",
        "train.backend=megatron",
        "train.device=cuda",
        "train.world_size=32",
        "megatron.expert_parallel=32",
        "slurm.gpu_memory_gb=141",
        "slurm.host_memory_gb=2048",
        "slurm.gpus_per_node=8",
    ]
    cfg = load_config(REPO / "configs" / "tiny_echo.yaml", over)
    with pytest.raises(ConfigError) as e:
        check_train_layout(cfg)
    msg = str(e.value)
    assert "megatron.tensor_parallel=1" in msg and "GPU memory short by" in msg and "slurm.gpu_memory_gb=141" in msg
    small = load_config(
        REPO / "configs" / "tiny_echo.yaml", [*over[1:3], "train.world_size=2", "slurm.gpu_memory_gb=80"]
    )
    assert "fits" in check_train_layout(small)
    assert "not checked" in check_train_layout(load_config(REPO / "configs" / "tiny_echo.yaml", []))


def test_context_parallelism_splits_the_activations() -> None:
    """CP shares the row: a model's per-layer activations and attention probabilities halve from CP 2 to CP 4
    (CP's core attention is a masked softmax, which CP 1's SDPA does not keep); the search tries CP only when asked
    (`max_cp`)."""
    cfg = preset_config("qwen3", "tiny")
    batch = Batch(seq_len=1024)
    one = rank_memory(cfg, Layout(dp=2), MemoryOptions(), batch)
    two = rank_memory(cfg, Layout(cp=2), MemoryOptions(), batch)
    four = rank_memory(cfg, Layout(cp=4), MemoryOptions(), batch)
    assert four.activation_terms["layers"] * 2 == pytest.approx(two.activation_terms["layers"], rel=1e-3)
    assert one.activation_terms["attention_backward"] == 0 < four.activation_terms["attention_backward"]
    assert not layout_problems(cfg, Layout(cp=2))
    node = Node(name="t", gpus=2, gpu_mem_gb=80, host_mem_gb=100)
    assert {c.layout.cp for c in search(cfg, 2, node, batch)} == {1}
    assert {c.layout.cp for c in search(cfg, 2, node, batch, max_cp=2)} == {1, 2}
