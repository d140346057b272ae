"""The engine's overlap of host and device (a fused step left in flight while the next one is scheduled), on CPU:
`DecodeForward` with the torch ops behind `DecodeRunner`, as CUDA runs it. Outputs (tokens, log-probs, finish
reasons) must equal the plain path's when requests stop on a token while the step behind them is in flight, when
the KV cache is so small that requests are retracted, with seeded sampling and bans, and around abort and pause."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_engine_core import greedy_req, make_ckpt, prompts, submit
from test_engine_decode import with_torch_decode

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.scheduler import PLACEHOLDER
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("qwen3"), "qwen3", 0)


def engines(ckpt: Path, **kw: object) -> tuple[Engine, Engine]:
    """(plain engine, engine with the fused decode step and its overlap) of the same config."""
    cfg = EngineConfig(block_size=4, max_prefill_tokens=24, **kw)  # type: ignore[arg-type]
    return Engine.from_pretrained(str(ckpt), cfg), with_torch_decode(Engine.from_pretrained(str(ckpt), cfg))


def run(engine: Engine, reqs: list[GenerateRequest], stagger: int = 0) -> tuple[dict[str, GenerateResult], int]:
    """Results by rid, and how many steps ended with a step in flight."""
    results: dict[str, GenerateResult] = {}
    in_flight = 0
    for r in reqs:
        submit(engine, results, r)
        for _ in range(stagger):
            engine.step()
            in_flight += engine._inflight is not None
    while engine.step():
        in_flight += engine._inflight is not None
    assert len(results) == len(reqs) and engine._inflight is None
    return results, in_flight


def same(got: dict[str, GenerateResult], want: dict[str, GenerateResult]) -> None:
    for rid, w in want.items():
        g = got[rid]
        assert g.output_ids == w.output_ids, rid
        assert PLACEHOLDER not in g.output_ids
        assert g.finish_reason == w.finish_reason, rid
        assert len(g.output_logprobs) == len(g.output_ids)
        assert max((abs(a - b) for a, b in zip(g.output_logprobs, w.output_logprobs)), default=0.0) < 1e-5
        assert g.weight_versions == w.weight_versions


@pytest.mark.parametrize("stagger", [0, 2])
def test_stop_tokens_while_the_next_step_is_in_flight(ckpt: Path, stagger: int) -> None:
    ps = prompts([3, 9, 14, 6, 20], seed=11)
    plain, fused = engines(ckpt)
    free, _ = run(plain, [greedy_req(str(i), p, 16) for i, p in enumerate(ps)])
    # Each request stops at its (2 + i)-th greedy token: the step after it is already in flight then.
    stops = [free[str(i)].output_ids[min(2 + i, 15)] for i in range(len(ps))]
    reqs = [
        GenerateRequest(
            rid=str(i),
            input_ids=tuple(p),
            sampling=SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(stops[i],)),
        )
        for i, p in enumerate(ps)
    ]
    want, _ = run(plain, reqs, stagger)
    got, in_flight = run(fused, reqs, stagger)
    assert in_flight > 5
    same(got, want)
    assert all(w.finish_reason.type == "stop" for w in want.values())
    assert fused.stats()["kv_blocks_used"] == 0 and not fused.scheduler.running


def test_retraction_with_a_step_in_flight(ckpt: Path) -> None:
    ps = prompts([7, 12, 5, 9, 15, 4], seed=12)
    plain, fused = engines(ckpt, num_blocks=14)
    reqs = [greedy_req(str(i), p, 14) for i, p in enumerate(ps)]
    want, _ = run(plain, reqs)
    got, in_flight = run(fused, reqs)
    assert in_flight > 5 and fused.scheduler.num_retractions > 0
    for rid, w in want.items():
        assert got[rid].output_ids == w.output_ids, rid


def test_seeded_sampling_and_bans_outside_the_graph(ckpt: Path) -> None:
    ps = prompts([5, 11, 8], seed=13)
    plain, fused = engines(ckpt)
    free, _ = run(plain, [greedy_req(str(i), p, 12) for i, p in enumerate(ps)])
    reqs = [
        GenerateRequest(
            rid=str(i),
            input_ids=tuple(p),
            sampling=SamplingParams(
                max_new_tokens=12,
                temperature=0.0 if i == 0 else 1.0,
                top_k=-1 if i < 2 else 20,
                sampling_seed=100 + i,
                min_new_tokens=6,
                stop_token_ids=(free[str(i)].output_ids[2],),  # banned until 6 tokens are out
            ),
        )
        for i, p in enumerate(ps)
    ]
    want, _ = run(plain, reqs)
    got, in_flight = run(fused, reqs)
    assert in_flight > 5
    same(got, want)


def test_abort_and_pause_finish_the_step_in_flight(ckpt: Path) -> None:
    ps = prompts([4, 10, 6], seed=14)
    plain, fused = engines(ckpt)
    reqs = [greedy_req(str(i), p, 20) for i, p in enumerate(ps)]
    want, _ = run(plain, reqs)
    results: dict[str, GenerateResult] = {}
    submit(fused, results, *reqs)
    for _ in range(6):
        fused.step()
    assert fused._inflight is not None
    assert fused.abort("1") == 1
    assert fused._inflight is None
    aborted = results["1"]
    assert aborted.finish_reason.type == "abort" and PLACEHOLDER not in aborted.output_ids
    assert aborted.output_ids == want["1"].output_ids[: len(aborted.output_ids)] and aborted.output_ids
    fused.step()
    fused.pause("in_place")
    assert fused._inflight is None and all(r.pending == 0 for r in fused.scheduler.running)
    fused.resume()
    while fused.step():
        pass
    for rid in ("0", "2"):
        assert results[rid].output_ids == want[rid].output_ids, rid
    assert fused.stats()["kv_blocks_used"] == 0


def test_a_failed_step_with_one_in_flight_fails_its_requests_and_the_loop_serves_on(ckpt: Path) -> None:
    """A device error surfaces when the step in flight is collected, and stays (a CUDA error is sticky): the loop
    fails every request held with the error instead of dying on a second collect, and serves the next ones."""
    import threading

    _, fused = engines(ckpt)
    real_collect, broken = fused.runner.collect, [True]

    def collect(step: object) -> object:
        if broken[0]:
            raise RuntimeError("device error")
        return real_collect(step)  # type: ignore[arg-type]

    fused.runner.collect = collect  # type: ignore[method-assign]
    done: dict[str, GenerateResult] = {}
    arrived = threading.Event()

    def on_done(res: GenerateResult) -> None:
        done[res.rid] = res
        arrived.set()

    fused.start()
    try:
        fused.submit(greedy_req("a", [5, 6, 7, 8], 12), on_done)
        assert arrived.wait(60), "the failed step left its request hanging"
        assert done["a"].error is not None and "device error" in done["a"].error
        broken[0], arrived = False, threading.Event()
        fused.submit(greedy_req("b", [5, 6, 7, 8], 4), on_done)
        assert arrived.wait(60), "the loop stopped serving after a failed step"
        assert done["b"].error is None and len(done["b"].output_ids) == 4
    finally:
        fused.shutdown()
