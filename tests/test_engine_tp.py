"""The tensor-parallel embedded engine (engine/tp.py, engine/tp_layout.py): layouts as pure functions over many
configs, TP 2 engines against TP 1 (greedy tokens, log-probs, MoE routing, DSA selections, prefix cache, weight
updates, checksums) for every family, `miles-hpc serve --tp-size 2` over HTTP, and a dying rank."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from engine_support import make_ckpt, run
from server_fixtures import acall, children_of, start_server

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.tp import TPShard
from miles_hpc.engine.tp_layout import check_tp, local_config
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models import CausalLM, ModelConfig, build_model, iter_hf_tensors, save_pretrained
from miles_hpc.models.presets import ARCHS, preset_config

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "deepseek_v32")


def _config(arch: str, **changes: Any) -> ModelConfig:
    hf = preset_config(arch, "tiny")
    hf.update(changes)
    return ModelConfig.from_hf_dict(hf)


# Shapes the presets do not have: a KV head per two ranks, an odd vocabulary, tied embeddings, biases on the
# row-parallel layers, MLA without the query compression.
VARIANTS = [
    *((arch, {}) for arch in ARCHS),
    ("qwen3", {"num_key_value_heads": 1, "vocab_size": 321, "tie_word_embeddings": True}),
    ("llama", {"attention_bias": True, "mlp_bias": True, "num_attention_heads": 8, "num_key_value_heads": 8}),
    ("qwen2", {"num_key_value_heads": 4, "vocab_size": 333}),
    ("deepseek_v3", {"q_lora_rank": None, "vocab_size": 322}),
    ("qwen3_moe", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
]


def _fits(arch: str, changes: dict[str, Any], tp: int) -> bool:
    try:
        check_tp(_config(arch, **changes), tp)
    except ValueError:
        return False  # the refusals are tested below
    return True


LAYOUT_CASES = [(a, c, tp) for a, c in VARIANTS for tp in (2, 4) if _fits(a, c, tp)]


@pytest.mark.parametrize(
    ("arch", "changes", "tp"), LAYOUT_CASES, ids=[f"{a}-{'-'.join(c)}-tp{t}" for a, c, t in LAYOUT_CASES]
)
def test_rank_parts_fit_the_rank_model_and_assemble_the_whole(arch: str, changes: dict[str, Any], tp: int) -> None:
    """Every rank's part of every HF tensor has its rank model's shape, and the parts assemble the whole tensor
    (the layout is `planner.transfer.engine_layout`'s, the p2p plan's)."""
    mc = _config(arch, **changes)
    torch.manual_seed(0)
    model = build_model(mc)
    for p in model.parameters():  # biases too (a fresh model's are zero)
        p.data.normal_()
    full = dict(iter_hf_tensors(model))
    shards = [TPShard(mc, tp, r) for r in range(tp)]
    with torch.device("meta"):
        local = {n: tuple(t.shape) for n, t in iter_hf_tensors(CausalLM(local_config(mc, tp)))}
    assert local.keys() == full.keys()
    for name, t in full.items():
        parts = [s.local(name, t) for s in shards]
        assert all(tuple(p.shape) == local[name] for p in parts), name
        assert torch.equal(shards[0].assemble(name, parts), t), name
        if name.endswith(("o_proj.bias", "down_proj.bias")):  # summed partial outputs: rank 0 adds the bias
            assert all(not p.any() for p in parts[1:]), name


def test_tp_sizes_that_do_not_fit_are_refused_by_field() -> None:
    cases = [
        (_config("qwen3"), 3, "num_attention_heads=4"),
        (_config("qwen3", num_attention_heads=6, num_key_value_heads=2), 3, None),  # 3 | 6, kv 2 vs 3: refused
        (_config("qwen3", num_attention_heads=8, intermediate_size=190), 4, "intermediate_size=190"),
        (_config("qwen3_moe", num_attention_heads=8, num_key_value_heads=8, moe_intermediate_size=46), 4, "moe_int"),
        (_config("qwen3"), 0, "tp_size must be a positive int"),
    ]
    for mc, tp, needle in cases:
        with pytest.raises(ValueError) as e:
            check_tp(mc, tp)
        assert needle is None or needle in str(e.value)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp(_config("qwen3", num_attention_heads=6, num_key_value_heads=2), 3)


def test_engine_config_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tp_size must be a positive int"):
        EngineConfig(tp_size=0)
    ckpt = make_ckpt(tmp_path / "m", "qwen3", 0)
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        Engine.from_pretrained(str(ckpt), EngineConfig(tp_size=3))  # refused before any rank starts
    with pytest.raises(ValueError, match="zero-KL.*tp_size 1"):
        Engine.from_pretrained(str(ckpt), EngineConfig(tp_size=2, batch_invariant=True))
    from miles_hpc.models import load_pretrained

    with pytest.raises(ValueError, match="made by Engine.from_pretrained"):
        Engine(load_pretrained(str(ckpt)), EngineConfig(tp_size=2))


# ---------------------------------------------------------------------- engines: TP 2 == TP 1
def _requests(arch: str) -> list[GenerateRequest]:
    """Greedy requests with prompt log-probs, MoE routing and DSA selections; prompts longer than the DSA presets'
    index_topk (16), and two sharing a 40-token prefix (the second hits the prefix cache)."""
    mc = _config(arch)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, mc.vocab_size, (40,), generator=g).tolist()
    prompts = [prefix + [7, 9], prefix + [11], torch.randint(3, mc.vocab_size, (5,), generator=g).tolist()]
    return [
        GenerateRequest(
            rid=f"r{i}",
            input_ids=tuple(p),
            sampling=SamplingParams(max_new_tokens=10, temperature=0.0),
            return_logprob=True,
            logprob_start_len=-1 if i == 1 else 0,  # prompt rows owed log-probs are never served from the cache
            return_routed_experts=mc.num_experts > 0,
            return_indexer_topk=mc.is_dsa,
        )
        for i, p in enumerate(prompts)
    ]


def _serve(engine: Engine, arch: str) -> dict[str, GenerateResult]:
    reqs = _requests(arch)
    out = run(engine, reqs[0])  # first alone, so the second finds its prefix cached
    return {**out, **run(engine, *reqs[1:])}


def _assert_same(a: dict[str, GenerateResult], b: dict[str, GenerateResult]) -> None:
    for rid, ra in a.items():
        rb = b[rid]
        assert ra.output_ids == rb.output_ids, rid
        assert max(abs(x - y) for x, y in zip(ra.output_logprobs, rb.output_logprobs, strict=True)) < 1e-4, rid
        pa, pb = ra.input_logprobs or [], rb.input_logprobs or []
        assert len(pa) == len(pb) and all(x is None and y is None or abs(x - y) < 1e-4 for x, y in zip(pa, pb)), rid
        for field in ("routed_experts", "indexer_topk"):
            xa, xb = getattr(ra, field), getattr(rb, field)
            assert (xa is None) == (xb is None), (rid, field)
            if xa is not None:
                assert (xa == xb).all(), (rid, field)
    assert a["r1"].cached_tokens > 0 and a["r1"].cached_tokens == b["r1"].cached_tokens


def _engine(ckpt: Path, arch: str, tp: int) -> Engine:
    cfg = EngineConfig(dtype="float32", tp_size=tp, max_total_tokens=4096, record_indexer_topk=_config(arch).is_dsa)
    return Engine.from_pretrained(str(ckpt), cfg)


@pytest.mark.process
@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_engine_serves_what_tp1_serves(arch: str, tmp_path: Path) -> None:
    """Same greedy tokens, log-probs within 1e-4 (fp32), same expert ids and DSA selections; after an update from
    disk (and one by HF-named tensors) the same again, with the checksums of TP 1's weights."""
    ck1, ck2 = make_ckpt(tmp_path / "a", arch, 0), make_ckpt(tmp_path / "b", arch, 1)
    ref = _engine(ck1, arch, 1)
    tp2 = _engine(ck1, arch, 2)
    try:
        _assert_same(_serve(tp2, arch), _serve(ref, arch))
        assert tp2.checksums() == ref.checksums()
        tp2.update_weights_from_disk(str(ck2), version="2")
        ref.update_weights_from_disk(str(ck2), version="2")
        _assert_same(_serve(tp2, arch), _serve(ref, arch))
        assert tp2.checksums() == ref.checksums()
        named = dict(iter_hf_tensors(_model(arch, 3)))
        for e in (tp2, ref):
            e.update_weights(list(named.items()), version="3")
        _assert_same(_serve(tp2, arch), _serve(ref, arch))
        name, t = next(iter(named.items()))
        with pytest.raises(RequestError, match="does not match the model's"):
            tp2.update_weights([(name, t[:-1])], version=None)
        with pytest.raises(RequestError, match="no such tensor"):
            tp2.update_weights([("model.layers.0.nope.weight", t)], version=None)
        assert tp2.model_info()["tp_size"] == 2
    finally:
        tp2.shutdown()
        ref.shutdown()
    assert all(p.poll() is not None for p in tp2.tp.procs)  # type: ignore[union-attr]


@pytest.mark.process
def test_tp2_row_parallel_biases_are_added_once(tmp_path: Path) -> None:
    """o_proj / down_proj biases (llama's attention_bias, mlp_bias) with random values: rank 0 adds them."""
    torch.manual_seed(0)
    model = build_model(_config("llama", attention_bias=True, mlp_bias=True, initializer_range=0.2))
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.data.normal_(0.0, 0.5)
    ckpt = make_ckpt(tmp_path / "m", "llama", 0)
    save_pretrained(model, ckpt)
    ref, tp2 = _engine(ckpt, "llama", 1), _engine(ckpt, "llama", 2)
    try:
        _assert_same(_serve(tp2, "llama"), _serve(ref, "llama"))
    finally:
        tp2.shutdown()
        ref.shutdown()


def _model(arch: str, seed: int) -> CausalLM:
    torch.manual_seed(seed)
    hf = preset_config(arch, "tiny")
    hf.update(initializer_range=0.2, tie_word_embeddings=False)
    return build_model(ModelConfig.from_hf_dict(hf))


# ---------------------------------------------------------------------- over HTTP, and a rank dying
def _generate(url: str, ids: list[int]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        async with aiohttp.ClientSession() as s:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                "return_logprob": True,
            }
            reply = await acall(s, "POST", f"{url}/generate", body)
            assert reply.status == 200, reply.text
            info = await acall(s, "GET", f"{url}/get_model_info")
            return {**reply.body, "info": info.body}

    return asyncio.run(main())


@pytest.mark.process
def test_serve_tp2_over_http_and_a_dead_rank_ends_the_server(tmp_path: Path) -> None:
    """`miles-hpc serve --tp-size 2` answers /generate as TP 1 does; when its rank 1 is killed the server exits
    non-zero naming the rank (its supervisor restarts it); when rank 0 is killed, rank 1 exits too."""
    ckpt = make_ckpt(tmp_path / "m", "qwen3", 0)
    ids = list(range(20, 40))
    ref = _engine(ckpt, "qwen3", 1)
    want = run(
        ref,
        GenerateRequest(
            rid="x",
            input_ids=tuple(ids),
            sampling=SamplingParams(max_new_tokens=6, temperature=0.0),
            return_logprob=True,
        ),
    )["x"]
    ref.shutdown()
    server = start_server(ckpt, tmp_path / "s1", "--tp-size", "2", "--dtype", "float32")
    try:
        assert server.info["tp_size"] == 2
        got = _generate(server.url, ids)
        assert got["output_ids"] == want.output_ids and got["info"]["tp_size"] == 2
        lps = [x[0] for x in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(lps, want.output_logprobs, strict=True)) < 1e-4
        (rank1,) = children_of(server.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert "tensor-parallel rank 1 of this engine exited" in server.log_tail()
    finally:
        server.stop(signal.SIGKILL)
    server = start_server(ckpt, tmp_path / "s2", "--tp-size", "2")
    (rank1,) = children_of(server.proc.pid)
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.exists(f"/proc/{rank1}") and _state(rank1) != "Z":
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{rank1}") or _state(rank1) == "Z", "rank 1 outlived rank 0"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
