"""planner/estimate.py, planner/accounting.py and `miles-hpc plan`: parameter counts, HF names, activations, KV
cache, the subset-scaled p2p plan, the arithmetic.

The planner's tensors are the implemented model's (built on the meta device): per preset they must be what the
built model loads and saves, with its parameter count. The large-model configs are checked against their
advertised sizes and, for GLM-5.2, against the byte total and tensor count of the real checkpoint index (as
pinned by the GLM-5.2 launcher of a radixark/miles fork, see docs/planning.md). The activation accounting must
equal what autograd saves in a tiny built model of every family (CPU, bf16). The p2p estimate plans one layer of
each kind; here it must equal the whole-model plan of planner/transfer.py exactly, rank by rank.
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
from miles_hpc.models.presets import ARCHS, HYBRID_ARCHS, preset_config
from miles_hpc.planner.accounting import activations, indexer_peak, kv_bytes_per_token, model_config
from miles_hpc.planner.estimate import (
    Cluster,
    ModelSpecError,
    TrainBatch,
    element_bytes,
    estimate,
    format_table,
    hf_tensor_shapes,
    load_model_config,
    model_bytes,
    mtp_params,
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
    "n_group": 1,
    "topk_group": 1,
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
    assert mtp_params(kimi) == 0 and 1.00e12 <= total <= 1.06e12  # "1T total" (1.03T here: MTP-free, as released)
    assert active == pytest.approx(32e9, rel=0.05)  # "32B activated"
    glm, _ = load_model_config("glm52")
    total, active = param_counts(glm)
    assert total - mtp_params(glm) == pytest.approx(744e9, rel=0.01)  # "744B": without the MTP layer
    assert active == pytest.approx(40e9, rel=0.05)
    assert sum(t == "full" for t in glm["indexer_types"]) == 21  # IndexShare: index_topk_freq 4, offset 3


def test_glm52_matches_the_checkpoint_index() -> None:
    """59,585 tensors and 1,506,659,919,872 bytes: the zai-org/GLM-5.2 index, MTP layer 78 included."""
    glm, _ = load_model_config("glm52")
    shapes = hf_tensor_shapes(glm)
    assert len(shapes) == 59585 and model_bytes(glm) == 1_506_659_919_872
    mtp = {k.removeprefix("model.layers.78."): v for k, v in shapes.items() if k.startswith("model.layers.78.")}
    assert mtp["eh_proj.weight"] == (6144, 2 * 6144) and mtp["self_attn.indexer.wk.weight"] == (128, 6144)
    assert {"enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.experts.255.down_proj.weight"} <= set(mtp)
    assert not any(k.startswith("model.layers.79.") for k in shapes)


@pytest.mark.parametrize("arch", ARCHS)
def test_names_and_totals_match_our_models(arch: str) -> None:
    """Names and shapes are what the built model loads and saves; the total is its `sum(p.numel())`, MTP included."""
    from miles_hpc.models import ModelConfig, build_model, expected_hf_shapes

    cfg = preset_config(arch, "tiny")
    model = build_model(ModelConfig.from_hf_dict(cfg))
    assert hf_tensor_shapes(cfg) == expected_hf_shapes(model)
    assert param_counts(cfg)[0] == sum(p.numel() for p in model.parameters())
    mtp = cfg.get("num_nextn_predict_layers", 0)
    assert mtp == (1 if arch in ("glm_moe_dsa", "deepseek_v32") else 0)
    layers = model.model.layers[cfg["num_hidden_layers"] :]
    assert mtp_params(cfg) == sum(p.numel() for p in layers.parameters())


def test_unbuildable_configs_name_the_field() -> None:
    with pytest.raises(ModelSpecError, match="model_type"):
        hf_tensor_shapes({**preset_config("llama", "tiny"), "model_type": "mistral", "architectures": ["X"]})
    with pytest.raises(ModelSpecError, match="intermediate_size"):  # a dense layer needs its width written out
        hf_tensor_shapes({k: v for k, v in SMALL_MLA.items() if k != "intermediate_size"})
    with pytest.raises(ModelSpecError, match="index_head_dim"):
        hf_tensor_shapes({k: v for k, v in SMALL_MLA.items() if k != "index_head_dim"})


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


def _saved_bytes(cfg: dict, seq_len: int, micro_batch: int) -> int:
    """Bytes autograd holds for backward after a forward of the trainer's kind (packed sequences, then the log-prob
    kernel with entropy) of a tiny bf16 model built from `cfg`: each live storage once, parameters excluded (a
    tensor saved by a node that nothing downstream reaches is freed during the forward: not counted)."""
    import weakref

    import torch

    from miles_hpc.models import ModelConfig, build_model
    from miles_hpc.train.logprobs import LogProbEntropy

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf_dict(cfg), dtype=torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    ids = torch.randint(0, cfg["vocab_size"], (1, seq_len * micro_batch))
    cu = torch.arange(micro_batch + 1, dtype=torch.int32) * seq_len
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits = model(ids, cu_seqlens=cu)
        out = LogProbEntropy.apply(logits.flatten(0, 1), torch.cat([ids[0, 1:], ids[0, :1]]), True)
    live = {s.data_ptr(): s.nbytes() for r in saved if (t := r()) is not None for s in [t.untyped_storage()]}
    del out
    return sum(n for ptr, n in live.items() if ptr not in params)


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_activations_are_what_autograd_saves(arch: str) -> None:
    """The planner's saved-activation terms add up to what the implemented forward keeps, byte for byte. The
    DeepSeek presets get v_head_dim = qk_head_dim here: with unequal widths torch's CPU SDPA falls back to its math
    kernel (float32 [H, S, S] probabilities), which CUDA's memory-efficient kernel, the one the planner assumes,
    does not keep. The hybrids' layers are measured on the meta device (planner/measure.py): this checks that run
    against a real one, sequences over one 64-token chunk of the scans included."""
    cfg = preset_config(arch, "tiny")
    if arch in ("deepseek_v3", "deepseek_v32"):
        cfg["v_head_dim"] = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    mc = model_config(cfg)
    for seq_len, micro_batch in ((32, 3), (48, 1)):
        want = activations(mc, seq_len=seq_len, micro_batch=micro_batch)
        assert _saved_bytes(cfg, seq_len, micro_batch) == sum(want.saved.values()), (seq_len, micro_batch)


def test_activation_terms_scale_with_length_and_micro_batch() -> None:
    glm, _ = load_model_config("glm52")
    mc = model_config(glm)

    def terms(s: int, n: int, ckpt: bool = False) -> dict[str, int]:
        a = activations(mc, seq_len=s, micro_batch=n, checkpointing=ckpt)
        return {**a.saved, **a.transient}

    router = 75 * 256 * 6144 * 4  # each MoE layer keeps its router's float32 weight copy, whatever the batch
    base = terms(1024, 1)
    twice_n, twice_s = terms(1024, 2), terms(2048, 1)
    for k, v in base.items():
        if k == "indexer_scores":  # one sequence's [S, H, S] scores, plus the micro-batch's projections
            continue
        const = router if k == "mlp" else 0
        assert twice_n[k] - const == 2 * (v - const), k  # everything else is per token or per sequence
        assert twice_s[k] - const == (4 if k == "dsa_mask" else 2) * (v - const), k  # the masks are [S, S]
    assert base["dsa_mask"] == 78 * 1024**2 * 2  # every DSA layer, shared ones too, bf16
    quad = 2 * 4 * 32 * 1024**2  # two float32 [S, 32 heads, S] tensors
    assert base["indexer_scores"] == quad + 1024 * 4 * (32 * 128 + 128 + 32)
    assert twice_s["indexer_scores"] == 4 * quad + 2 * (base["indexer_scores"] - quad)
    assert twice_n["indexer_scores"] == indexer_peak(mc, seq_len=1024, micro_batch=2) < 2 * base["indexer_scores"]
    heads, qk, v = 64, 192 + 64, 256  # MLA's K and V expanded per head, 78 layers, bf16
    assert base["attention_kv"] == 78 * 1024 * heads * (qk + v) * 2
    ckpt = terms(1024, 1, ckpt=True)
    assert ckpt["layer_inputs"] == 78 * 1024 * 6144 * 2 and ckpt["dsa_selections"] == 21 * 1024 * 1024 * 4
    assert terms(2048, 2, ckpt=True)["dsa_selections"] == 2 * 21 * 2048 * 2048 * 4  # top-k 2048: the whole row
    one_layer = activations(mc, seq_len=1024, micro_batch=1).saved
    assert ckpt["recompute"] < sum(one_layer.values()) / 20  # ~1/78 of the layers, plus the indexer's scores


def test_kv_bytes_per_token_from_glm52_shapes() -> None:
    glm, _ = load_model_config("glm52")
    shapes, mc = hf_tensor_shapes(glm), model_config(glm)
    decoder = [f"model.layers.{i}.self_attn." for i in range(78)]
    latent = sum(shapes[p + "kv_a_proj_with_mqa.weight"][0] for p in decoder)  # kv_lora_rank + rope, per layer
    index_keys = sum(shapes[p + "indexer.wk.weight"][0] for p in decoder if p + "indexer.wk.weight" in shapes)
    assert (latent, index_keys) == (78 * 576, 21 * 128)
    assert kv_bytes_per_token(mc, 2) == 2 * (latent + index_keys) == 95_232
    assert kv_bytes_per_token(mc, 2, tp=8) == 95_232 and kv_bytes_per_token(mc, 1) == 47_616  # MLA: whole per rank
    qwen = model_config(preset_config("qwen3", "tiny"))  # 2 KV heads of 16, 2 layers
    assert [kv_bytes_per_token(qwen, 2, tp) for tp in (1, 2, 4)] == [256, 128, 128]  # below one head: replicated
    r = estimate(glm, Cluster(engines=4, engine_tp=16, engine_ep=16, rollout_bytes=1))
    mem = r["memory"]
    room = int(141e9 - mem["rollout_per_gpu_gb"] * 1e9) // 47_616
    assert mem["rollout_kv_bytes_per_token"] == 47_616 and mem["rollout_kv_tokens_per_gpu"] == room > 0
    table = format_table(r)
    for words in ("MLA K/V", "DSA masks", "indexer scores", "47.6 kB/token per GPU", "1 MTP", "in MTP"):
        assert words in table, words


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
    """One layer, hidden 4, vocab 8, 2 heads (no GQA), MLP 8, untied: 236 parameters, 472 bf16 bytes; one token
    of activations: 284 bytes."""
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
    one = TrainBatch(seq_len=1, micro_batch=1)  # a micro-batch of one token
    r = estimate(cfg, link, batch=one)
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
    assert d["decode_rank0_s"] == pytest.approx(236 / gb)  # the whole 472 B at 2 GB/s
    # a codec at v GB/s matches broadcast when (236 + 472) / v + 236 = 472 (ns): v = 3 GB/s
    assert d["breakeven_codec_gbps"] == pytest.approx(3.0)
    mem = r["memory"]
    assert mem["train_per_gpu_gb"] == pytest.approx(236 * 18 / 2 / gb) and not mem["train_fits"]
    # Bytes per token (bf16 compute, models/*.py): an RMSNorm keeps 4h + 4 + 2h (float32 input, 1/rms, normed row).
    # attention: norm 28 + its output 8, q 8, output and o_proj's input 2 x 8, float32 lse 2 x 4 = 68; K and V 16;
    # MLP: norm 28 + output 8, gate/up/act/product 4 x 16 = 100; logits 16 + float32 lse, entropy 8 + int64
    # target 8 = 32; other: token id 8, cos and sin 2 x 2 x 2, final norm 28 + output 8 = 52; + logits' grad 16.
    act = {"attention": 68, "attention_kv": 16, "dsa_mask": 0, "mlp": 100, "logits": 32, "other": 52}
    assert mem["train_activation_terms_gb"] == pytest.approx({k: v / gb for k, v in {**act, "logits_grad": 16}.items()})
    assert mem["train_activations_gb"] == pytest.approx(284 / gb)
    assert mem["train_total_per_gpu_gb"] == pytest.approx((236 * 18 / 2 + 284) / gb)
    assert mem["train_min_gpus"] == math.ceil(236 * 18 / (1000 - 284)) and mem["rollout_fits"]
    # KV cache: K and V, 2 heads of 2, one layer, bf16 = 16 B/token; 1000 - 472 B of weights leave room for 33
    assert mem["rollout_kv_bytes_per_token"] == 16 and mem["rollout_kv_tokens_per_gpu"] == 33
    tiny = Cluster(gpu_mem_gb=284e-9, train_gpus=2, engines=1, engine_tp=1)  # the activations fill the GPU
    assert estimate(cfg, tiny, batch=one)["memory"]["train_min_gpus"] is None


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
    with pytest.raises(ModelSpecError, match="seq_len"):
        TrainBatch(seq_len=0)


def test_plan_of_the_qwen35_opd_config(capsys: pytest.CaptureFixture[str]) -> None:
    """`miles-hpc plan` of configs/experiments/qwen35_opd.yaml with the student's shapes: its own largest micro-batch
    (one 20,480-token response, checkpointed), the recurrent state each running sequence holds on an engine, and
    the KV of the 10 attention layers only (2 KV heads of 256, bf16)."""
    opd = str(REPO / "configs/experiments/qwen35_opd.yaml")
    assert main(["plan", opd, "--model", "qwen35_35b_a3b", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mem, cluster = report["memory"], report["cluster"]
    assert (cluster["seq_len"], cluster["activation_checkpointing"], cluster["engine_tp"]) == (20480, True, 1)
    assert mem["train_fits"] and mem["rollout_kv_bytes_per_token"] == 10 * 2 * 2 * 256 * 2
    # 30 DeltaNet layers: the width-4 convolution's last 3 inputs (q, k: 16 heads x 128; v: 32 x 128; bf16) and a
    # float32 [32, 128, 128] state each.
    assert mem["rollout_state_bytes_per_seq"] == 30 * ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 4 * 32 * 128 * 128)
