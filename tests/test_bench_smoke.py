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
