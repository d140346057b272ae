"""The rollout half of DSA indexer replay (issue 24): the embedded engine records, per cached token and per layer
with its own indexer, the keys the token's query selected (`EngineConfig.record_indexer_topk`, `miles-hpc serve
--enable-return-indexer-topk`), and a request asks for them (`return_indexer_topk`, `indexer_topk_start_len`).

The reference is the model's own default forward over prompt + completion (no cache): its selections, recorded as
the engine records them (keys <= the token's position, -1 padding), and the trainer's replay of the engine's rows
(`CausalLM.forward(index_replay=...)`) giving the engine's log-probs. Prompts are longer than the checkpoints'
index_topk (8), so most rows choose 8 of more keys. Also: prefix-cache hits return the rows of the request that
computed the block, continuations stitch, the HTTP round trip through `miles-hpc serve` and the client, and every
refusal (engine, request, run config) names its flag or key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from server_fixtures import running_server
from test_engine_mla_support import DSA_ARCHS, drain, greedy_req, make_mla_ckpt, prompts, submit

from miles_hpc.config import ConfigError, load_config
from miles_hpc.data.store import TrajectoryWriter  # imported here: h5py's first import runs `uname`
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine, RequestError
from miles_hpc.engine.latent_cache import geometry
from miles_hpc.engine.launch import EngineLaunch
from miles_hpc.engine.server import configs_of
from miles_hpc.engine.types import GenerateResult
from miles_hpc.models import CausalLM, ModelConfig, load_pretrained

REPO = Path(__file__).resolve().parents[1]
RECORDING = {"block_size": 4, "max_prefill_tokens": 20, "record_indexer_topk": True}


@pytest.fixture(scope="module", params=DSA_ARCHS)
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mla_ckpt(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def plain(ckpt: Path) -> CausalLM:
    return load_pretrained(ckpt)


def own_records(model: CausalLM, tokens: list[int]) -> np.ndarray:
    """The model's own selections over `tokens` (its default forward), as the engine records them: int
    [len(tokens), indexer layers, index_topk], keys <= the token's position, -1 padding."""
    seen: dict[int, Any] = {}
    layers = model.model.layers
    hooks = [
        layers[i].self_attn.register_forward_hook(lambda _m, _a, out, i=i: seen.__setitem__(i, out[1]))
        for i in model.indexer_layer_ids
    ]
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    k, pos = model.config.index_topk, torch.arange(len(tokens))[:, None]
    rows = []
    for i in model.indexer_layer_ids:
        s = seen[i][0][0].long()  # the one sequence's [T, min(k, T)]
        rows.append(F.pad(torch.where(s <= pos, s, -1), (0, k - s.shape[-1]), value=-1))
    return torch.stack(rows, dim=1).numpy()


def same_keys(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shapes and, per token and layer, the same set of keys (the order within a row is the top-k's)."""
    return a.shape == b.shape and bool((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all())


def run_engine(engine: Engine, *reqs: Any) -> dict[str, GenerateResult]:
    results: dict[str, GenerateResult] = {}
    submit(engine, results, *reqs)
    drain(engine)
    return results


def test_recorded_rows_are_the_models_own_selection(ckpt: Path, plain: CausalLM) -> None:
    """Three prompts at once (chunked prefills, fresh and after a cached chunk, then decode rows batched over padded
    contexts): every processed token's row is the plain model's own choice, and replaying the rows gives the
    engine's log-probs, while other keys would not."""
    k, layers = plain.config.index_topk, len(plain.indexer_layer_ids)
    ps = dict(zip("abc", prompts([30, 23, 41], seed=4)))
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(**RECORDING))
    results = run_engine(engine, *(greedy_req(rid, p, 12, return_indexer_topk=True) for rid, p in ps.items()))
    for rid, p in ps.items():
        res = results[rid]
        tokens = p + res.output_ids
        got = res.indexer_topk
        assert got is not None and got.dtype == np.int32 and got.shape == (len(tokens) - 1, layers, k)
        assert len(p) > k and (got >= 0).sum(-1).tolist() == [[min(t + 1, k)] * layers for t in range(len(got))]
        assert same_keys(got, own_records(plain, tokens[:-1])), f"request {rid}"
        ids = torch.tensor([tokens[:-1]])
        record = torch.from_numpy(got.astype(np.int64))[None]
        with torch.no_grad():
            lp = torch.log_softmax(plain(ids, index_replay=record)[0].float(), -1)
            stats = plain.index_replay_stats().tolist()
            mine = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(res.output_ids)]
            assert max(abs(a - b) for a, b in zip(mine, res.output_logprobs)) < 1e-4
            assert stats == [got.shape[0] * layers] * 3  # every row replayed, each the live choice
            earliest = torch.minimum(torch.arange(k).expand_as(record), torch.arange(len(tokens) - 1)[:, None, None])
            other = torch.log_softmax(plain(ids, index_replay=earliest)[0].float(), -1)  # the first k keys instead
        assert (
            max(abs(other[len(p) - 1 + j, t].item() - a) for j, (t, a) in enumerate(zip(res.output_ids, mine))) > 1e-3
        )


def test_a_prefix_cache_hit_returns_the_rows_of_the_request_that_computed_them(ckpt: Path, plain: CausalLM) -> None:
    (p,) = prompts([30], seed=6)
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(**RECORDING))
    first = run_engine(engine, greedy_req("a", p, 6, return_indexer_topk=True))["a"]
    q = p[:26] + prompts([6], seed=7)[0]  # shares 6 whole blocks of 4 with the first prompt
    second = run_engine(engine, greedy_req("b", q, 6, return_indexer_topk=True))["b"]
    assert second.cached_tokens == 24 and first.indexer_topk is not None and second.indexer_topk is not None
    np.testing.assert_array_equal(second.indexer_topk[:24], first.indexer_topk[:24])  # read from the cached slots
    assert same_keys(second.indexer_topk, own_records(plain, q + second.output_ids[:-1]))


@pytest.mark.parametrize("start", [0, 3])
def test_a_continuation_stitches_to_the_uninterrupted_rows(ckpt: Path, start: int) -> None:
    """A generation in two pieces, the second on another engine (fail-over: nothing cached there) from prompt +
    output so far, its rows from the last token the first piece sampled: the pieces' rows are one request's."""
    (p,) = prompts([27], seed=8)
    one = Engine.from_pretrained(str(ckpt), EngineConfig(**RECORDING))
    whole = run_engine(one, greedy_req("w", p, 12, return_indexer_topk=True, indexer_topk_start_len=start))["w"]
    head = run_engine(one, greedy_req("h", p, 5, return_indexer_topk=True, indexer_topk_start_len=start))["h"]
    other = Engine.from_pretrained(str(ckpt), EngineConfig(**RECORDING))
    rest = greedy_req("r", p + head.output_ids, 7, return_indexer_topk=True, indexer_topk_start_len=len(p) + 4)
    tail = run_engine(other, rest)["r"]
    assert head.output_ids + tail.output_ids == whole.output_ids
    assert whole.indexer_topk is not None and head.indexer_topk is not None and tail.indexer_topk is not None
    assert whole.indexer_topk.shape[0] == len(p) + 11 - start and tail.indexer_topk.shape[0] == 7
    assert same_keys(np.concatenate([head.indexer_topk, tail.indexer_topk]), whole.indexer_topk)


def test_refusals_name_the_flag(ckpt: Path, tmp_path: Path) -> None:
    off = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    (p,) = prompts([10])
    with pytest.raises(RequestError, match="--enable-return-indexer-topk"):
        off.submit(greedy_req("x", p, 2, return_indexer_topk=True), lambda r: None)
    on = Engine.from_pretrained(str(ckpt), EngineConfig(**RECORDING))
    with pytest.raises(RequestError, match="indexer_topk_start_len must be in"):
        on.submit(greedy_req("y", p, 2, return_indexer_topk=True, indexer_topk_start_len=11), lambda r: None)
    dense = make_mla_ckpt(tmp_path / "v3", "deepseek_v3")
    with pytest.raises(ValueError, match="record_indexer_topk .* deepseek_v3 has no indexer"):
        Engine.from_pretrained(str(dense), EngineConfig(record_indexer_topk=True))
    with pytest.raises(RequestError, match="return_indexer_topk: this model .deepseek_v3. has no DSA indexer"):
        Engine.from_pretrained(str(dense), EngineConfig()).submit(
            greedy_req("z", p, 2, return_indexer_topk=True), lambda r: None
        )


def test_the_store_is_counted_in_the_geometry_and_the_flag_round_trips(ckpt: Path) -> None:
    mc = load_pretrained(ckpt).config
    n, k = len(load_pretrained(ckpt).indexer_layer_ids), mc.index_topk
    for rec in (False, True):
        engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4, num_blocks=8, record_indexer_topk=rec))
        assert engine.cache.bytes_per_token() == engine.geometry.bytes_per_token  # what memory sizing uses
        assert engine.geometry.indexer_topk_bytes == (4 * n * k if rec else 0)
        info = engine.model_info()
        assert (info["num_indexer_layers"], info["index_topk"], info["records_indexer_topk"]) == (n, k, rec)
    # GLM-5.2: 21 indexer layers x 2048 int32 positions = 172,032 bytes per cached token more (docs/engine.md).
    glm52 = ModelConfig.from_hf_dict(json.loads((REPO / "configs/models/glm52.json").read_text()))
    g = geometry(glm52, torch.bfloat16, 75 * 8, record_indexer_topk=True)
    assert g.indexer_topk_bytes == 21 * 2048 * 4 == 172_032 and g.bytes_per_token == 97_632 + 172_032
    launch = EngineLaunch(model_dir=str(ckpt), enable_return_indexer_topk=True)
    assert "--enable-return-indexer-topk" in launch.argv() and EngineLaunch.parse(launch.argv()[4:]) == launch
    assert configs_of(launch)[0].record_indexer_topk


@pytest.mark.process
def test_http_round_trip_through_the_server_the_client_and_the_router(tmp_path: Path) -> None:
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.router import Router, RouterConfig

    model_dir = make_mla_ckpt(tmp_path / "glm", "glm_moe_dsa")
    plain = load_pretrained(model_dir)
    k, layers = plain.config.index_topk, len(plain.indexer_layer_ids)
    (p,) = prompts([29], seed=9)
    greedy = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}

    async def main(url: str) -> tuple[Any, Any, Any]:
        async with EngineClient(url) as c:  # the rows' shape comes from /get_model_info
            whole = await c.generate(p, greedy, return_logprob=True, return_indexer_topk=True)
            later = await c.generate(p, greedy, return_indexer_topk=True, indexer_topk_start_len=5)
            async with Router([c], RouterConfig(chunk_tokens=4)) as router:
                pieces = await router.generate(p, greedy, return_indexer_topk=True)
        return whole, later, pieces

    with running_server(model_dir, tmp_path / "srv", "--enable-return-indexer-topk") as server:
        whole, later, pieces = asyncio.run(main(server.url))
    assert whole.indexer_topk.shape == (len(p) + 9, layers, k) and whole.indexer_topk.dtype == np.int32
    assert same_keys(whole.indexer_topk, own_records(plain, p + whole.output_ids[:-1]))
    np.testing.assert_array_equal(later.indexer_topk, whole.indexer_topk[5:])  # the second one hit the cache
    assert pieces.chunks == 3 and pieces.output_ids == whole.output_ids
    assert same_keys(pieces.indexer_topk, whole.indexer_topk)


def test_run_config_refusals_name_the_key(tmp_path: Path) -> None:
    from miles_hpc.launch.controller import _store
    from miles_hpc.launch.local import engine_launch
    from miles_hpc.launch.run_dir import RunPaths, resolve_model

    base = REPO / "configs/tiny_cpu.yaml"
    on = ["algo.indexer_replay=true", "model.init_arch=glm_moe_dsa"]
    cfg = load_config(base, on)
    assert cfg.algo.indexer_replay
    refused = {
        "model.init_arch=qwen3": "needs a DSA model .glm_moe_dsa/deepseek_v32., not qwen3",
        "rollout.backend=sglang": "needs rollout.backend=embedded",
        "train.backend=megatron": "needs train.backend=fsdp",
        "mode=fully_async": "runs in mode sync so far",
    }
    for override, why in refused.items():
        with pytest.raises(ConfigError, match=f"algo.indexer_replay.*{why}"):
            load_config(base, [*on, override])
    with pytest.raises(ConfigError, match="algo.indexer_replay.*multi-turn agents"):
        load_config(REPO / "configs/tiny_agent_cpu.yaml", on)
    # A model given by path is checked where its config is read.
    dense = make_mla_ckpt(tmp_path / "v3", "deepseek_v3")
    paths = RunPaths(tmp_path / "run")
    with pytest.raises(ConfigError, match="algo.indexer_replay.*deepseek_v3, which has no indexer"):
        resolve_model(load_config(base, ["algo.indexer_replay=true", f"model.path={dense}"]), paths)
    dsa = make_mla_ckpt(tmp_path / "glm", "glm_moe_dsa")
    with_path = load_config(base, ["algo.indexer_replay=true", f"model.path={dsa}"])
    assert resolve_model(with_path, paths) == dsa
    # The run's engines record, and the store keeps the key positions in the dtype that holds the context.
    keys = tmp_path / "keys"
    assert engine_launch(with_path, dsa, keys, tmp_path / "e.json", 0).enable_return_indexer_topk
    assert not engine_launch(load_config(base), dsa, keys, tmp_path / "e.json", 0).enable_return_indexer_topk
    store = _store(with_path, RunPaths(tmp_path / "run"), dsa, 0)
    assert isinstance(store, TrajectoryWriter)
    assert store.max_context == load_pretrained(dsa).config.max_position_embeddings
    store.close()


@pytest.mark.process
def test_a_run_records_stores_and_replays(tmp_path: Path) -> None:
    """`miles-hpc run` with algo.indexer_replay on the tiny glm_moe_dsa preset (~40 s on 2 cores): its engine records,
    the shards keep the rows (int16: the preset's context fits), the FSDP trainer replays all but each sample's last
    token, and agrees with every row (fp32 on both sides)."""
    import subprocess
    import sys

    from miles_hpc.data import TrajectoryReader

    run_dir = tmp_path / "run"
    small = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6"]
    argv = [sys.executable, "-m", "miles_hpc.cli", "run", str(REPO / "configs/tiny_cpu.yaml"), f"run_dir={run_dir}"]
    argv += [*small, "train.world_size=2", "steps=2", "model.init_arch=glm_moe_dsa", "algo.indexer_replay=true"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for r in metrics:
        assert 0.9 < r["dsa/replay_coverage"] < 1.0 and r["dsa/topk_agreement"] == 1.0
    samples = [s for f in sorted((run_dir / "trajectories").glob("*.h5")) for s in TrajectoryReader(f)]
    assert len(samples) == 8 and all(s.indexer_topk is not None for s in samples)
    for s in samples:
        assert s.indexer_topk.shape[0] == len(s.tokens) - 1 and s.indexer_topk.dtype.itemsize == 2
