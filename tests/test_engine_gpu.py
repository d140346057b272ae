"""The engine on a CUDA device (`-m gpu` tier): the Triton kernels against their torch references, and the engine
with kernels and CUDA graphs against its torch path (fp32: identical greedy tokens; bf16: close log-probs), across
batch sizes that need padding, prefix-cache hits, weight updates (graphs stay valid) and a MoE model (eager)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_core import greedy_req, make_ckpt, prompts, submit

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.decode_ops import TorchDecodeOps, paged_decode_reference
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import iter_hf_tensors, load_pretrained

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def random_paged(
    lens: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches [slots, hkv, d] with pages handed out in a random order, block tables int32, lengths int32."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    n_blocks = sum(need) + 3
    k = torch.randn(n_blocks * block_size, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(n_blocks * block_size, hkv, d, generator=g).to(device, dtype)
    perm = torch.randperm(n_blocks, generator=g)
    tables = torch.full((len(lens), max(need) + 2), n_blocks - 1, dtype=torch.int32)
    o = 0
    for i, nb in enumerate(need):
        tables[i, :nb] = perm[o : o + nb].to(torch.int32)
        o += nb
    return k, v, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


LENS = [1, 2, 15, 16, 17, 100, 333, 1000, 64, 7]


@pytest.mark.parametrize("hq,hkv,d", [(16, 8, 128), (32, 4, 128), (12, 4, 64), (4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_paged_decode_matches_reference(hq: int, hkv: int, d: int, dtype: torch.dtype, splits: int | None) -> None:
    check_paged_decode(hq, hkv, d, dtype, splits, DEVICE)


def check_paged_decode(hq: int, hkv: int, d: int, dtype: torch.dtype, splits: int | None, device: str) -> None:
    from miles_hpc.engine.triton_decode import paged_decode

    for block_size in (16, 4):
        k, v, tables, lens = random_paged(LENS, hkv, d, block_size, dtype, device, seed=hq + d)
        q = torch.randn(len(LENS), hq, d, generator=torch.Generator().manual_seed(1)).to(device, dtype)
        kw = dict(block_size=block_size, scale=d**-0.5)
        want = paged_decode_reference(q.double(), k.double(), v.double(), tables, lens, **kw)
        got = paged_decode(q, k, v, tables, lens, num_splits=splits, **kw)
        assert got.dtype == dtype and got.shape == q.shape
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        # A non-contiguous q (the layout the engine passes: [heads, rows, D] transposed) gives the same result.
        qt = q.transpose(0, 1).contiguous().transpose(0, 1)
        torch.testing.assert_close(paged_decode(qt, k, v, tables, lens, num_splits=splits, **kw), got)
        for block_n, warps, stages in ((32, 2, 2), (64, 2, 3)):  # the tiles `default_tiles` picks at larger batches
            tiled = paged_decode(
                q, k, v, tables, lens, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages, **kw
            )
            torch.testing.assert_close(tiled.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_ops_match_torch_ops(dtype: torch.dtype, qk_norm: bool) -> None:
    check_fused_ops(dtype, qk_norm, DEVICE)


def close_in_dtype(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 reduction order: in bf16 at most a rounding step apart and nearly always equal."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    g, w = got.double(), want.double()
    eps = torch.finfo(got.dtype).eps
    # Bounded by the row's largest value: RoPE subtracts products, so one rounding step of an operand can be many
    # steps of a small result.
    assert ((g - w).abs() <= 4 * eps * w.abs().amax(-1, keepdim=True) + 1e-6).all(), (g - w).abs().max()
    assert (g == w).double().mean() > 0.9, (g == w).double().mean()


def check_fused_ops(dtype: torch.dtype, qk_norm: bool, device: str) -> None:
    from miles_hpc.engine.triton_ops import TritonDecodeOps

    ref, fused = TorchDecodeOps(), TritonDecodeOps()
    g = torch.Generator().manual_seed(0)
    t, hidden, hq, hkv, d, slots = 37, 320, 8, 2, 64, 200

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    x, delta, w = rnd(t, hidden), rnd(t, hidden), rnd(hidden, scale=0.5) + 1
    close_in_dtype(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    r1, r2 = x.clone(), x.clone()
    close_in_dtype(fused.add_rms_norm(r1, delta, w, 1e-6), ref.add_rms_norm(r2, delta, w, 1e-6))
    torch.testing.assert_close(r1, r2, atol=0, rtol=0)

    gate, up = rnd(t, 3 * hidden, scale=3), rnd(t, 3 * hidden)
    close_in_dtype(fused.silu_mul(gate, up), ref.silu_mul(gate, up))

    q, k, v = rnd(t, hq * d), rnd(t, hkv * d), rnd(t, hkv * d)
    qn, kn = (rnd(d, scale=0.3) + 1, rnd(d, scale=0.3) + 1) if qk_norm else (None, None)
    pos = torch.randint(0, 5000, (t,), generator=g).to(device)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slot_ids = torch.randperm(slots, generator=g)[:t].to(device)
    caches = [torch.zeros(slots, hkv, d, dtype=dtype, device=device) for _ in range(4)]
    q1 = fused.qk_norm_rope_store(q, k, v, qn, kn, 1e-6, cos, sin, caches[0], caches[1], slot_ids)
    q2 = ref.qk_norm_rope_store(q, k, v, qn, kn, 1e-6, cos, sin, caches[2], caches[3], slot_ids)
    close_in_dtype(q1, q2)
    close_in_dtype(caches[0], caches[2])
    torch.testing.assert_close(caches[1], caches[3], atol=0, rtol=0)  # v is copied as is


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("qwen3"), "qwen3", 0)


def run(engine: Engine, ps: list[list[int]], n: int, **kw: object) -> dict[str, GenerateResult]:
    """Staggered arrivals and lengths, so decode batches take many sizes (padding) and mix with prefills; `kw`: more
    request fields."""
    results: dict[str, GenerateResult] = {}
    for i, p in enumerate(ps):
        submit(engine, results, greedy_req(str(i), p, n + (7 * i) % 13, **kw))
        if i % 3 == 2:
            for _ in range(3):
                engine.step()
    while engine.step():
        pass
    assert len(results) == len(ps)
    return results


def engine_on(ckpt: Path, dtype: str, **kw: object) -> Engine:
    cfg = EngineConfig(
        device=DEVICE, dtype=dtype, block_size=16, num_blocks=256, max_prefill_tokens=64, max_running_requests=32, **kw
    )  # type: ignore[arg-type]
    return Engine.from_pretrained(str(ckpt), cfg)


def shared_prompts() -> list[list[int]]:
    ps = prompts([1, 5, 16, 17, 40, 3, 90, 33, 2, 60, 21, 8, 130, 4, 50, 19, 70, 11], seed=7)
    ps.append(ps[12][:100] + [1, 2, 3])  # a prefix-cache hit
    return ps


def test_engine_fp32_graphs_match_torch_path(ckpt: Path) -> None:
    ps = shared_prompts()
    ref = run(engine_on(ckpt, "float32", triton_kernels=False), ps, 20)
    graphs = engine_on(ckpt, "float32")
    assert graphs.runner.decode is not None and graphs.runner.decode.graphs
    eager = engine_on(ckpt, "float32", cuda_graphs=False)
    assert eager.runner.decode is not None and not eager.runner.decode.graphs
    for engine in (graphs, eager):
        got = run(engine, ps, 20)
        for rid, r in ref.items():
            assert got[rid].output_ids == r.output_ids, rid
            assert max(abs(a - b) for a, b in zip(got[rid].output_logprobs, r.output_logprobs)) < 1e-3
    assert graphs.stats()["kv_blocks_used"] == 0 and got["18"].cached_tokens == ref["18"].cached_tokens


def test_engine_bf16_graphs_close_to_torch_path(ckpt: Path) -> None:
    # The test model is sharp (init std 0.2): bf16 rounding anywhere moves its log-probs by a few 1e-2, the torch
    # path's as much as the kernels' (measured against an fp32 run of the same bf16 weights), hence the bounds.
    ps = shared_prompts()
    ref = run(engine_on(ckpt, "bfloat16", triton_kernels=False), ps, 20)
    got = run(engine_on(ckpt, "bfloat16"), ps, 20)
    same, diffs = 0, []
    for rid, r in ref.items():
        # Compare log-probs up to the first differing token (after it the contexts differ).
        k = next((j for j, (a, b) in enumerate(zip(got[rid].output_ids, r.output_ids)) if a != b), len(r.output_ids))
        same += k == len(r.output_ids)
        diffs += [abs(a - b) for a, b in zip(got[rid].output_logprobs[:k], r.output_logprobs[:k])]
    assert sum(diffs) / len(diffs) < 2e-2 and max(diffs) < 0.2
    assert same >= 0.6 * len(ref)


def test_graphs_see_weight_updates(ckpt: Path, tmp_path: Path) -> None:
    other = make_ckpt(tmp_path / "other", "qwen3", 1)
    ps = prompts([5, 30, 12], seed=2)
    engine = engine_on(ckpt, "float32")
    run(engine, ps, 8)
    engine.update_weights(iter_hf_tensors(load_pretrained(other)), version="1")
    got = run(engine, ps, 8)
    want = run(engine_on(other, "float32", triton_kernels=False), ps, 8)
    assert all(got[rid].output_ids == w.output_ids for rid, w in want.items())


def test_moe_engine_with_fused_experts_decodes_in_graphs(tmp_path: Path) -> None:
    """Without `fused_moe` an MoE model decodes eagerly (the torch experts read their counts on the host); with it,
    its decode steps go through DecodeForward, captured in CUDA graphs, with the same tokens, log-probs and routed
    expert ids (R3) as the torch path."""
    moe = make_ckpt(tmp_path, "qwen3_moe", 0)
    ps = prompts([3, 20, 9, 41], seed=4)
    engine = engine_on(moe, "float32")
    assert engine.runner.decode is None and engine.runner.decode_kernel is not None
    assert engine.runner.fused_experts == 0  # EngineConfig.fused_moe is off by default
    fused = engine_on(moe, "float32", fused_moe=True)
    assert fused.runner.fused_experts == fused.model.num_moe_layers  # triton_moe's grouped GEMMs
    assert fused.runner.decode is not None and fused.runner.decode.graphs
    fused_eager = engine_on(moe, "float32", fused_moe=True, cuda_graphs=False)
    assert fused_eager.runner.decode is not None and not fused_eager.runner.decode.graphs
    want = run(engine_on(moe, "float32", triton_kernels=False), ps, 10, return_routed_experts=True)
    for e in (engine, fused, fused_eager):
        got = run(e, ps, 10, return_routed_experts=True)
        for rid, w in want.items():
            assert got[rid].output_ids == w.output_ids, rid
            assert max(abs(a - b) for a, b in zip(got[rid].output_logprobs, w.output_logprobs)) < 1e-4, rid
            assert got[rid].routed_experts is not None and w.routed_experts is not None
            assert (got[rid].routed_experts == w.routed_experts).all(), rid


def test_continued_prefill_chunk_runs_without_a_score_matrix() -> None:
    """A 4k-token chunk continued over 8k cached keys with grouped KV heads (bench_prefill's 16k prompts are chunks
    like this): the causal bias keeps it in a flash / memory-efficient kernel. The math kernel's fp32 scores alone
    would be 16 heads x 4k x 8k x 4 B = 2 GiB; its last rows equal a masked SDPA of those rows."""
    from miles_hpc.engine.kv_cache import KVCache
    from miles_hpc.engine.paged_attention import AttentionMetadata, PagedAttention

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, bs, start, n = 16, 8, 128, 16, 4096, 4096
    ctx = start + n
    cache = KVCache(
        num_layers=1, num_blocks=ctx // bs + 1, block_size=bs, kv_heads=hkv, head_dim=d, dtype=dt, device=dev
    )
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, ctx, d, device=dev, dtype=dt, generator=g) for h in (hq, hkv, hkv))
    tables = torch.randperm(ctx // bs, device=dev, generator=g).to(torch.int32)[None]
    first = AttentionMetadata.build([0], [start], tables, bs, dev)
    PagedAttention(cache, first)(
        q[:, :, :start], k[:, :, :start], v[:, :, :start], layer_idx=0, scale=d**-0.5, cu_seqlens=None
    )
    meta = AttentionMetadata.build([start], [n], tables, bs, dev)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = PagedAttention(cache, meta)(
        q[:, :, start:], k[:, :, start:], v[:, :, start:], layer_idx=0, scale=d**-0.5, cu_seqlens=None
    )
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < 256 << 20
    rows = slice(n - 64, n)
    mask = (torch.arange(ctx, device=dev)[None] <= torch.arange(ctx - 64, ctx, device=dev)[:, None])[None, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, ctx - 64 :].float(), k.float(), v.float(), attn_mask=mask, scale=d**-0.5, enable_gqa=True
    )
    torch.testing.assert_close(out[:, :, rows].float(), ref, rtol=2e-2, atol=2e-2)
