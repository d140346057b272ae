"""The fused decode path on CPU: `DecodeForward` with the torch reference ops behind `DecodeRunner` (eager, padded
batches) must reproduce the engine's plain path, padding rows must touch only the scratch block, and the paged-decode
reference must equal dense attention. The Triton kernels are compared with these references in test_engine_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine_core import drain, greedy_req, make_ckpt, prompts, submit

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.cuda_graphs import DecodeRunner, graph_batch_sizes
from miles_hpc.engine.decode_forward import DecodeForward, unsupported_reason
from miles_hpc.engine.decode_ops import TorchDecodeOps, paged_decode_reference
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import ModelConfig, build_model, iter_hf_tensors, load_pretrained, save_pretrained
from miles_hpc.models.presets import init_model, preset_config


def with_torch_decode(engine: Engine) -> Engine:
    """Route the engine's decode-only steps through DecodeForward + DecodeRunner (what CUDA runs, in torch)."""
    bm = engine.blocks
    engine.runner.decode = DecodeRunner(
        DecodeForward(engine.model, engine.cache, TorchDecodeOps()),
        max_batch=bm.tables.shape[0],
        table_width=bm.tables.shape[1],
        vocab_size=engine.vocab_size,
        scratch_block=bm.num_blocks,
        device=engine.device,
        dtype=engine.dtype,
        use_graphs=False,
    )
    return engine


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp(request.param), request.param, 0)


def run_all(engine: Engine, ps: list[list[int]], n: int, stagger: bool) -> dict[str, GenerateResult]:
    results: dict[str, GenerateResult] = {}
    if stagger:  # batch sizes change every few steps: 1, 2, 3 (padded to 4), 5 (padded to 8)...
        for i, p in enumerate(ps):
            submit(engine, results, greedy_req(str(i), p, n + 3 * i))
            for _ in range(2):
                engine.step()
    else:
        submit(engine, results, *(greedy_req(str(i), p, n) for i, p in enumerate(ps)))
    drain(engine, results)
    return results


@pytest.mark.parametrize("stagger", [False, True])
def test_fused_decode_matches_engine(ckpt: Path, stagger: bool) -> None:
    cfg = EngineConfig(block_size=4, max_prefill_tokens=24)
    ps = prompts([1, 5, 9, 16, 23], seed=3)
    ref = run_all(Engine.from_pretrained(str(ckpt), cfg), ps, 12, stagger)
    engine = with_torch_decode(Engine.from_pretrained(str(ckpt), cfg))
    calls = []
    inner = engine.runner.decode.forward  # type: ignore[union-attr]
    engine.runner.decode.forward = lambda *a: (calls.append(a[0].shape[0]), inner(*a))[1]  # type: ignore[union-attr]
    got = run_all(engine, ps, 12, stagger)
    assert calls and all(c in graph_batch_sizes(256) for c in calls)  # the decode path ran, padded
    for rid, r in ref.items():
        assert got[rid].output_ids == r.output_ids, rid
        assert max(abs(a - b) for a, b in zip(got[rid].output_logprobs, r.output_logprobs)) < 1e-5
    assert engine.stats()["kv_blocks_used"] == 0


def test_weight_updates_reach_the_fused_projections(ckpt: Path, tmp_path: Path) -> None:
    engine = with_torch_decode(Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4)))
    q = engine.model.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == engine.runner.decode.forward.qkv[0][0].data_ptr()  # type: ignore[union-attr]
    other = load_pretrained(make_ckpt(tmp_path, engine.model.config.model_type, 1))
    engine.update_weights(iter_hf_tensors(other), version="1")
    ps = prompts([4, 11, 2], seed=5)
    want = run_all(Engine.from_pretrained(str(tmp_path), EngineConfig(block_size=4)), ps, 8, stagger=False)
    got = run_all(engine, ps, 8, stagger=False)
    assert all(got[rid].output_ids == w.output_ids for rid, w in want.items())
    assert engine.checksums() == Engine.from_pretrained(str(tmp_path), EngineConfig()).checksums()


def test_padding_rows_write_only_the_scratch_block(ckpt: Path) -> None:
    engine = with_torch_decode(Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, num_blocks=12)))
    decode = engine.runner.decode
    assert decode is not None and engine.cache.num_blocks == engine.blocks.num_blocks + 1
    for t in (engine.cache.k, engine.cache.v):
        t.normal_()
    before_k, before_v = engine.cache.k.clone(), engine.cache.v.clone()
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [9, 2, 11]], dtype=torch.int32)
    positions = [6, 1, 10]  # slots 7*4+2, 5*4+1, 11*4+2
    logits = decode([1, 2, 3], positions, tables)  # 3 rows run as 4: one padding row
    assert logits.shape == (3, engine.vocab_size) and decode.padded(3) == 4
    changed = set()
    for before, after in ((before_k, engine.cache.k), (before_v, engine.cache.v)):
        diff = (before != after).flatten(3).any(-1)  # [layer, block, offset]
        changed |= {(int(b), int(o)) for _, b, o in diff.nonzero().tolist()}
    scratch = engine.blocks.num_blocks
    assert changed == {(7, 2), (5, 1), (11, 2), (scratch, 0)}


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1000)[-1] == 256


def test_unsupported_models_stay_eager(tmp_path: Path) -> None:
    moe = Engine.from_pretrained(str(make_ckpt(tmp_path / "moe", "qwen3_moe", 0)), EngineConfig())
    assert unsupported_reason(moe.model) is None  # the runner captures MoE models only with fused experts (GPU)
    assert moe.runner.decode is None and moe.runner.decode_kernel is None  # CPU: no kernels either
    mla = Engine.from_pretrained(str(make_ckpt(tmp_path / "mla", "deepseek_v3", 0)), EngineConfig())
    assert "MLA" in (unsupported_reason(mla.model) or "")


def moe_ckpt(out: Path, mlp_only_layers: list[int]) -> Path:
    """engine_support.make_ckpt's Qwen3-MoE with the layers `mlp_only_layers` dense."""
    init_model("qwen3_moe", "tiny", out, seed=0)
    hf = preset_config("qwen3_moe", "tiny")
    hf.update(initializer_range=0.2, tie_word_embeddings=False, mlp_only_layers=mlp_only_layers)
    torch.manual_seed(0)
    save_pretrained(build_model(ModelConfig.from_hf_dict(hf)), out)
    return out


@pytest.mark.parametrize("dense", [[], [0]])
def test_fused_decode_runs_moe_layers_and_records_their_routing(dense: list[int], tmp_path: Path) -> None:
    """An MoE model's decode through DecodeForward (its blocks' router and experts; a dense layer among them)
    gives the eager engine's tokens and log-probs, and the same routed expert ids for R3, decode rows included."""
    ckpt = moe_ckpt(tmp_path, dense)
    cfg = EngineConfig(block_size=4, max_prefill_tokens=24)
    ps = prompts([1, 5, 9, 16, 23], seed=3)

    def generate(engine: Engine) -> dict[str, GenerateResult]:
        results: dict[str, GenerateResult] = {}
        for i, p in enumerate(ps):
            req = greedy_req(str(i), p, 10 + 3 * i, return_logprob=True, return_routed_experts=True)
            submit(engine, results, req)
            for _ in range(2):
                engine.step()
        drain(engine, results)
        return results

    ref = generate(Engine.from_pretrained(str(ckpt), cfg))
    engine = with_torch_decode(Engine.from_pretrained(str(ckpt), cfg))
    rows = []
    inner = engine.runner.decode.forward  # type: ignore[union-attr]
    engine.runner.decode.forward = lambda *a: (rows.append(a[0].shape[0]), inner(*a))[1]  # type: ignore[union-attr]
    got = generate(engine)
    assert sum(rows) > 40 and engine.model.num_moe_layers == 2 - len(dense)  # most tokens decoded there
    for rid, r in ref.items():
        assert got[rid].output_ids == r.output_ids, rid
        assert max(abs(a - b) for a, b in zip(got[rid].output_logprobs, r.output_logprobs)) < 1e-5
        assert r.routed_experts is not None and got[rid].routed_experts is not None
        assert r.routed_experts.shape[0] == len(ps[int(rid)]) + len(r.output_ids) - 1
        np.testing.assert_array_equal(got[rid].routed_experts, r.routed_experts)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 32), (6, 2, 64)])
def test_paged_decode_reference_is_dense_attention(hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(hq * d)
    bs, n_blocks = 4, 40
    k_cache = torch.randn(n_blocks * bs, hkv, d, generator=g, dtype=torch.float64)
    v_cache = torch.randn(n_blocks * bs, hkv, d, generator=g, dtype=torch.float64)
    lens = [1, 3, 4, 5, 17, 30]
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    o = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[o : o + nb].to(torch.int32)
        o += nb
    q = torch.randn(len(lens), hq, d, generator=g, dtype=torch.float64)
    got = paged_decode_reference(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), block_size=bs, scale=d**-0.5
    )
    for i, n in enumerate(lens):
        slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
        k = k_cache[slots].transpose(0, 1).repeat_interleave(hq // hkv, 0)  # [hq, n, d]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(hq // hkv, 0)
        want = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=d**-0.5)[:, 0]
        torch.testing.assert_close(got[i], want)


def test_equal_length_prompts_prefill_as_one_batch(ckpt: Path) -> None:
    # Adjacent fresh prompts of equal length share one SDPA call; mixed with other lengths and decodes.
    from test_engine_core import check_greedy

    from miles_hpc.models import load_pretrained as load

    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=64))
    ps = prompts([9, 9, 9, 5, 9, 9, 3, 3], seed=11)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 6) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(load(ckpt), ps, results, 6)


def test_adjacent_equal_fresh_prefills_are_grouped() -> None:
    from miles_hpc.engine.paged_attention import AttentionMetadata

    meta = AttentionMetadata.build(
        [0, 0, 0, 7, 0, 0, 3], [4, 4, 4, 1, 4, 2, 5], torch.zeros(7, 4, dtype=torch.int32), 4, torch.device("cpu")
    )
    got = [(p.q_start, p.q_end, p.count, p.key_slots is None) for p in meta.prefills]
    assert got == [(0, 12, 3, True), (13, 17, 1, True), (17, 19, 1, True), (19, 24, 1, False)]


@pytest.mark.parametrize("extend", [0, 8])
def test_short_prefills_run_as_rows_of_the_fused_step(ckpt: Path, extend: int) -> None:
    # Cached-prefix requests prefill only their new suffix: with fused_extend_tokens >= the suffix it runs as rows
    # of the fused step (each row attends the cache up to its own position) and must match the plain engine.
    cfg = EngineConfig(block_size=4, fused_extend_tokens=extend)
    base = prompts([17], seed=21)[0]
    tails = prompts([3, 6, 1], seed=22)
    ps = [base[:16] + t for t in tails]
    ref_engine = Engine.from_pretrained(str(ckpt), cfg)
    engine = with_torch_decode(Engine.from_pretrained(str(ckpt), cfg))
    rows_per_call: list[int] = []
    inner = engine.runner.decode.forward  # type: ignore[union-attr]
    engine.runner.decode.forward = lambda *a: (
        rows_per_call.append(int((a[2][:, 0] != engine.blocks.num_blocks).sum())),  # type: ignore[union-attr]
        inner(*a),
    )[1]
    for e in (ref_engine, engine):
        run_all(e, [base], 2, stagger=False)  # caches the first 16 tokens (4 full blocks)
    want = run_all(ref_engine, ps, 5, stagger=True)
    rows_per_call.clear()
    got = run_all(engine, ps, 5, stagger=True)
    assert all(r.cached_tokens == 16 for r in got.values())
    for rid, r in want.items():
        assert got[rid].output_ids == r.output_ids, rid
        assert max(abs(a - b) for a, b in zip(got[rid].output_logprobs, r.output_logprobs)) < 1e-5
    # The 6-token suffix took one fused call with 6+ real rows, or none (extend=0: eager prefill, then decodes).
    assert (max(rows_per_call) >= 6) == (extend >= 6)
