"""Paged KV cache: block allocator + prefix index invariants, the paged attention backend against plain SDPA,
and prefix caching end to end (cached_tokens, hit rate, flush, invalidation by a weight update)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt, run
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.kv_cache import BlockManager, KVCache, block_key
from miles_hpc.engine.paged_attention import AttentionMetadata, PagedAttention
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import iter_hf_tensors, load_pretrained, sdpa_attention


def manager(num_blocks: int = 8, block_size: int = 4) -> BlockManager:
    return BlockManager(num_blocks, block_size, max_rows=4, max_blocks_per_seq=16)


def test_block_key_chains_over_parent_and_tokens() -> None:
    a = block_key(None, [1, 2, 3, 4])
    assert a == block_key(None, [1, 2, 3, 4]) and len(a) == 16
    assert a != block_key(None, [1, 2, 3, 5])
    assert block_key(a, [5, 6, 7, 8]) != block_key(None, [5, 6, 7, 8])


def test_allocator_ref_counts_lru_and_flush() -> None:
    bm = manager(4)
    x = bm.allocate(3)
    assert x == [0, 1, 2] and bm.num_available() == 1 and bm.allocate(2) is None
    keys = [block_key(None, [1] * 4), block_key(None, [2] * 4)]
    bm.register(x[0], keys[0])
    bm.register(x[1], keys[1])
    bm.register(x[2], keys[0])  # duplicate content: stays private, the first block keeps the key
    assert bm.key[x[2]] is None
    assert bm.match(keys) == [0, 1] and bm.ref[0] == 2
    bm.release([1, 0])
    bm.release(x[::-1])  # freed in reverse: block 1 becomes least recently used before block 0
    assert bm.ref[:3] == [0, 0, 0] and list(bm.cached_free) == [1, 0] and bm.num_available() == 4
    # Fresh blocks come from the free list first, then the LRU cached block (1) is evicted and forgets its key.
    assert bm.allocate(3) == [2, 3, 1] and keys[1] not in bm.index and bm.match(keys) == [0]
    bm.flush()
    assert bm.index == {} and bm.epoch == 1 and bm.match(keys) == []
    bm.release([0, 3, 2, 1])
    assert sorted(bm.free) == [0, 1, 2, 3] and not bm.cached_free


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "match", "flush"]), st.integers(1, 4)), max_size=40))
def test_allocator_invariants_hold_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    bm = manager(6, 2)
    held: list[list[int]] = []
    n_keys = 0
    for op, n in ops:
        if op == "alloc":
            got = bm.allocate(n)
            if got is not None:
                for b in got:  # pretend each block filled with distinct content
                    bm.register(b, block_key(None, [n_keys, n_keys]))
                    n_keys += 1
                held.append(got)
        elif op == "release" and held:
            bm.release(held.pop(n % len(held))[::-1])
        elif op == "match":
            held.append(bm.match([block_key(None, [k, k]) for k in range(max(0, n_keys - n), n_keys)]))
        elif op == "flush":
            bm.flush()
        refs = [0] * 6
        for blocks in held:
            for b in blocks:
                refs[b] += 1
        assert bm.ref == refs
        free, cached = set(bm.free), set(bm.cached_free)
        assert len(free) == len(bm.free) and not free & cached
        assert free | cached == {b for b in range(6) if refs[b] == 0}
        assert all(bm.key[b] is not None for b in cached) and all(bm.key[b] is None for b in free)
        assert all(bm.key[b] == k for k, b in bm.index.items())
        assert {b for b in range(6) if bm.key[b] is not None} == set(bm.index.values())


@pytest.mark.parametrize("hq", [4, 2])
def test_paged_attention_equals_causal_sdpa(hq: int) -> None:
    """Three sequences written in two steps (prefill chunk, then a second chunk / one decode token) attend exactly
    like causal SDPA over each full sequence."""
    torch.manual_seed(0)
    hkv, d, bs = 2, 8, 4
    cache = KVCache(
        num_layers=1,
        num_blocks=16,
        block_size=bs,
        kv_heads=hkv,
        head_dim=d,
        dtype=torch.float64,
        device=torch.device("cpu"),
    )
    lens = [9, 5, 12]
    qs = [torch.randn(1, hq, n, d, dtype=torch.float64) for n in lens]
    ks = [torch.randn(1, hkv, n, d, dtype=torch.float64) for n in lens]
    vs = [torch.randn(1, hkv, n, d, dtype=torch.float64) for n in lens]
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 0, 0], [9, 8, 10, 11]], dtype=torch.int32)
    splits = [6, 4, 11]  # step 1 writes tokens [0, s), step 2 the rest (the last two are single decode tokens)
    out_parts: list[list[torch.Tensor]] = [[], [], []]
    for step in range(2):
        starts = [0 if step == 0 else s for s in splits]
        ends = splits if step == 0 else lens
        meta = AttentionMetadata.build(starts, [e - s for s, e in zip(starts, ends)], tables, bs, torch.device("cpu"))
        cat = [torch.cat([t[:, :, s:e] for t, s, e in zip(ts, starts, ends)], dim=2) for ts in (qs, ks, vs)]
        out = PagedAttention(cache, meta)(*cat, layer_idx=0, scale=d**-0.5, cu_seqlens=None)
        o = 0
        for i, (s, e) in enumerate(zip(starts, ends)):
            out_parts[i].append(out[:, :, o : o + e - s])
            o += e - s
    for i in range(3):
        ref = sdpa_attention(qs[i], ks[i], vs[i], layer_idx=0, scale=d**-0.5, cu_seqlens=None)
        torch.testing.assert_close(torch.cat(out_parts[i], dim=2), ref, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- prefix caching end to end


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("qwen3kv"), "qwen3", 1)


def greedy(rid: str, prompt: list[int], n: int = 6) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), sampling=sp, return_logprob=True)


def test_shared_prefix_is_reused_with_identical_outputs(ckpt: Path) -> None:
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (45,), generator=g).tolist()
    a, b = shared + [1, 2, 3], shared + [9, 8]
    cold = run(
        Engine.from_pretrained(str(ckpt), EngineConfig(block_size=8, enable_prefix_cache=False)), greedy("b", b)
    )["b"]
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=8))
    first = run(engine, greedy("a", a))["a"]
    assert first.cached_tokens == 0
    warm = run(engine, greedy("b", b))["b"]
    assert warm.cached_tokens == 40  # the 5 full blocks of the 45 shared tokens
    assert warm.output_ids == cold.output_ids
    assert max(abs(x - y) for x, y in zip(warm.output_logprobs, cold.output_logprobs)) < 1e-5
    stats = engine.stats()
    assert stats["cached_tokens_total"] == 40 and stats["cache_hit_rate"] == pytest.approx(40 / (48 + 47))
    # The same prompt again reuses all but the block holding its last token; the output is unchanged.
    again = run(engine, greedy("a2", a))["a2"]
    assert again.cached_tokens == 40 and again.output_ids == first.output_ids
    # Identical prompts arriving together: the second waits while the first computes the shared blocks, then hits
    # them (without that wait both would compute them: the step after a weight update flushed the cache).
    both = run(engine, greedy("x", [5] * 20), greedy("y", [5] * 20))
    assert both["x"].output_ids == both["y"].output_ids and both["y"].cached_tokens == 16
    assert run(engine, greedy("z", [5] * 20))["z"].cached_tokens == 16


def test_flush_cache_and_weight_update_drop_the_prefix_cache(ckpt: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    p = list(range(30))
    run(engine, greedy("a", p))
    assert engine.stats()["kv_blocks_cached"] > 0
    assert engine.flush_cache() is True and engine.stats()["kv_blocks_cached"] == 0
    assert run(engine, greedy("b", p))["b"].cached_tokens == 0
    assert run(engine, greedy("c", p))["c"].cached_tokens == 28
    engine.update_weights(iter_hf_tensors(load_pretrained(ckpt)), version="v1")
    assert run(engine, greedy("d", p))["d"].cached_tokens == 0
    # flush_cache=False keeps the index (SGLang semantics: a later update of the same sync flushes).
    engine.update_weights(iter_hf_tensors(load_pretrained(ckpt)), version="v2", flush_cache=False)
    assert run(engine, greedy("e", p))["e"].cached_tokens == 28


def test_a_retracted_request_reports_its_first_admissions_hits(ckpt: Path) -> None:
    """cached_tokens as SGLang counts it: the prompt tokens the request's first admission found cached; its re-prefill
    after a retraction (a weight update in pause mode retract) counts in the engine's totals, not in the request's."""
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    p = list(range(30))
    run(engine, greedy("warm", p))
    results: dict = {}
    engine.submit(greedy("r", p, 12), lambda res: results.__setitem__(res.rid, res))
    for _ in range(3):
        engine.step()
    before = engine.stats()["cached_tokens_total"]
    engine.pause("retract")
    engine.resume()
    while engine.step():
        pass
    assert results["r"].num_retractions == 1 and results["r"].cached_tokens == 28
    assert engine.stats()["cached_tokens_total"] > before  # the re-prefill hit the blocks it had published


def test_flush_refused_while_requests_live(ckpt: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    run(engine, greedy("a", list(range(12))))
    engine.submit(greedy("b", list(range(12)), 20), lambda r: None)
    engine.step()
    assert engine.flush_cache() is False and engine.stats()["kv_blocks_cached"] + engine.stats()["kv_blocks_used"] > 0
    engine.abort(None)
    assert engine.flush_cache() is True


@settings(max_examples=12, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=6),
    st.integers(4, 24),
    st.sampled_from([2, 4, 8]),
    st.integers(4, 40),
    st.booleans(),
)
def test_scheduler_under_pressure_matches_roomy_engine(
    ckpt: Path, reqs: list[tuple[int, int, int]], num_blocks: int, block_size: int, budget: int, prefix: bool
) -> None:
    """Random prompts sharing prefixes, a cache from tight to roomy, any prefill budget: every request finishes
    with the tokens a roomy engine without prefix caching produces, and every block comes back."""
    g = torch.Generator().manual_seed(len(reqs) * 1000 + num_blocks)
    stems = [torch.randint(0, 256, (24,), generator=g).tolist() for _ in range(3)]
    prompts = [stems[s][:n] + [s + 1] for s, n, _ in reqs]
    lengths = [m for _, _, m in reqs]
    capacity = num_blocks * block_size
    fits = [i for i, (p, m) in enumerate(zip(prompts, lengths)) if len(p) + m <= capacity]
    cfg = EngineConfig(
        block_size=block_size, num_blocks=num_blocks, max_prefill_tokens=budget, enable_prefix_cache=prefix
    )
    tight = Engine.from_pretrained(str(ckpt), cfg)
    got = run(tight, *(greedy(str(i), prompts[i], lengths[i]) for i in fits))
    want = run(_roomy(ckpt), *(greedy(str(i), prompts[i], lengths[i]) for i in fits))
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}
    assert all(len(r.output_logprobs) == len(r.output_ids) for r in got.values())
    stats = tight.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running_reqs"] == stats["num_queue_reqs"] == 0
    assert len(tight.blocks.free_rows) == tight.config.max_running_requests


_ROOMY: dict[str, Engine] = {}


def _roomy(ckpt: Path) -> Engine:
    if str(ckpt) not in _ROOMY:
        _ROOMY[str(ckpt)] = Engine.from_pretrained(str(ckpt), EngineConfig(enable_prefix_cache=False))
    return _ROOMY[str(ckpt)]
