"""Zero-KL mode's graph-ready decode step (`engine/invariant_decode.py`) on CPU in Triton's interpreter: an engine
whose decode-only steps run `InvariantDecodeForward` behind `DecodeRunner` (eager, padded batches, the step that a
GPU captures) generates what the eager zero-KL engine generates: the same tokens, greedy and sampled, and the same
log-probs. Bitwise equality with the trainer needs compiled kernels (the interpreter's numpy dot may round a row
by its place in a tile): tests/test_zero_kl_gpu.py checks it on a GPU."""

from __future__ import annotations

import pytest

from miles_hpc.engine.invariant_decode import unsupported_reason
from miles_hpc.models import ModelConfig, build_model
from miles_hpc.models.presets import preset_config

CHECK = """
import os
os.environ["MILES_INVARIANT_KERNELS"] = "triton"
import tempfile
from pathlib import Path

import test_zero_kl as zk
from test_engine_core import drain, greedy_req, prompts, submit

from miles_hpc.engine import invariant_decode, runner as runner_mod
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.cuda_graphs import graph_batch_sizes

rows = []
original = runner_mod.ModelRunner.__init__


def with_graph_step(self, *args, **kw):
    original(self, *args, **kw)
    forward = invariant_decode.InvariantDecodeForward(self.model, self.cache)
    self.decode = self._decode_runner(
        lambda *a: (rows.append(a[0].shape[0]), forward(*a))[1], invariant_decode.greedy_sample, use_graphs=False
    )


def greedy(ckpt):
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, max_prefill_tokens=24, batch_invariant=True))
    results = {}
    for i, p in enumerate(prompts([3, 9, 17], seed=5)):  # joining a running batch; short prompts run as rows
        submit(engine, results, greedy_req(str(i), p, 10 + i))
        engine.step()
    drain(engine, results)
    return [(r.output_ids, r.output_logprobs) for _, r in sorted(results.items())]


def same(want, got, what):
    assert len(want) == len(got), what
    for (wt, wl, _), (gt, gl, _) in zip(want, got):
        assert wt == gt, (what, "tokens")
        assert [a is None for a in wl] == [b is None for b in gl], (what, "which log-probs")
        diffs = [abs(a - b) for a, b in zip(wl, gl) if a is not None]
        assert diffs and max(diffs) < 1e-5, (what, max(diffs))


with tempfile.TemporaryDirectory() as tmp:
    ckpt = zk.make_ckpt(Path(tmp) / "m", "qwen3")
    want_greedy, want = greedy(ckpt), zk.generate(ckpt, True)
    runner_mod.ModelRunner.__init__ = with_graph_step
    got_greedy = greedy(ckpt)
    assert rows and all(r in graph_batch_sizes(256) for r in rows), rows  # the decode step ran, padded
    rows.clear()
    got = zk.generate(ckpt, True)  # sampled, input log-probs, chunked prefills, prefix-cache hits
    assert rows, "no decode step ran"
    same([(t, l, 0) for t, l in want_greedy], [(t, l, 0) for t, l in got_greedy], "greedy")
    same(want, got, "sampled")
print("ok")
"""


@pytest.mark.process
def test_graph_ready_zero_kl_decode_matches_the_eager_engine(tmp_path) -> None:  # noqa: ANN001
    from conftest import run_interpreted

    run_interpreted(CHECK)


@pytest.mark.parametrize(
    "arch,why",
    [("qwen3_moe", "MoE layers"), ("deepseek_v3", "MLA attention"), ("qwen3_next", "keep their own state")],
)
def test_models_it_cannot_capture_are_named(arch: str, why: str) -> None:
    model = build_model(ModelConfig.from_hf_dict(preset_config(arch, "tiny")))
    cache = object()
    if arch != "deepseek_v3":
        from miles_hpc.engine.kv_cache import KVCache

        cache = KVCache.__new__(KVCache)
    reason = unsupported_reason(model, cache)
    assert reason is not None and why in reason, reason


def test_a_dense_model_is_supported_unless_the_torch_tiles_are_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles_hpc.engine.kv_cache import KVCache

    model = build_model(ModelConfig.from_hf_dict(preset_config("qwen3", "tiny")))
    cache = KVCache.__new__(KVCache)
    monkeypatch.setenv("MILES_INVARIANT_KERNELS", "auto")
    assert unsupported_reason(model, cache) is None
    monkeypatch.setenv("MILES_INVARIANT_KERNELS", "torch")
    assert "torch tiles" in str(unsupported_reason(model, cache))


def test_a_failed_capture_leaves_the_step_uncaptured_where_a_fallback_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`ModelRunner._start_decode`: zero-KL's (and the MoE) decode step whose CUDA-graph capture fails runs without
    graphs, with a WARNING; a step without a fallback lets the error stop the engine."""
    import logging

    from miles_hpc.engine.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    built: list[bool] = []

    def decode_runner(forward: object, sampler: object, *, use_graphs: bool) -> str:
        built.append(use_graphs)
        if use_graphs:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "uncaptured"

    runner._decode_runner = decode_runner  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="miles_hpc.engine.runner"):
        runner._start_decode(object(), None, True, "zero-KL's")  # type: ignore[arg-type]
    assert runner.decode == "uncaptured" and built == [True, False]  # type: ignore[comparison-overlap]
    assert "could not capture zero-KL's decode step in CUDA graphs" in caplog.text
    with pytest.raises(RuntimeError, match="capturing"):
        runner._start_decode(object(), None, True, None)  # type: ignore[arg-type]
