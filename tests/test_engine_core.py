"""Engine core against the plain model: continuous batching, chunked prefill, retraction, log-probs, control, weights.

The reference is always `load_pretrained` + a full recompute per token (no cache), so every engine mechanism
(paged KV, prefix reuse, chunking, retraction) must reproduce it exactly (greedy) and to 1e-5 in log-probs.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models import CausalLM, iter_hf_tensors, load_pretrained, save_pretrained
from miles_hpc.sync.wire.checksum import tensor_checksum

LP_TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("qwen3"), "qwen3", 0)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def greedy_req(rid: str, prompt: list[int], n: int = 8, **kw: object) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return GenerateRequest(rid=rid, input_ids=tuple(prompt), sampling=sp, **kw)  # type: ignore[arg-type]


@torch.no_grad()
def plain_greedy(model: CausalLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1].float()
        t = int(logits.argmax())
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return ids[len(prompt) :], lps


@torch.no_grad()
def plain_input_logprobs(model: CausalLM, prompt: list[int]) -> list[float]:
    lp = torch.log_softmax(model(torch.tensor([prompt]))[0].float(), -1)
    return [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]  # of tokens 1..n-1


def drain(engine: Engine, results: dict[str, GenerateResult], max_steps: int = 10_000) -> int:
    steps = 0
    while engine.step():
        steps += 1
        assert steps < max_steps
    return steps


def submit(engine: Engine, results: dict[str, GenerateResult], *reqs: GenerateRequest) -> None:
    for r in reqs:
        engine.submit(r, lambda res: results.__setitem__(res.rid, res))


def check_greedy(
    plain: CausalLM, ps: list[list[int]], results: dict[str, GenerateResult], n: int, tol: float = LP_TOL
) -> None:
    for i, p in enumerate(ps):
        ref, ref_lps = plain_greedy(plain, p, n)
        got = results[str(i)]
        assert got.output_ids == ref, f"request {i} (prompt {len(p)} tokens)"
        assert max(abs(a - b) for a, b in zip(got.output_logprobs, ref_lps)) < tol
        assert got.finish_reason.type == "length" and got.prompt_tokens == len(p)


@pytest.mark.parametrize(("prefix_cache", "block_size"), [(True, 4), (False, 4), (True, 1)])
def test_batched_greedy_matches_plain_model(ckpt: Path, plain: CausalLM, prefix_cache: bool, block_size: int) -> None:
    # Small blocks (down to SGLang's one-token pages) and a small prefill budget: prompts are chunked across steps
    # and mixed with decodes.
    cfg = EngineConfig(block_size=block_size, max_prefill_tokens=24, enable_prefix_cache=prefix_cache)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    ps = prompts([1, 7, 16, 33, 50])
    ps.append(ps[4][:40] + [3, 4])  # shares 40 tokens with request 4
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 10) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(plain, ps, results, 10)
    # Request 5 waited while request 4 computed the 40 tokens they share (in chunks), then reused all of them.
    assert results["5"].cached_tokens == (40 if prefix_cache else 0)
    assert engine.stats()["kv_blocks_used"] == 0


def test_staggered_submissions_join_running_batch(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=8, max_prefill_tokens=16))
    ps = prompts([12, 5, 30, 9, 21], seed=1)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("0", ps[0], 12))
    for _ in range(3):
        engine.step()
    submit(engine, results, greedy_req("1", ps[1], 12), greedy_req("2", ps[2], 12))
    engine.step()
    assert engine.stats()["num_running_reqs"] == 3  # joined while request 0 decodes
    submit(engine, results, greedy_req("3", ps[3], 12))
    for _ in range(5):
        engine.step()
    submit(engine, results, greedy_req("4", ps[4], 12))
    drain(engine, results)
    check_greedy(plain, ps, results, 12)


@pytest.mark.parametrize("block_size", [4, 1])
def test_tiny_kv_cache_retracts_and_recomputes(ckpt: Path, plain: CausalLM, block_size: int) -> None:
    # 40 tokens of KV for 4 requests of up to 12 + 16 tokens: they cannot all grow; the newest yield.
    cfg = EngineConfig(block_size=block_size, num_blocks=40 // block_size, max_prefill_tokens=64)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    ps = prompts([6, 12, 9, 11], seed=2)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 16) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(plain, ps, results, 16)
    assert sum(r.num_retractions for r in results.values()) > 0
    assert engine.stats()["num_retractions_total"] == sum(r.num_retractions for r in results.values())


@pytest.mark.parametrize("start", [0, 1, 5])
def test_input_logprobs_match_plain_model_even_with_cached_prefix(ckpt: Path, plain: CausalLM, start: int) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=8))
    (p,) = prompts([23], seed=3)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("warm", p, 2))  # fills the prefix cache with this prompt
    drain(engine, results)
    submit(engine, results, greedy_req("a", p, 3, return_logprob=True, logprob_start_len=start))
    submit(engine, results, greedy_req("score", p, 0, return_logprob=True, logprob_start_len=start))
    drain(engine, results)
    ref = [None, *plain_input_logprobs(plain, p)]
    for rid in ("a", "score"):
        got = results[rid].input_logprobs
        assert got is not None and len(got) == len(p) - start
        assert got[0] is None and None not in got[1:]  # token `start` has none, as in SGLang's answer
        assert all(abs(g - r) < LP_TOL for g, r in zip(got[1:], ref[start + 1 :]))  # type: ignore[operator]
    assert results["score"].output_ids == [] and results["score"].finish_reason.type == "length"
    # Prefix reuse stops before the first owed row: start 5 may reuse one block (4 tokens), 0 and 1 nothing.
    assert results["a"].cached_tokens == (4 if start == 5 else 0)


def test_abort_one_and_all(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_running_requests=2))
    ps = prompts([5, 6, 7], seed=4)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 20) for i, p in enumerate(ps)))
    for _ in range(4):
        engine.step()
    assert engine.abort("1") == 1 and engine.abort("1") == 0 and engine.abort("nope") == 0
    assert results["1"].finish_reason.type == "abort"
    ref, _ = plain_greedy(plain, ps[1], 20)
    assert 0 < len(results["1"].output_ids) < 20 and results["1"].output_ids == ref[: len(results["1"].output_ids)]
    engine.step()
    assert engine.abort(None) == 2  # one running, one that had been waiting or just admitted
    assert {r.finish_reason.type for r in results.values()} == {"abort"}
    assert engine.step() is False and engine.stats()["kv_blocks_used"] == 0
    submit(engine, results, greedy_req("1", ps[1], 3))  # a finished rid may be reused
    drain(engine, results)
    assert results["1"].output_ids == ref[:3]


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_modes_then_resume(ckpt: Path, plain: CausalLM, mode: str) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    ps = prompts([9, 14], seed=5)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("0", ps[0], 12), greedy_req("1", ps[1], 12))
    for _ in range(5):
        engine.step()
    engine.pause(mode)  # type: ignore[arg-type]
    assert engine.paused and engine.step() is False
    submit(engine, results, greedy_req("2", ps[0], 12))  # queued while paused
    assert engine.step() is False and engine.stats()["num_queue_reqs"] >= 1
    if mode == "retract":
        assert engine.stats()["kv_blocks_used"] == 0
    if mode == "in_place":
        assert engine.stats()["num_running_reqs"] == 2
    engine.resume()
    drain(engine, results)
    if mode == "abort":
        for rid, p in (("0", ps[0]), ("1", ps[1])):
            ref, _ = plain_greedy(plain, p, 12)
            r = results[rid]
            assert r.finish_reason.type == "abort" and r.output_ids == ref[: len(r.output_ids)]
        check_greedy(plain, [ps[0]], {"0": results["2"]}, 12)
    else:
        check_greedy(plain, [ps[0], ps[1], ps[0]], results, 12)
        assert all(results[r].num_retractions == (mode == "retract") for r in ("0", "1"))


def perturbed(ckpt: Path, seed: int) -> CausalLM:
    model = load_pretrained(ckpt)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_update_weights_gives_new_models_outputs_and_drops_cache(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    ps = prompts([13, 21], seed=6)
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *(greedy_req(str(i), p, 6) for i, p in enumerate(ps)))
    drain(engine, results)
    assert engine.stats()["kv_blocks_cached"] > 0
    new = perturbed(ckpt, 1)
    with torch.no_grad():  # a bf16 trainer shard: the engine casts it to its own float32
        for prm in new.parameters():
            prm.copy_(prm.to(torch.bfloat16).float())
    bf16 = [(n, t.to(torch.bfloat16)) for n, t in iter_hf_tensors(new)]
    applied = engine.update_weights(iter(bf16), version="v1")
    assert len(applied) == len(bf16) and engine.weight_version == "v1"
    assert engine.stats()["kv_blocks_cached"] == 0  # no KV of the old weights can be reused
    assert engine.checksums() == {n: tensor_checksum(t) for n, t in iter_hf_tensors(new)}
    results.clear()
    submit(engine, results, *(greedy_req(str(i), p, 6) for i, p in enumerate(ps)))
    drain(engine, results)
    check_greedy(new, ps, results, 6)
    assert results["0"].cached_tokens == 0 and results["0"].weight_version == "v1"
    assert results["0"].weight_versions == [{"version": "v1", "start": 0, "end": 6}]


def test_update_weights_from_disk_and_errors(ckpt: Path, tmp_path: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig())
    new = perturbed(ckpt, 2)
    save_pretrained(new, tmp_path)
    engine.update_weights_from_disk(str(tmp_path), version="disk")
    want = {n: tensor_checksum(t) for n, t in iter_hf_tensors(new)}
    assert engine.checksums() == want and engine.weight_version == "disk"
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(RequestError, match="no_such"):
        engine.update_weights([("model.no_such.weight", torch.zeros(1))], version="x")
    with pytest.raises(RequestError, match=name.replace(".", r"\.") + ".*shape"):
        engine.update_weights([(name, torch.zeros(3, 3))], version="x")
    assert engine.checksums() == want and engine.weight_version == "disk"  # nothing applied, version kept
    with pytest.raises(RequestError, match="model_path"):
        engine.update_weights_from_disk(str(tmp_path / "missing"), version=None)


def test_weight_versions_span_an_in_place_update(ckpt: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    results: dict[str, GenerateResult] = {}
    submit(engine, results, greedy_req("0", prompts([6], seed=7)[0], 10))
    for _ in range(4):  # prefill samples token 0, then three decodes
        engine.step()
    engine.pause("in_place")
    engine.update_weights(iter_hf_tensors(perturbed(ckpt, 3)), version="v2", flush_cache=True)
    engine.resume()
    drain(engine, results)
    assert results["0"].weight_versions == [
        {"version": "0", "start": 0, "end": 4},
        {"version": "v2", "start": 4, "end": 10},
    ]


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(input_ids=()), "input_ids must not be empty"),
        (dict(input_ids=(1, 320)), r"input_ids\[1\]=320 is outside the vocabulary"),
        (dict(input_ids=(1, -1)), r"input_ids\[1\]"),
        (dict(sampling=SamplingParams(max_new_tokens=2040)), "exceeds the context length 2048"),
        (dict(sampling=SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
        (dict(sampling=SamplingParams(temperature=-0.5)), "temperature"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(top_k=0)), "top_k"),
        (dict(sampling=SamplingParams(min_p=1.5)), "min_p"),
        (dict(sampling=SamplingParams(stop_token_ids=(999,))), "stop_token_ids"),
        (dict(return_logprob=True, logprob_start_len=10), "logprob_start_len"),  # 9 (the prompt's end) is fine
        (dict(return_routed_experts=True), "no MoE layers"),
        (dict(rid=""), "rid"),
    ],
)
def test_invalid_requests_raise_request_error(ckpt: Path, change: dict, match: str) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(num_blocks=64))
    base = dict(rid="r", input_ids=tuple(range(9)), sampling=SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestError, match=match):
        engine.submit(GenerateRequest(**{**base, **change}), lambda r: None)  # type: ignore[arg-type]
    assert engine.stats()["num_queue_reqs"] == 0


def test_capacity_and_duplicate_rid_errors(ckpt: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, num_blocks=8))  # 32 tokens
    with pytest.raises(RequestError, match="can never fit the KV cache"):
        engine.submit(greedy_req("big", list(range(30)), 3), lambda r: None)
    engine.submit(greedy_req("dup", [1, 2], 3), lambda r: None)
    with pytest.raises(RequestError, match="already in flight"):
        engine.submit(greedy_req("dup", [1, 2], 3), lambda r: None)
    with pytest.raises(RequestError, match="mode"):
        engine.pause("sideways")  # type: ignore[arg-type]


def test_engine_thread_serves_requests_and_control_calls(ckpt: Path, plain: CausalLM) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    engine.start()
    try:
        ps = prompts([8, 15, 4], seed=8)
        results: dict[str, GenerateResult] = {}
        done = threading.Semaphore(0)

        def on_done(r: GenerateResult) -> None:
            results[r.rid] = r
            done.release()

        for i, p in enumerate(ps):
            engine.submit(greedy_req(str(i), p, 8), on_done)
        assert all(done.acquire(timeout=30) for _ in ps)
        check_greedy(plain, ps, results, 8)
        engine.pause("in_place")
        engine.submit(greedy_req("late", ps[0], 500), on_done)  # stays queued while paused
        assert not done.acquire(timeout=0.2)
        assert engine.flush_cache() is False  # a request is live
        engine.resume()
        engine.update_weights(iter_hf_tensors(plain), version="same")  # applied between steps
        assert engine.stats()["num_requests_total"] == 4
    finally:
        engine.shutdown()
    assert done.acquire(timeout=10) and results["late"].finish_reason.type == "abort"
    assert engine.flush_cache() is True


def test_info_and_stats(ckpt: Path) -> None:
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=8, max_total_tokens=1000))
    info = engine.model_info()
    assert info["vocab_size"] == 320 and info["max_context_len"] == 2048 and info["num_moe_layers"] == 0
    assert info["eos_token_ids"] == [plain_eos(ckpt)]
    server = engine.server_info()
    assert server["num_blocks"] == 125 and server["block_size"] == 8 and server["dtype"] == "float32"
    engine.set_weight_version("w7")
    assert engine.weight_version == "w7" and engine.model_info()["weight_version"] == "w7"
    stats = engine.stats()
    assert stats["kv_blocks_total"] == 125 and stats["num_running_reqs"] == 0 and stats["cache_hit_rate"] == 0.0


def plain_eos(ckpt: Path) -> int:
    import json

    return int(json.loads((ckpt / "config.json").read_text())["eos_token_id"])


def test_engine_config_validation_names_the_field() -> None:
    for kwargs, field in [
        (dict(block_size=0), "block_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(num_blocks=-3), "num_blocks"),
        (dict(kv_cache_fraction=1.5), "kv_cache_fraction"),
        (dict(max_prefill_tokens=True), "max_prefill_tokens"),
        (dict(device="tpu9"), "device"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_half_updated_engine_refuses_to_continue(ckpt: Path, tmp_path: Path) -> None:
    # A trainer that dies mid-update (buckets without a version, the versioned last one never sent) must not leave
    # an engine serving a mix of old and new tensors.
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    named = list(iter_hf_tensors(perturbed(ckpt, 4)))
    engine.pause("retract")
    engine.update_weights(named[:3], version=None)
    assert engine.half_updated and engine.model_info()["weights_half_updated"] is True
    with pytest.raises(RequestError, match="half-updated.*after version 0"):
        engine.resume()
    engine.update_weights(named[3:], version="1")  # the update completes: consistent again
    engine.resume()
    assert not engine.half_updated and engine.weight_version == "1"
    # Or the weights are reloaded whole from disk.
    engine.pause("in_place")
    engine.update_weights(named[:2], version=None)
    engine.update_weights_from_disk(str(ckpt), version="0")
    engine.resume()
    # Updates while generation runs (SGLang's unpaused update_weights_from_tensor) are not multi-part updates.
    engine.update_weights(named[:1], version=None)
    assert not engine.half_updated
