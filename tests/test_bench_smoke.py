"""The multi-device benchmarks (issue 10's commands) run end to end on the CPU at toy sizes, so a GPU machine's time
is not the first place they break: each prints JSON lines with its figures and its same-run reference."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]


def bench(*argv: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_collective_bandwidth_follows_the_bus_definition() -> None:
    (line,) = bench("benchmarks/collective_bw.py", "--ranks", "3", "--mb", "4", "--iters", "2")
    assert line["backend"] == "gloo" and line["ranks"] == 3 and line["bytes"] == 4 << 20
    assert abs(line["busbw_gbps"] - line["algbw_gbps"] * 4 / 3) < 0.002  # busbw = algbw x 2 (n - 1) / n


def test_loop_sync_bench_reports_each_strategy_and_its_references() -> None:
    lines = bench(
        "benchmarks/bench_loop_sync.py",
        "--size",
        "small",
        "--steps",
        "2",
        "--trainer-ranks",
        "2",
        "--engines",
        "1",
        "--strategies",
        "broadcast,p2p",
    )
    runs = [x for x in lines if x["bench"] == "loop_sync"]
    assert [x["strategy"] for x in runs] == ["broadcast", "p2p"]
    for x in runs:  # every version verified by the engines before the next step
        assert x["weight_version"] == 2 and x["steps"] == 2 and x["sync_s"] > 0 and x["max_abs_logprob_diff"] < 1e-4
    assert {x["bench"] for x in lines} == {"loop_sync", "collective", "memcpy"}


def test_train_bench_runs_two_ranks_on_the_cpu() -> None:
    (line,) = bench(
        "benchmarks/bench_train.py",
        "--device",
        "cpu",
        "--shape",
        "small",
        "--seq",
        "64",
        "--batch",
        "1",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--sides",
        "eager,hf",
        "--ranks",
        "2",
    )
    assert line["side"] == "miles_hpc_fsdp2" and line["ranks"] == 2 and "mfu" not in line
    assert abs(line["tokens_per_s"] * line["step_s"] - 2 * 64) < 0.1  # both ranks' tokens (step_s is rounded)


def test_dsa_bench_reports_decode_of_both_attentions_and_a_train_step() -> None:
    lines = bench(
        *("benchmarks/bench_dsa.py", "--toy", "--layers", "2", "--experts", "8", "--batch", "2"),
        *("--prompt-len", "96", "--new-tokens", "8", "--train-seq", "96", "--steps", "1"),
    )
    decode = {line["attention"]: line for line in lines if line["result"] == "decode"}
    assert set(decode) == {"dsa", "dense_mla"}
    for line in decode.values():
        assert line["decode_tok_s"] > 0 and 0 < line["cache_bytes_per_token"] < line["expanded_bytes_per_token"]
    # DSA caches the indexer's key beside MLA's latent: more bytes per token than dense MLA, far fewer than expanded.
    assert decode["dsa"]["cache_bytes_per_token"] > decode["dense_mla"]["cache_bytes_per_token"]
    (train,) = [line for line in lines if line["result"] == "train_step"]
    assert train["step_s"] > 0 and math.isfinite(train["loss"])


def test_agent_cache_ceiling_counts_what_a_perfect_cache_serves() -> None:
    """Two conversations of one prompt group under one weight version, a turn after updates: turn 1 of the first
    computes everything, the second's turn 1 hits its whole prompt; a later turn hits all but what it adds and the
    last generated token; after two updates (flushes) nothing; after one, what the previous version computed (the
    request may have been admitted before the update that its first token came after)."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("bench_agent_cache", REPO / "benchmarks" / "bench_agent_cache.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def conv(tokens: list[int], mask: list[int], versions: list[int]) -> SimpleNamespace:
        return SimpleNamespace(tokens=tokens, loss_mask=mask, policy_version=versions)

    # prompt 1 2 3 | generated 4 5 | tool 6 7 | generated 8 9 (the second turn under version 2 in `b`)
    a = conv([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 0, 0, 1, 1], [0] * 9)
    b = conv([1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 2, 2])
    assert [r[1] for r in mod.requests_of(a)] == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    # A turn cut by an update: in pause mode abort a continuation request resends the prompt with the first part.
    cut = conv([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1])
    assert mod.requests_of(cut) == [(0, [1, 2, 3], [4]), (1, [1, 2, 3, 4], [5])]
    assert mod.requests_of(cut, split=False) == [(0, [1, 2, 3], [4, 5])]
    # a: turn 1 misses 3; b: turn 1 hits 3 (a's prompt); a turn 2: hits 1 2 3 4 (5 never ran), misses 5 6 7;
    # b turn 2 under version 2: a flushed cache, misses all 7.
    assert mod.ceiling([a, b]) == (20, 7, 3, 4)
    assert mod.ceiling([a, b], flush=False) == (20, 14, 3, 4)  # b's turn 2 would hit all a's turn 2 computed
    b.policy_version[7:] = [1, 1]  # one update before b's turn 2: in fully async it may have been admitted before it
    assert mod.ceiling([a, b]) == (20, 7, 3, 4)
    assert mod.ceiling([a, b], straddle=True) == (20, 14, 3, 4)


def test_agent_cache_bench_reaches_its_ceiling_with_one_token_pages() -> None:
    lines = bench("benchmarks/bench_agent_cache.py", "--turns", "2", "--page-sizes", "16", "1", "--steps", "1")
    assert [x["page_size"] for x in lines] == [16, 1]
    for x in lines:
        assert x["prompt_tokens"] == x["engine_prompt_tokens"] and x["turns_played"] == 2.0
        assert x["hit_rate"] <= x["ceiling"] + 1e-9 and x["ceiling"] <= x["ceiling_without_flush"]
    assert lines[1]["of_ceiling"] > 0.999 and lines[0]["of_ceiling"] < lines[1]["of_ceiling"]


def test_family_decode_bench_times_both_paths() -> None:
    lines = bench("benchmarks/bench_family_decode.py", "--sequences", "2", "--prompt", "16", "--new", "8")
    paths = [(line["model"], line["path"]) for line in lines if "path" in line]
    assert paths == [(m, p) for m in ("deepseek_v4", "inkling_text") for p in ("cached", "recomputed")]
    assert all(line["new_tokens_per_s"] > 0 for line in lines if "path" in line)
    assert [line["model"] for line in lines if "cached_over_recomputed" in line] == ["deepseek_v4", "inkling_text"]


def test_prefill_bench_reports_its_roofline_and_the_prefix_cache_at_each_length() -> None:
    lines = bench(
        "benchmarks/bench_prefill.py", "--device", "cpu", "--lens", "64,128", "--reps", "1", "--peak-n", "256"
    )
    prefill = [x for x in lines if x["result"] == "prefill"]
    assert [x["prompt_tokens"] for x in prefill] == [64, 128]
    for x in prefill:  # the fraction is the roofline time over the measured time, at the measured matmul rate
        assert x["tok_s"] > 0 and 0 < x["roofline_frac"] and x["matmul_tflops"] >= 0
        assert math.isclose(x["roofline_frac"], x["roofline_s"] / x["prefill_s"], rel_tol=0.05, abs_tol=1e-3)
    cache = [x for x in lines if x["result"] == "prefix_cache"]
    assert [(x["prefix_tokens"], x["cached_tokens"], x["fresh_cached_tokens"]) for x in cache] == [
        (64, 64, 0),
        (128, 128, 0),
    ]


def test_moe_decode_counts_the_experts_each_step_touches() -> None:
    lines = bench(
        *("benchmarks/bench_rollout.py", "--device", "cpu", "--shape", "qwen3_moe:tiny", "--skip-hf", "--skip-prefix"),
        *("--batches", "1,6", "--new-tokens", "12"),
    )
    one, six = (x for x in lines if x["result"] == "decode")
    assert one["experts_total"] == six["experts_total"] == 2 * 8  # the tiny preset: 2 MoE layers of 8 experts
    assert one["experts_touched_per_step"] == 2 * 2  # one token: its top-2 in each layer, distinct
    assert 2 * 2 < six["experts_touched_per_step"] <= 16
