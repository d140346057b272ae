"""planner/estimate.py and `miles-hpc plan`: parameter counts, HF names, the subset-scaled p2p plan, the arithmetic.

The large-model configs are checked against their advertised sizes and, for GLM-5.2, against the byte total and
tensor count of the real checkpoint index (as pinned by the GLM-5.2 launcher of a radixark/miles fork, see
docs/planning.md). The p2p estimate plans one layer of each kind; here it must equal the whole-model plan of
planner/transfer.py exactly, rank by rank.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_hpc.cli import main
from miles_hpc.models.presets import ARCHS, preset_config
from miles_hpc.planner.estimate import (
    Cluster,
    ModelSpecError,
    element_bytes,
    estimate,
    hf_tensor_shapes,
    load_model_config,
    model_bytes,
    p2p_bytes,
    param_counts,
)
from miles_hpc.planner.transfer import engine_layout, fsdp_layout, plan_transfers, summarize

REPO = Path(__file__).resolve().parents[1]

# A small GLM-5-shaped config: MLA with low-rank queries, two dense layers, 8 experts + 1 shared, and an IndexShare
# schedule (indexer on layers 0, 1, 3, 5), so that it has three kinds of layer.
SMALL_MLA = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 32,
    "vocab_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "intermediate_size": 48,
    "moe_intermediate_size": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 2,
    "topk_method": "noaux_tc",
    "index_n_heads": 2,
    "index_head_dim": 8,
    "index_topk_freq": 2,
    "index_skip_topk_offset": 2,
    "tie_word_embeddings": False,
}


@pytest.fixture
def cli_json() -> Iterator[subprocess.Popen[str]]:
    """`miles-hpc plan kimi_k2 --json` as a subprocess (the installed entry point's path: imports, argv, exit)."""
    cmd = [sys.executable, "-m", "miles_hpc.cli", "plan", "kimi_k2", "--json", "--engine-tp", "16"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    yield proc
    if proc.poll() is None:  # a test failed before waiting for it
        proc.kill()
    proc.communicate()


def test_large_models_match_their_advertised_sizes() -> None:
    kimi, _ = load_model_config("kimi_k2")
    total, active = param_counts(kimi)
    assert 1.00e12 <= total <= 1.06e12  # "1T total" (1.03T here: MTP-free, as released)
    assert active == pytest.approx(32e9, rel=0.05)  # "32B activated"
    glm, _ = load_model_config("glm52")
    total, active = param_counts(glm)
    assert total == pytest.approx(744e9, rel=0.01)
    assert active == pytest.approx(40e9, rel=0.05)
    assert sum(t == "full" for t in glm["indexer_types"]) == 21  # IndexShare: index_topk_freq 4, offset 3


def test_glm52_matches_the_checkpoint_index() -> None:
    """59,585 tensors and 1,506,659,919,872 bytes: the zai-org/GLM-5.2 index, MTP layer 78 included."""
    glm, _ = load_model_config("glm52")
    with_mtp = {
        **glm,
        "num_hidden_layers": 79,
        "mlp_layer_types": [*glm["mlp_layer_types"], "sparse"],
        "indexer_types": [*glm["indexer_types"], "full"],
    }
    mtp_extra = {
        "eh_proj.weight": (6144, 2 * 6144),
        "enorm.weight": (6144,),
        "hnorm.weight": (6144,),
        "shared_head.norm.weight": (6144,),
    }
    assert len(hf_tensor_shapes(with_mtp)) + len(mtp_extra) == 59585
    assert model_bytes(with_mtp) + 2 * sum(math.prod(s) for s in mtp_extra.values()) == 1_506_659_919_872


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_and_qwen_moe_names_match_our_models(arch: str) -> None:
    from miles_hpc.models import ModelConfig, build_model, expected_hf_shapes

    cfg = preset_config(arch, "tiny")
    assert hf_tensor_shapes(cfg) == expected_hf_shapes(build_model(ModelConfig.from_hf_dict(cfg)))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_mla_names_match_transformers(model_type: str) -> None:
    """transformers keeps experts fused in memory (checkpoints list them one by one): compare everything else."""
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, GlmMoeDsaConfig

    cfg = {**SMALL_MLA, "model_type": model_type}
    if model_type == "deepseek_v3":
        for key in ("index_n_heads", "index_head_dim", "index_topk_freq", "index_skip_topk_offset"):
            del cfg[key]
    else:
        del cfg["index_topk_freq"], cfg["index_skip_topk_offset"]  # transformers 5.24: an indexer on every layer
        cfg["mlp_layer_types"] = ["dense"] * 2 + ["sparse"] * 4
    cls = DeepseekV3Config if model_type == "deepseek_v3" else GlmMoeDsaConfig
    hf_cfg = cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "topk_method")})
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()}
    ours = hf_tensor_shapes(cfg)
    per_expert = {k: v for k, v in ours.items() if ".experts." in k}
    assert {k: v for k, v in ours.items() if k not in per_expert} == {
        k: v for k, v in theirs.items() if ".experts." not in k
    }
    for layer in (2, 3):
        fused = sum(math.prod(v) for k, v in theirs.items() if k.startswith(f"model.layers.{layer}.mlp.experts."))
        assert fused == sum(math.prod(v) for k, v in per_expert.items() if f"layers.{layer}." in k)


@pytest.mark.parametrize(
    ("cfg", "world", "engines", "tp", "ep", "rollout_bytes"),
    [
        (SMALL_MLA, 3, 2, 2, 2, 2),
        (SMALL_MLA, 4, 3, 4, 1, 1),
        (SMALL_MLA, 5, 1, 4, 4, 2),
        (preset_config("qwen3_moe", "tiny"), 5, 2, 4, 2, 2),  # 2 KV heads over TP 4: replicated heads
        (preset_config("llama", "tiny"), 2, 3, 2, 1, 2),
    ],
)
def test_subset_p2p_equals_the_full_plan(cfg, world, engines, tp, ep, rollout_bytes) -> None:
    shapes = hf_tensor_shapes(cfg)
    kv_heads = None if cfg.get("kv_lora_rank") else cfg.get("num_key_value_heads")
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts")
    needs = engine_layout(shapes, tp, engines, ep_size=ep, kv_heads=kv_heads, num_experts=experts)
    esize = {n: element_bytes(n, rollout_bytes) for n in shapes}
    full = summarize(plan_transfers(shapes, fsdp_layout(shapes, world), needs, esize))
    got = p2p_bytes(cfg, train_gpus=world, engines=engines, tp=tp, ep=ep, rollout_bytes=rollout_bytes)
    assert got.send == full.send_bytes and got.recv == full.recv_bytes
    assert (got.max_send, got.max_recv, got.total) == (full.max_send_bytes, full.max_recv_bytes, full.total_bytes)


def test_arithmetic_by_hand() -> None:
    """One layer, hidden 4, vocab 8, 2 heads (no GQA), MLP 8, untied: 236 parameters, 472 bf16 bytes."""
    cfg = {
        "model_type": "llama",
        "hidden_size": 4,
        "vocab_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 8,
    }
    # embed 32 + norm 4 + lm_head 32; layer: 2 norms 8 + q,k,v,o 4x16 + gate, up, down 3x32
    assert param_counts(cfg) == (236, 236) and model_bytes(cfg) == 472
    link = Cluster(
        train_gpus=2,
        engines=2,
        engine_tp=1,
        link_gbits=8.0,
        delta_ratio=0.5,
        encode_gbps=1.0,
        decode_gbps=2.0,
        gpu_mem_gb=1e-6,
    )  # 1 GB/s links; 1000-byte GPUs
    r = estimate(cfg, link)
    gb = 1e9
    assert r["sync"]["broadcast"]["seconds"] == pytest.approx(472 / gb)
    # every dim 0 is even: each trainer rank holds 236 bytes and sends them to both engines; each engine gets 472
    p2p = r["sync"]["p2p"]
    assert (p2p["max_send_gb"], p2p["max_recv_gb"], p2p["total_gb"]) == pytest.approx((472 / gb, 472 / gb, 944 / gb))
    assert p2p["seconds"] == pytest.approx(472 / gb)
    d = r["sync"]["delta"]
    assert d["bytes_gb"] == pytest.approx(236 / gb) and d["transfer_s"] == pytest.approx(236 / gb)
    assert d["encode_s"] == pytest.approx(236 / gb) and d["decode_s"] == pytest.approx(236 / gb)  # 472 B at 2 GB/s
    assert d["seconds"] == pytest.approx(708 / gb) and d["encode_rank0_s"] == pytest.approx(472 / gb)
    # a codec at v GB/s matches broadcast when (236 + 472) / v + 236 = 472 (ns): v = 3 GB/s
    assert d["breakeven_codec_gbps"] == pytest.approx(3.0)
    mem = r["memory"]
    assert mem["train_per_gpu_gb"] == pytest.approx(236 * 18 / 2 / gb) and not mem["train_fits"]
    assert mem["train_min_gpus"] == math.ceil(236 * 18 / 1000) and mem["rollout_fits"]


@pytest.mark.process
def test_cli_json_end_to_end(cli_json: subprocess.Popen[str]) -> None:
    stdout, stderr = cli_json.communicate(timeout=120)
    assert cli_json.returncode == 0, stderr
    report = json.loads(stdout)
    assert set(report) == {"model", "cluster", "memory", "sync", "assumptions"}
    assert set(report["sync"]) == {"broadcast", "p2p", "delta"}
    assert report["cluster"]["rollout_gpus"] == 64 and report["model"]["source"].endswith("kimi_k2.json")
    assert report["sync"]["p2p"]["seconds"] < report["sync"]["broadcast"]["seconds"]
    assert any("link" in a for a in report["assumptions"])


def test_cli_run_config_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(REPO / "configs/tiny_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "tiny_cpu (Qwen3ForCausalLM" in out and "2 train GPUs" in out and "assumptions:" in out
    assert main(["plan", str(REPO / "configs/tiny_cpu.yaml"), "--model", "glm52", "--engine-tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "glm52.json" in err and "engine_tp=3" in err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in SMALL_MLA.items() if k != "hidden_size"}))
    assert main(["plan", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "hidden_size" in err
    assert main(["plan", "no_such_model"]) == 2
    assert "no_such_model" in capsys.readouterr().err
    with pytest.raises(ModelSpecError, match="engine_ep"):
        Cluster(engine_tp=8, engine_ep=3)
