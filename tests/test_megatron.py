"""megatron-core backend (train/mcore_weights.py, train/megatron.py): the HF <-> Megatron weight mapping and the
p2p shard layout, megatron's own `GPTModel` on our HF weights computing what our model computes, and
`MegatronTrainer` stepping like `FSDPTrainer` (R3 included), with tensor, data and expert parallelism over gloo on
the CPU (megatron_cpu_shims in conftest.py); the GPU tier runs megatron's optimizer and `miles-hpc run`.

The model runs are subprocesses (tests/mcore_worker.py): megatron's parallel state is process-global.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_hpc.data.sample import token_hash
from miles_hpc.models import ModelConfig, build_model, iter_hf_tensors, load_pretrained, read_config, save_pretrained
from miles_hpc.models.hf_io import hf_parts
from miles_hpc.models.presets import preset_config
from miles_hpc.planner.layouts import Layout, rank_elements
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.logprobs import PackedMicroBatch, pack_samples, token_logprobs
from miles_hpc.train.mcore_weights import (
    from_mcore,
    iter_full_hf,
    local_hf_parts,
    mcore_boxes,
    mcore_rules,
    padded_vocab_size,
    to_mcore,
)

sys.path.insert(0, str(Path(__file__).parent))
from conftest import has_megatron, require  # noqa: E402
from test_train_fsdp import STEP_ALGO, STEP_CFG, make_batch, tiny_model, world  # noqa: E402,F401

from miles_hpc.train.fsdp import FSDPTrainer  # noqa: E402

LENGTHS = (7, 12, 25, 5)
TRAIN_LENGTHS = (7, 12, 25, 5, 18, 9, 3)  # a train step: rank 1 of two gets fewer micro-batches (dummies run)
WORKER = Path(__file__).parent / "mcore_worker.py"


def tiny_config(arch: str, **overrides: object) -> ModelConfig:
    return ModelConfig.from_hf_dict({**preset_config(arch, "tiny"), **overrides})


def packed_batch(lengths: tuple[int, ...], device: torch.device | str = "cpu") -> PackedMicroBatch:
    """Several sequences packed into one micro-batch, a 3-token prompt each, advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    batch = TrainBatch(
        tokens=toks,
        loss_mask=[[0] * 3 + [1] * (len(t) - 3) for t in toks],
        rollout_logprobs=[[0.0] * len(t) for t in toks],
        advantages=[[1.0 if i % 2 == 0 else -0.5] * len(t) for i, t in enumerate(toks)],
        token_hash=[token_hash(t) for t in toks],
    )
    return pack_samples(batch, list(range(len(toks))), torch.device(device))


def loss_of(logits: torch.Tensor, mb: PackedMicroBatch) -> torch.Tensor:
    """A policy-gradient-shaped loss: advantage-weighted log-probs of the loss tokens."""
    lp, _ = token_logprobs(logits, mb, with_entropy=False)
    return -(lp * mb.advantages * mb.loss_mask).sum()


# ---------------------------------------------------------------- mapping (pure)
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen3", {}),
        ("qwen2", {}),
        ("llama", {"attention_bias": True}),
        ("qwen3", {"tie_word_embeddings": False}),
        ("qwen3_moe", {}),
        ("glm4_moe", {}),
    ],
)
@pytest.mark.parametrize("tp", [1, 2])
def test_mapping_round_trips(arch: str, overrides: dict, tp: int) -> None:
    assert_round_trip(tiny_config(arch, **overrides), tp)


def assert_round_trip(cfg: ModelConfig, tp: int) -> None:
    """HF tensors -> megatron shards of `tp` ranks -> HF tensors gives the same names, order and bits."""
    torch.manual_seed(0)
    hf = {k: v.clone() for k, v in iter_hf_tensors(build_model(cfg))}
    rules = mcore_rules(cfg)
    assert {n for r in rules for n in r.hf} == set(hf)  # every HF tensor has exactly one home
    shards = {r.mcore: [to_mcore(r, hf, cfg, rank, tp) for rank in range(tp)] for r in rules}
    back = dict(iter_full_hf(cfg, lambda rule: shards[rule.mcore]))
    assert list(back) == list(hf)  # iter_hf_tensors order
    for name, t in hf.items():
        assert torch.equal(back[name], t), name


def test_layouts_follow_megatron() -> None:
    """qkv: per query group [its q heads, k, v]; a TP rank holds whole groups. fc1 on a rank: [its gate; its up].
    Vocabulary: zero rows up to a multiple of 128 x TP."""
    cfg = tiny_config("qwen3")  # 4 query heads in 2 groups, head_dim 16, hidden 64
    hd, per = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    hf = {k: v.clone() for k, v in iter_hf_tensors(build_model(cfg))}
    rules = {r.mcore: r for r in mcore_rules(cfg)}
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    qkv1 = to_mcore(rules["decoder.layers.0.self_attention.linear_qkv.weight"], hf, cfg, 1, 2)  # rank 1: group 1
    assert torch.equal(qkv1[: per * hd], q[per * hd : 2 * per * hd])
    assert torch.equal(qkv1[per * hd : (per + 1) * hd], k[hd : 2 * hd])
    assert torch.equal(qkv1[(per + 1) * hd :], v[hd : 2 * hd])
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    half = gate.shape[0] // 2
    fc1 = to_mcore(rules["decoder.layers.0.mlp.linear_fc1.weight"], hf, cfg, 1, 2)
    assert torch.equal(fc1, torch.cat([gate[half:], up[half:]]))
    emb = rules["embedding.word_embeddings.weight"]
    assert padded_vocab_size(320, 2) == 512
    rank1 = to_mcore(emb, hf, cfg, 1, 2)
    assert torch.equal(rank1[: 320 - 256], hf["model.embed_tokens.weight"][256:]) and not rank1[64:].any()
    assert torch.equal(
        from_mcore(emb, [to_mcore(emb, hf, cfg, r, 2) for r in range(2)], cfg)[emb.hf[0]],
        hf["model.embed_tokens.weight"],
    )


@pytest.mark.parametrize(
    "arch,overrides,tp,ep",
    [
        ("qwen3", {}, 2, 1),
        ("qwen3", {"tie_word_embeddings": False}, 2, 1),
        ("qwen2", {}, 2, 1),
        ("qwen3_moe", {}, 1, 2),
        ("glm4_moe", {}, 2, 1),
        ("glm4_moe", {}, 1, 2),
    ],
)
def test_shard_boxes_hold_what_each_rank_holds(arch: str, overrides: dict, tp: int, ep: int) -> None:
    """p2p sync's view of megatron shards: on every rank, each HF tensor's box indexes exactly the data
    `local_hf_parts` takes from that rank's megatron tensor, and the boxes of all ranks cover every element."""
    cfg = tiny_config(arch, **overrides)
    torch.manual_seed(0)
    hf = {k: v.clone() for k, v in iter_hf_tensors(build_model(cfg))}
    shapes = {k: tuple(v.shape) for k, v in hf.items()}
    covered = {k: torch.zeros(v.shape, dtype=torch.bool) for k, v in hf.items()}
    coords = [(t, e) for e in range(ep) for t in range(tp)]
    for rule in mcore_rules(cfg):
        for t, e in coords:
            boxes = mcore_boxes(rule, shapes, cfg, t, tp, e, ep)
            if rule.expert is not None and rule.owner(cfg.num_experts, ep) != e:
                assert all(b.empty for b in boxes.values())
                continue
            parts = local_hf_parts(rule, to_mcore(rule, hf, cfg, t, tp), cfg, t, tp)
            assert set(parts) == set(boxes) == set(rule.hf)
            for name, box in boxes.items():
                assert torch.equal(hf[name][box.slices()], parts[name]), (name, t, e)
                covered[name][box.slices()] = True
    assert all(bool(c.all()) for c in covered.values())


def test_experts_live_on_their_expert_parallel_rank() -> None:
    cfg = tiny_config("qwen3_moe")  # 8 experts
    rules = [r for r in mcore_rules(cfg) if r.expert == 5 and r.mcore.startswith("decoder.layers.1.")]
    fc1 = next(r for r in rules if r.kind == "expert_fc1")
    assert fc1.hf == ("model.layers.1.mlp.experts.5.gate_proj.weight", "model.layers.1.mlp.experts.5.up_proj.weight")
    local1 = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"
    assert (fc1.owner(8, 2), fc1.mcore_name(8, 2)) == (1, local1)
    assert (fc1.owner(8, 1), fc1.mcore_name(8, 1)) == (0, fc1.mcore)
    router = next(r for r in mcore_rules(cfg) if r.mcore.endswith("mlp.router.weight"))
    assert router.mcore_name(8, 2) == router.mcore and router.expert is None


# ---------------------------------------------------------------- megatron's model on our weights
def _run_world(
    mode: str,
    model_dir: Path,
    world: int,
    tp: int,
    out: Path,
    *extra: str,
    ep: int = 1,
    pp: int = 1,
    cp: int = 1,
    vpp: int = 1,
) -> dict:
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "MCORE_PP": str(pp),
        "MCORE_CP": str(cp),
        "MCORE_VPP": str(vpp),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(model_dir), str(tp), str(ep), str(out), *extra],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log.decode()[-4000:]
    return torch.load(out, weights_only=False)


def _free_port() -> int:
    from miles_hpc.launch.local import free_port as pick

    return pick()  # below the ephemeral range: no other process's connection takes it first


@pytest.mark.parametrize(
    "arch,overrides,tp,ep",
    [
        ("qwen3", {}, 1, 1),
        ("qwen3", {"tie_word_embeddings": False}, 2, 1),
        ("qwen2", {}, 2, 1),
        ("llama", {}, 2, 1),
        ("qwen3_moe", {}, 1, 1),
        ("qwen3_moe", {}, 1, 2),
        ("qwen3_moe", {"norm_topk_prob": False}, 1, 2),
        ("glm4_moe", {}, 1, 1),
        ("glm4_moe", {}, 1, 2),
        ("qwen3_moe", {}, 2, 1),  # MoE under TP: megatron's sequence parallelism, the row padded to a multiple of 2
        ("glm4_moe", {}, 2, 2),
    ],
)
@pytest.mark.process
def test_megatron_model_matches_ours(arch: str, overrides: dict, tp: int, ep: int, tmp_path: Path) -> None:
    """Same logits, loss and HF-named gradients as our CausalLM (fp32, packed sequences), TP=1 and TP=2; the
    weights gathered back from the TP shards are the checkpoint's, bit for bit. Gradients go through megatron's
    DDP wrapper and `finalize_model_grads` (the TP sums of the QK layernorms' pieces)."""
    _compare_with_ours(tiny_config(arch, **overrides), tp, tmp_path, "cpu", atol=2e-5, ep=ep)


@pytest.mark.gpu
@pytest.mark.parametrize("arch,size", [("qwen3", "small"), ("qwen3_moe", "tiny"), ("glm4_moe", "tiny")])
def test_megatron_model_matches_ours_gpu(arch: str, size: str, tmp_path: Path) -> None:
    """The same on a GPU (NCCL, megatron's CUDA RNG tracker and buffers, its MoE dispatcher's streams, no shims)."""
    _compare_with_ours(ModelConfig.from_hf_dict(preset_config(arch, size)), 1, tmp_path, "cuda", atol=1e-4)


def _compare_with_ours(cfg: ModelConfig, tp: int, tmp_path: Path, device: str, atol: float, ep: int = 1) -> None:
    require(has_megatron(), "megatron-core (the megatron extra)")
    torch.manual_seed(1)
    model = build_model(cfg)
    with torch.no_grad():  # a correction bias large enough to change which experts win (init leaves it at 0)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.uniform_(-0.3, 0.3)
    save_pretrained(model, tmp_path / "model")
    got = _run_world("model", tmp_path / "model", tp * ep, tp, tmp_path / "out.pt", device, ep=ep)

    ours = load_pretrained(tmp_path / "model", dtype=torch.float32, device=device)
    mb = packed_batch(LENGTHS, device)
    logits = ours(mb.input_ids, position_ids=mb.position_ids, cu_seqlens=mb.cu_seqlens)
    loss = loss_of(logits, mb)
    loss.backward()
    assert got["logits"].shape == logits.shape
    torch.testing.assert_close(got["logits"], logits.detach().cpu(), atol=atol, rtol=1e-5)
    torch.testing.assert_close(got["loss"], loss.detach().cpu(), atol=atol, rtol=1e-5)
    hf = dict(iter_hf_tensors(ours))
    assert list(got["weights"]) == list(hf)
    for name, t in hf.items():
        assert torch.equal(got["weights"][name], t.cpu()), name
    ours_grads = {
        hf_name: p.grad[index] if index and p.grad is not None else p.grad
        for name, p in ours.named_parameters()
        for hf_name, index in hf_parts(cfg, name, p.shape)
    }  # fused experts carved into HF tensors
    assert set(got["grads"]) == set(ours_grads)
    for name in [n for n, g in ours_grads.items() if g is None]:  # untrained (GLM router bias, DSA indexers, MTP)
        assert not got["grads"].pop(name).any(), name
    for name, g in got["grads"].items():
        torch.testing.assert_close(g, ours_grads[name].cpu(), atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def tiny_moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_hpc.models.presets import init_model

    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("tiny_moe") / "model")


@pytest.fixture(scope="module")
def tiny_glm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_hpc.models.presets import init_model

    return init_model("glm4_moe", "tiny", tmp_path_factory.mktemp("tiny_glm") / "model")


@pytest.mark.parametrize(
    "world_size,tp,ep,pp,arch",
    [
        (1, 1, 1, 1, "qwen3"),
        (2, 2, 1, 1, "qwen3"),
        (2, 1, 1, 1, "qwen3"),
        (2, 1, 2, 1, "qwen3_moe"),
        (2, 1, 2, 1, "glm4_moe"),
        (2, 1, 1, 2, "qwen3"),
        (4, 2, 1, 2, "qwen3"),
        (4, 1, 2, 2, "qwen3_moe"),
        (2, 2, 1, 1, "qwen3_moe"),  # MoE under TP: sequence parallelism, experts whole on both TP ranks
        (4, 2, 2, 1, "glm4_moe"),  # TP 2 x EP 2 (2 data-parallel ranks)
    ],
)
@pytest.mark.process
def test_trainer_step_equals_fsdp(
    world: None,
    tiny_model: Path,
    tiny_moe_model: Path,
    tiny_glm_model: Path,
    tmp_path: Path,
    world_size: int,
    tp: int,
    ep: int,
    pp: int,
    arch: str,
) -> None:
    """MegatronTrainer (TP, DP or pipeline stages over gloo; on the CPU the FSDP backend's AdamW over megatron's
    reduced gradients) and FSDPTrainer (one rank) on the same batch and weights (fp32): the same log-probs, step
    metrics and weights after a train step of two mini-batches, which checks that megatron's DP gradient averaging
    and TP reductions meet our loss normalisation. With ep=2 the model is a MoE preset, its experts split over the
    two ranks (megatron's token dispatcher, expert gradients reduced over the expert-data-parallel group). With
    pp=2 the layers are split over two stages run by megatron's 1F1B schedule (the tiny qwen3 ties its
    embeddings: the last stage's copy of the embedding)."""
    model = {"qwen3": tiny_model, "qwen3_moe": tiny_moe_model, "glm4_moe": tiny_glm_model}[arch]
    _compare_step_with_fsdp(model, tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, pp=pp)


@pytest.mark.parametrize(
    "world_size,tp,ep,pp,cp,arch,r3,recompute",
    [
        (2, 1, 1, 1, 2, "qwen3", False, None),
        (4, 1, 1, 1, 4, "qwen3", False, None),
        (4, 2, 1, 1, 2, "qwen3_moe", True, None),  # CP 2 x TP 2: sequence parallelism within each CP share
        (4, 1, 2, 1, 2, "glm4_moe", True, None),  # CP 2 x EP 2 (DP 2)
        (4, 1, 1, 2, 2, "qwen3", False, None),  # CP 2 x PP 2: each stage's CP ranks exchange their shares' states
        (2, 1, 1, 1, 2, "qwen3_moe", True, "full"),  # the gathers run again in the recompute
        (2, 1, 1, 1, 2, "qwen3", False, "selective"),
    ],
)
@pytest.mark.process
def test_context_parallel_step_equals_fsdp(
    world: None,
    tiny_model: Path,
    tiny_moe_model: Path,
    tiny_glm_model: Path,
    tmp_path: Path,
    world_size: int,
    tp: int,
    ep: int,
    pp: int,
    cp: int,
    arch: str,
    r3: bool,
    recompute: str | None,
) -> None:
    """megatron.context_parallel: each packed row split over the CP ranks (load-balanced chunks, megatron's RoPE
    slicing), all-gather attention (train/mcore_cp.py), the log-probs gathered into the whole row: the same
    log-probs, metrics and weights after a train step as FSDP on one rank; with R3 each CP rank replays the records
    of its share (coverage and agreement as FSDP's); with megatron's full and selective recompute. Under PP 2
    megatron's schedule multiplies the loss by the CP size (without undoing it the gradients double)."""
    model = {"qwen3": tiny_model, "qwen3_moe": tiny_moe_model, "glm4_moe": tiny_glm_model}[arch]
    metrics = _compare_step_with_fsdp(
        model, tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, pp=pp, cp=cp, r3=r3, recompute=recompute
    )
    if r3:
        ref = run_fsdp_once(str(model), r3=True)["metrics"]
        for key in ("r3/coverage", "r3/topk_agreement"):
            assert metrics[key] == pytest.approx(ref[key], abs=1e-9), key


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_trainer_step_equals_fsdp_gpu(
    world: None, tiny_model: Path, tmp_path: Path, distributed_optimizer: bool
) -> None:
    """On a GPU megatron's own optimizer steps (`get_megatron_optimizer`, distributed or not): the same step as
    the FSDP backend's on the CPU (fp32 both)."""
    _compare_step_with_fsdp(tiny_model, tmp_path, 1, 1, distributed_optimizer, "cuda", atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [0.25, 0.5, 1.0])
def test_offloaded_optimizer_steps_like_fsdp_gpu(
    world: None, tiny_moe_model: Path, tmp_path: Path, offload: float
) -> None:
    """megatron.optimizer_offload_fraction (megatron's HybridDeviceOptimizer, precision-aware: no fp32 master left
    on the GPU; torch's AdamW on the host for that share of the distributed optimizer's shard, on the GPU for the
    rest): the same step as the FSDP backend's (fp32 both), on a MoE model. A partial offload steps float32
    parameters on the GPU too (train/mcore_fixes.gpu_share_grads: before it they never stepped)."""
    _compare_step_with_fsdp(tiny_moe_model, tmp_path, 1, 1, True, "cuda", atol=1e-4, offload=offload)


def _compare_step_with_fsdp(
    model_dir: Path,
    tmp_path: Path,
    world_size: int,
    tp: int,
    distributed_optimizer: bool,
    device: str,
    atol: float,
    ep: int = 1,
    r3: bool = False,
    pp: int = 1,
    indexer_loss: float = 0.0,
    recompute: str | None = None,
    offload: float = 0.0,
    cp: int = 1,
    vpp: int = 1,
) -> dict:
    """The megatron step (in `world_size` processes) against FSDP's on one rank. `indexer_loss`: both with
    train.indexer_loss_coef (the workers read it from MCORE_INDEXER_LOSS); `recompute`: megatron with
    train.activation_checkpointing and that megatron.recompute_granularity, "full" or "selective" (MCORE_RECOMPUTE)."""
    require(has_megatron(), "megatron-core (the megatron extra)")
    os.environ["MCORE_INDEXER_LOSS"] = str(indexer_loss)
    os.environ["MCORE_RECOMPUTE"] = recompute or ""
    os.environ["MCORE_OFFLOAD"] = str(offload)
    try:
        got = _run_world(
            "train",
            model_dir,
            world_size,
            tp,
            tmp_path / "out.pt",
            str(int(distributed_optimizer)),
            device,
            str(int(r3)),
            ep=ep,
            pp=pp,
            cp=cp,
            vpp=vpp,
        )
    finally:
        del os.environ["MCORE_INDEXER_LOSS"], os.environ["MCORE_RECOMPUTE"], os.environ["MCORE_OFFLOAD"]
    assert got["recompute"] == recompute
    ref = run_fsdp_once(str(model_dir), r3=r3, indexer_loss=indexer_loss)
    assert got["step"] == 2
    assert len(got["logprobs"]) == len(TRAIN_LENGTHS)
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)
    keys = ["loss", "pg_loss", "entropy", "tokens", "loss_tokens", "lr", "clip_frac", "grad_norm"]
    for key in keys + (["dsa/indexer_kl"] if indexer_loss else []):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=atol), key
    assert list(got["weights"]) == list(ref["weights"])
    cfg = read_config(model_dir)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        if untrained(name, cfg, indexer_loss > 0):  # left exactly as loaded by both backends
            assert torch.equal(w, ref["before"][name]) and torch.equal(got["weights"][name], w), name
        else:  # the step changed every other tensor: equality is not trivial
            assert not torch.equal(w, ref["before"][name]), name
    assert got["shard_map_mismatch"] == []  # rank 0's p2p shard map holds what its boxes say
    # the layout planner counts what rank 0 (TP rank 0, EP rank 0, stage 0) built
    layout = Layout(tp=tp, pp=pp, ep=ep, cp=cp, dp=world_size // (tp * pp * cp), vpp=vpp)
    planned = rank_elements(json.loads((model_dir / "config.json").read_text()), layout, 0)
    assert sum(got["elements"].values()) == planned.total
    if not indexer_loss:  # the indexer loss trains the indexers the planner counts as frozen
        assert got["elements"]["frozen"] == planned.dense_frozen + planned.expert_frozen
    return got["metrics"]


@pytest.mark.parametrize(
    "world_size,tp,ep,pp", [(1, 1, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (2, 2, 1, 1), (2, 2, 2, 1), (4, 2, 2, 1)]
)
@pytest.mark.process
def test_r3_replays_recorded_experts_like_fsdp(
    world: None, tiny_moe_model: Path, tmp_path: Path, world_size: int, tp: int, ep: int, pp: int
) -> None:
    """R3 in megatron (its router-replay hook, recorded ids where there are records, the live top-k elsewhere) and
    in our model give the same step; the records, mostly unlike the router's own choice, cover all but the last
    rows of each sample. With pipeline stages each stage replays its own layers' records (the records' layer axis
    counts the MoE layers of earlier stages); under TP (sequence parallelism) each TP rank replays the records of
    its chunk of the padded row, and the statistics add up over the TP ranks without the padding."""
    metrics = _compare_step_with_fsdp(
        tiny_moe_model, tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, r3=True, pp=pp
    )
    ref = run_fsdp_once(str(tiny_moe_model), r3=True)["metrics"]
    for key in ("r3/coverage", "r3/topk_agreement"):
        assert metrics[key] == pytest.approx(ref[key], abs=1e-9), key
    # every token but the last of a sample (never run by the engine) and the two -1 rows has a record
    assert metrics["r3/coverage"] == pytest.approx(sum(n - 3 for n in TRAIN_LENGTHS) / sum(TRAIN_LENGTHS))
    assert metrics["r3/topk_agreement"] < 0.5


@pytest.mark.parametrize(
    "world_size,tp,ep,arch,granularity",
    [
        (2, 2, 1, "qwen3", "full"),
        (2, 1, 2, "qwen3_moe", "full"),
        (2, 2, 1, "qwen3_moe", "full"),
        (2, 2, 1, "qwen3", "selective"),
        (2, 2, 1, "qwen3_moe", "selective"),
    ],
)
@pytest.mark.process
def test_activation_recompute_trains_the_same(
    world: None,
    tiny_model: Path,
    tiny_moe_model: Path,
    tmp_path: Path,
    world_size: int,
    tp: int,
    ep: int,
    arch: str,
    granularity: str,
) -> None:
    """train.activation_checkpointing with the megatron backend (megatron's full recompute, one layer at a time, or
    its selective one, the core attention): the step equals FSDP's, R3 on for the MoE model (each layer recomputed
    in backward replays the same records, and its statistics are counted once); under TP with sequence parallelism
    too."""
    moe = arch == "qwen3_moe"
    model = tiny_moe_model if moe else tiny_model
    metrics = _compare_step_with_fsdp(
        model, tmp_path, world_size, tp, False, "cpu", atol=1e-5, ep=ep, r3=moe, recompute=granularity
    )
    if moe:
        ref = run_fsdp_once(str(model), r3=True)["metrics"]
        for key in ("r3/coverage", "r3/topk_agreement"):
            assert metrics[key] == pytest.approx(ref[key], abs=1e-9), key


def test_layout_refusals_name_the_key(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """What this backend does not do yet is refused by key before a model is built: recompute with R3 under
    pipeline stages, selective recompute for the DSA families, the DSA indexer loss under context parallelism."""
    require(has_megatron(), "megatron-core (the megatron extra)")
    from megatron.core import parallel_state

    from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
    from miles_hpc.train import mcore_model
    from miles_hpc.train.megatron import MegatronTrainer

    recompute, r3 = TrainConfig(activation_checkpointing=True), AlgoConfig(routing_replay=True)
    with pytest.raises(
        NotImplementedError, match="activation_checkpointing with algo.routing_replay and megatron.pipe"
    ):
        MegatronTrainer("unused", recompute, r3, MegatronConfig(pipeline_parallel=2), device="cpu", seed=0)
    with pytest.raises(NotImplementedError, match="indexer_loss_coef with megatron.context_parallel=2"):
        MegatronTrainer(
            "unused",
            TrainConfig(indexer_loss_coef=1.0),
            AlgoConfig(),
            MegatronConfig(context_parallel=2),
            device="cpu",
            seed=0,
        )
    mcore_model.init_model_parallel(1, 1)
    try:
        with pytest.raises(NotImplementedError, match="recompute_granularity=selective with glm_moe_dsa"):
            mcore_model.build_gpt(tiny_config("glm_moe_dsa"), recompute="selective")

    finally:
        monkeypatch.undo()
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
def test_r3_replays_recorded_experts_like_fsdp_gpu(world: None, tiny_moe_model: Path, tmp_path: Path) -> None:
    """R3 on a GPU with megatron's distributed optimizer: the same step as FSDP's R3 step on the CPU."""
    metrics = _compare_step_with_fsdp(tiny_moe_model, tmp_path, 1, 1, True, "cuda", atol=1e-4, r3=True)
    assert metrics["r3/topk_agreement"] < 0.5


def untrained(hf_name: str, cfg: ModelConfig, indexer_loss: bool = False) -> bool:
    """HF tensors a train step leaves as they are: GLM's router correction bias (frozen), the DSA indexers (no
    gradient from the policy loss; trained by the indexer loss when on) and the multi-token-prediction layers (no
    MTP loss here)."""
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    mtp = layer is not None and int(layer) >= cfg.num_hidden_layers
    indexer = ".self_attn.indexer." in hf_name and not indexer_loss
    return hf_name.endswith("e_score_correction_bias") or indexer or mtp


def r3_batch(cfg: ModelConfig) -> TrainBatch:
    """The train batch with R3 records: random expert ids per token and MoE layer (mostly not what the router would
    pick, so replaying them changes the step), the last two rows of each sample without a record (-1)."""
    batch = make_batch(TRAIN_LENGTHS)
    g = torch.Generator().manual_seed(3)
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    records = []
    for toks in batch.tokens:
        rows = len(toks) - 1
        ids = torch.rand(rows, layers, cfg.num_experts, generator=g).argsort(-1)[..., : cfg.num_experts_per_tok]
        ids[-2:] = -1
        records.append(ids.numpy())
    batch.routed_experts = records
    return batch


def run_fsdp_once(model_dir: str, r3: bool = False, indexer_loss: float = 0.0) -> dict:
    algo = dataclasses.replace(STEP_ALGO, routing_replay=r3)
    mode = os.environ.get("MCORE_INDEXER_MODE", "sparse")  # train.indexer_loss (as the workers read it)
    cfg = dataclasses.replace(STEP_CFG, mixed_precision=False, indexer_loss_coef=indexer_loss, indexer_loss=mode)
    trainer = FSDPTrainer(model_dir, cfg, algo, device="cpu", seed=0)
    before = {k: v.clone() for k, v in trainer.state_for_sync()}
    batch = r3_batch(trainer.config) if r3 else make_batch(TRAIN_LENGTHS)
    logprobs = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    return {
        "logprobs": logprobs,
        "metrics": metrics,
        "before": before,
        "weights": {k: v.clone() for k, v in trainer.state_for_sync()},
    }


# ---------------------------------------------------------------- in `miles-hpc run`
REPO = Path(__file__).resolve().parents[1]


def test_megatron_on_the_cpu_needs_the_plain_optimizer() -> None:
    from miles_hpc.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="megatron.distributed_optimizer.*CUDA-only"):
        load_config(REPO / "configs/tiny_cpu.yaml", ["train.backend=megatron"])
    cfg = load_config(
        REPO / "configs/tiny_cpu.yaml", ["train.backend=megatron", "megatron.distributed_optimizer=false"]
    )
    assert cfg.train.device == "cpu" and not cfg.megatron.distributed_optimizer


@pytest.mark.slow
@pytest.mark.process
def test_megatron_runs_in_miles_hpc_run_on_the_cpu(tmp_path: Path) -> None:
    """`miles-hpc run` with the megatron trainer on the CPU (train/mcore_cpu.py): GLM-5 tiny (MLA, DSA indexers,
    MoE with R3, the indexer loss) at EP 2 over two gloo ranks, broadcast sync verified by checksums, megatron's
    dist checkpoint written, and a second run resumes from it."""
    import json

    run_dir = tmp_path / "run"
    argv = [
        str(REPO / "configs/tiny_dsa_cpu.yaml"),
        f"run_dir={run_dir}",
        "train.backend=megatron",
        "megatron.distributed_optimizer=false",
        "megatron.expert_parallel=2",
        "train.sft_warmup_steps=2",
        "train.checkpoint_interval=2",
    ]
    for steps in (2, 3):
        proc = subprocess.run(
            [sys.executable, "-m", "miles_hpc.cli", "run", *argv, f"steps={steps}"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout + proc.stderr
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [0, 1, 2] and [r["weight_version"] for r in m] == [1, 2, 3]
    assert all(r["sync/engines"] == 1 and math.isfinite(r["loss"]) for r in m)
    assert all(r["r3/coverage"] > 0.5 and math.isfinite(r["dsa/indexer_kl"]) for r in m)
    meta = json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())
    assert meta["backend"] == "megatron"
    assert (run_dir / "checkpoints" / "step_2" / "mcore").is_dir()


def test_a_checkpoint_names_its_backend(world: None, tiny_model: Path, tmp_path: Path) -> None:
    from miles_hpc.train.checkpoint import read_checkpoint

    trainer = FSDPTrainer(tiny_model, STEP_CFG, STEP_ALGO, device="cpu", seed=0)
    path = trainer.save(tmp_path / "step_0", extra={"step": 0})
    assert read_checkpoint(path, "fsdp")[1] == {"step": 0}
    with pytest.raises(ValueError, match="written by the fsdp backend, this run uses train.backend=megatron"):
        read_checkpoint(path, "megatron")


def _megatron_run(run_dir: Path, steps: int, *extra: str) -> subprocess.CompletedProcess[str]:
    require(has_megatron(), "megatron-core (the megatron extra)")
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        "train.world_size=1",
        "train.device=cuda",
        "rollout.device=cuda",
        "sync.strategy=colocated",
        "train.backend=megatron",
        "train.sft_warmup_steps=5",
        "train.checkpoint_interval=2",
        f"steps={steps}",
        *extra,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.gpu
def test_tiny_loop_with_megatron_on_one_gpu(tmp_path: Path) -> None:
    """The RL loop end to end with the megatron trainer on GPU 0 (engine beside it, colocated weight sync verified
    by checksums) and a megatron dist checkpoint at the end."""
    import json

    run_dir = tmp_path / "run"
    proc = _megatron_run(run_dir, 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [0, 1] and [r["weight_version"] for r in m] == [1, 2]
    assert all(r["sync/engines"] == 1 and math.isfinite(r["loss"]) for r in m)
    assert json.loads((run_dir / "checkpoints" / "step_2" / "meta.json").read_text())["backend"] == "megatron"


@pytest.mark.gpu
def test_megatron_run_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """`miles-hpc run` resumes from the megatron checkpoint of a previous run (megatron's distributed optimizer,
    `MegatronTrainer.load`; layouts and the optimizer's state are checked in test_megatron_ckpt.py)."""
    run_dir = tmp_path / "run"
    assert _megatron_run(run_dir, 2).returncode == 0
    proc = _megatron_run(run_dir, 4)
    assert proc.returncode == 0 and "resumed from" in proc.stdout + proc.stderr, proc.stderr[-3000:]
