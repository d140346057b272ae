"""Weight sync into tensor-parallel engines, laid out as for SGLang: the broadcast group is trainer rank 0, then each
engine's TP ranks at rank_offset + tp_rank (planner.transfer.update_group_ranks); every rank of an engine receives
each broadcast and keeps its part; /weights_checker then checks every rank's bytes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from engine_support import make_ckpt, run
from server_fixtures import start_server
from test_loop_e2e import REPO
from test_loop_e2e import metrics as loop_metrics
from test_loop_e2e import run as loop_run

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.tp import TPShard
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.launch.local import free_port
from miles_hpc.models import iter_hf_tensors, load_pretrained, read_config
from miles_hpc.planner.transfer import update_group_ranks
from miles_hpc.rollout.client import EngineClient
from miles_hpc.sync.protocol import WeightSyncError, engine_tp_sizes, verify_checksums
from miles_hpc.sync.strategies.base import GroupSyncSpec
from miles_hpc.sync.strategies.broadcast import BroadcastSync


def test_update_group_ranks_is_sglangs_layout() -> None:
    assert update_group_ranks([1, 1, 1]) == (4, [1, 2, 3])
    assert update_group_ranks([8, 8, 8, 8]) == (33, [1, 9, 17, 25])  # the flagship: 4 engines of TP 8
    assert update_group_ranks([2, 4, 1], senders=2) == (9, [2, 4, 8])
    with pytest.raises(ValueError, match="tp size must be >= 1"):
        update_group_ranks([2, 0])


def test_assembled_weights_catch_ranks_that_disagree(tmp_path: Path) -> None:
    """A replicated tensor (a norm) or a shared KV head whose copies differ between ranks assembles to None, and a
    rank's vocabulary padding that is not zero too: no checksum of such an engine can match the trainer's."""
    mc = read_config(make_ckpt(tmp_path / "m", "qwen3", 0))
    mc = mc.replace(num_key_value_heads=1, vocab_size=321)
    shards = [TPShard(mc, 2, r) for r in range(2)]
    torch.manual_seed(0)
    for name in ("model.norm.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        t = torch.randn(shards[0].shapes[name])
        parts = [s.local(name, t) for s in shards]
        assert torch.equal(shards[0].assemble(name, parts), t)
        bad = [p.clone() for p in parts]
        bad[1].view(-1)[-1] += 1.0  # rank 1's copy of the norm / of the one KV head / its padding row
        assert shards[0].assemble(name, bad) is None, name


def _weights(ckpt: Path, seed: int) -> list[tuple[str, torch.Tensor]]:
    model = load_pretrained(str(ckpt))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return [(n, t.clone()) for n, t in iter_hf_tensors(model)]


def _tp1_greedy(ckpt: Path, w: list[tuple[str, torch.Tensor]]) -> tuple[GenerateRequest, list[int]]:
    """A greedy request and what a TP 1 engine holding weights `w` answers it (the reference for TP engines)."""
    ref = Engine.from_pretrained(str(ckpt), EngineConfig(dtype="float32", max_total_tokens=4096))
    ref.update_weights(w, version="1")
    req = GenerateRequest(
        rid="x", input_ids=tuple(range(30, 60)), sampling=SamplingParams(max_new_tokens=8, temperature=0.0)
    )
    want = run(ref, req)["x"].output_ids
    ref.shutdown()
    return req, want


@pytest.mark.process
def test_broadcast_into_two_tp2_engines(tmp_path: Path) -> None:
    """Two `miles-hpc serve --tp-size 2` engines (a MoE model) join one 5-rank gloo group; a push in many buckets
    reaches every rank; checksums verify; both engines then generate what a TP 1 engine with those weights does."""
    ckpt = make_ckpt(tmp_path / "m", "qwen3_moe", 0)
    w = _weights(ckpt, 1)
    req, want = _tp1_greedy(ckpt, w)
    servers = [start_server(ckpt, tmp_path / f"s{i}", "--tp-size", "2", "--dtype", "float32") for i in range(2)]
    try:

        async def main() -> None:
            clients = [EngineClient(s.url, connect_retries=0) for s in servers]
            spec = GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, bucket_bytes=1 << 15, timeout_s=60)
            sync = BroadcastSync(spec)
            try:
                assert await engine_tp_sizes(clients) == [2, 2]
                await sync.connect(clients)
                assert sync.group.world_size == 5
                sums = await sync.push(iter(w), "1")
                await verify_checksums(clients, sums)
                for c in clients:
                    out = await c.generate(list(req.input_ids), {"max_new_tokens": 8, "temperature": 0.0})
                    assert out.output_ids == want and out.weight_version == "1"
                # Expected checksums the engines do not hold fail the check, naming the tensor.
                with pytest.raises(WeightSyncError, match="checksum mismatch"):
                    await verify_checksums(clients, {**sums, w[0][0]: "0" * len(sums[w[0][0]])})
            finally:
                await sync.close()
                for c in clients:
                    await c.close()

        asyncio.run(main())
    finally:
        for s in servers:
            s.stop()


@pytest.mark.process
@pytest.mark.parametrize("strategy", ["broadcast", "p2p", "delta", "colocated"])
def test_run_with_two_tp2_engines(strategy: str, tmp_path: Path) -> None:
    """`miles-hpc run` with 2 trainer ranks and 2 engines of TP 2 on CPU: every version reaches (and is verified on)
    both engines (p2p: each engine rank receives its own part from the trainer ranks); the trainer's log-probs of
    the engines' samples agree to fp32 noise."""
    run_dir = tmp_path / "run"
    extra = ("steps=2", f"sync.strategy={strategy}", "rollout.num_engines=2", "rollout.engine_tp=2")
    loop_run(run_dir, *extra)
    m = loop_metrics(run_dir)
    assert [r["weight_version"] for r in m] == [1, 2] and all(r["sync/engines"] == 2 for r in m)
    assert all(r["mismatch/max_abs_logprob_diff"] < 1e-4 for r in m)
    for i in range(2):
        assert "tensor-parallel: 2 ranks" in (run_dir / "logs" / f"engine-{i}.log").read_text()
    if strategy == "delta":  # the second version went as a delta against the first, not in full
        from miles_hpc.sync.codec.delta_manifest import read_manifest

        m2 = read_manifest(run_dir / "weights" / "v2")
        assert m2.base_version == "1" and "delta" in {e.kind for e in m2.tensors}
        assert not (run_dir / "weights" / "v2" / "full").exists()


@pytest.mark.process
def test_fully_async_p2p_into_tp2_engines_ends(tmp_path: Path) -> None:
    """Fully async with p2p into 2 engines of TP 2: every step's version verified on both engines, and the run
    ends (it hung after its last step while the engines, still generating, were told to destroy the group)."""
    run_dir = tmp_path / "run"
    extra = ("steps=3", "mode=fully_async", "sync.strategy=p2p", "rollout.num_engines=2", "rollout.engine_tp=2")
    out = loop_run(run_dir, *extra)
    assert "done: 3 steps" in out
    m = loop_metrics(run_dir)
    assert [r["weight_version"] for r in m] == [1, 2, 3] and all(r["sync/engines"] == 2 for r in m)
    assert all(r["sync/verified_tensors"] > 0 for r in m)
    for i in range(2):
        log = (run_dir / "logs" / f"engine-{i}.log").read_text()
        assert "tensor-parallel: 2 ranks" in log and "Traceback" not in log


def test_embedded_tp_refusals_name_the_key() -> None:
    from miles_hpc.config import ConfigError, load_config
    from miles_hpc.launch.local import gpu_plan
    from miles_hpc.sync.factory import strategy_class

    base = REPO / "configs/tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="sync.strategy.*lora into rollout.engine_tp=2"):
        load_config(base, ["sync.strategy=lora", "rollout.engine_tp=2", "lora.rank=4"])
    with pytest.raises(ConfigError, match="zero_kl.*tp size 1"):
        load_config(base, ["zero_kl=true", "rollout.engine_tp=2"])
    assert strategy_class(load_config(base, ["sync.strategy=p2p", "rollout.engine_tp=2"])).name == "p2p"
    gpu = ["rollout.device=cuda", "train.device=cuda", "train.world_size=2", "rollout.num_engines=3"]
    plan = gpu_plan(load_config(base, [*gpu, "rollout.engine_tp=2"]), 8)
    assert plan.trainer == (0, 1) and plan.engines == (2, 4, 6)
    wrapped = load_config(base, [*gpu, "rollout.engine_tp=4", "sync.strategy=colocated"])  # shares the trainer's GPU
    assert gpu_plan(wrapped, 8).engines == (2, 0, 4)
    with pytest.raises(ConfigError, match="rollout.engine_tp: 4 GPUs per engine, this machine has 2"):
        gpu_plan(load_config(base, [*gpu, "rollout.engine_tp=4"]), 2)


@pytest.mark.process
def test_run_attaches_to_engines_it_did_not_start(tmp_path: Path) -> None:
    """`rollout.engine_urls`: two `miles-hpc serve --tp-size 2` engines started beforehand (with keys) serve the
    run; it starts no engine, reads their TP sizes, and every version is verified on both; afterwards they still
    serve, at the last version (the run does not own them)."""
    import subprocess
    import sys

    model = tmp_path / "model"
    subprocess.run(
        [sys.executable, "-m", "miles_hpc.cli", "init-model", "--arch", "qwen3", "--size", "tiny", str(model)],
        check=True,
        capture_output=True,
    )
    key, admin = tmp_path / "key", tmp_path / "admin"
    key.write_text("k-123\n")
    admin.write_text("a-456\n")
    auth = ("--api-key-file", str(key), "--admin-api-key-file", str(admin), "--dtype", "float32")
    servers = [start_server(model, tmp_path / f"s{i}", "--tp-size", "2", *auth) for i in range(2)]
    try:
        urls = ",".join(s.url for s in servers)
        run_dir = tmp_path / "run"
        extra = [f"model.path={model}", f"rollout.engine_urls=[{urls}]", "rollout.num_engines=2"]
        extra += [f"rollout.engine_api_key_file={key}", f"rollout.engine_admin_api_key_file={admin}", "steps=2"]
        loop_run(run_dir, *extra)
        m = loop_metrics(run_dir)
        assert [r["weight_version"] for r in m] == [1, 2] and all(r["sync/engines"] == 2 for r in m)
        assert not list((run_dir / "logs").glob("engine-*.log"))  # none started by the run

        async def versions() -> list[str]:
            out = []
            for s in servers:
                async with EngineClient(s.url, api_key="k-123") as c:
                    out.append(str((await c.model_info())["weight_version"]))
            return out

        assert asyncio.run(versions()) == ["2", "2"]
    finally:
        for s in servers:
            s.stop()


def test_weight_groups_listen_where_the_engines_reach_this_host() -> None:
    from miles_hpc.sync.factory import master_address_for

    assert master_address_for(["http://127.0.0.1:30000", "http://localhost:30001"]) == "127.0.0.1"
    assert master_address_for(["http://10.0.0.7:30000"], "ib0-host") == "ib0-host"  # sync.master_address
    # An engine on another host: an address of this host on the route there (or its name), never loopback.
    got = master_address_for(["http://127.0.0.1:1", "http://192.0.2.10:30000"])
    assert got and got != "127.0.0.1"


@pytest.mark.process
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_p2p_resharded_into_tp2_engines(arch: str, tmp_path: Path) -> None:
    """p2p into two engines of TP 2 from two FSDP2-style trainer ranks (threads): each engine rank receives only
    its part, straight from the trainer ranks holding it (per-rank pieces in the announcement); the piece checksums
    verify; both engines generate what a TP 1 engine with those weights does; a trainer rank sends each element to
    each engine once, and no engine rank receives a whole sharded tensor."""
    from miles_hpc.planner.transfer import EngineRank, engine_layout, link_bytes, plan_transfers
    from miles_hpc.sync.strategies.p2p import P2PSync, ThreadedRanks

    ckpt = make_ckpt(tmp_path / "m", arch, 0)
    w = _weights(ckpt, 1)
    req, want = _tp1_greedy(ckpt, w)
    servers = [start_server(ckpt, tmp_path / f"s{i}", "--tp-size", "2", "--dtype", "float32") for i in range(2)]
    world = ThreadedRanks(w, 2)
    try:

        async def main() -> None:
            clients = [EngineClient(s.url, connect_retries=0) for s in servers]
            spec = GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, bucket_bytes=1 << 15, timeout_s=60)
            sync = P2PSync(spec, world)
            try:
                await sync.connect(clients)
                sums = await sync.push(iter(()), "1")
                await sync.verify(clients, sums)
                for c in clients:
                    out = await c.generate(list(req.input_ids), {"max_new_tokens": 8, "temperature": 0.0})
                    assert out.output_ids == want and out.weight_version == "1"
            finally:
                await sync.close()
                for c in clients:
                    await c.close()

        asyncio.run(main())
    finally:
        for s in servers:
            s.stop()
    # What moved, by the plan the strategy used: every engine rank gets its part only (half of each split tensor).
    kv = None if read_config(ckpt).is_mla else read_config(ckpt).num_key_value_heads
    plan = plan_transfers(world.shapes, world.layout, engine_layout(world.shapes, 2, 2, kv_heads=kv), 4)
    per_link = link_bytes(plan)
    whole = 4 * sum(t.numel() for t in world.named.values())
    to_rank = {r: sum(b for (_, d), b in per_link.items() if d == EngineRank(0, r)) for r in range(2)}
    assert all(b < 0.75 * whole for b in to_rank.values()), (to_rank, whole)
    sent = {s: sum(b for (src, _), b in per_link.items() if src == s) for s in range(2)}
    assert sum(sent.values()) < 2 * 2 * whole * 0.75  # not every element to every engine rank


@pytest.mark.process
@pytest.mark.parametrize("arch,grouped", [("qwen3", False), ("qwen3_moe", True)])
def test_delta_into_a_tp2_engine(arch: str, grouped: bool, tmp_path: Path) -> None:
    """The delta strategy's files applied by an engine of TP 2 (`delta_receiver`: the base gathered whole from its
    ranks, decoded on rank 0, each rank keeping its part) hold exactly the trainer's bits on every rank, as at TP 1;
    tensor by tensor (the tied qwen3: its LM head decoded against the embedding) and as one group (experts). A rank
    whose part is not the base the delta was coded against fails the tensor's checksum, named, before anything of
    the group is applied."""
    from sync_support import tiny_model
    from test_sync_delta import step

    from miles_hpc.engine.delta_receiver import apply_version
    from miles_hpc.engine.validate import RequestError
    from miles_hpc.sync.strategies.delta import DeltaSpec, DeltaSync

    ckpt = Path(tiny_model()) if arch == "qwen3" else make_ckpt(tmp_path / "m", arch, 0)
    w1 = [(n, t.to(torch.bfloat16)) for n, t in _weights(ckpt, 1)]
    w2 = step(w1, seed=2)
    sync = DeltaSync(
        DeltaSpec(
            run_dir=tmp_path / "run",
            rollout_dtype=torch.bfloat16,
            keep_versions=3,
            group_bytes=1 << 30 if grouped else 1,
        )
    )
    staged = []
    for version, w in (("1", w1), ("2", w2), ("3", step(w2, seed=3))):
        staged.append(asyncio.run(sync.stage(iter(w), version, full=False)))
        sync.commit(staged[-1])
    assert staged[1].manifest is not None and "delta" in {e.kind for e in staged[1].manifest.tensors}
    engines = [
        Engine.from_pretrained(str(ckpt), EngineConfig(dtype="bfloat16", max_total_tokens=1024, tp_size=tp))
        for tp in (2, 1)
    ]
    try:
        for e in engines:
            for base, s in zip((None, "1"), staged[:2]):
                apply_version(e, s.directory, base_version=base, weight_version=None, flush_cache=True)
            assert e.weight_version == "2"
            assert {k: v for k, v in e.checksums().items() if k in staged[1].checksums} == staged[1].checksums
        tp = engines[0]
        whole = tp.whole_weights([n for n, _ in w2])
        assert set(whole) == {n for n, _ in w2} and all(torch.equal(whole[n], t) for n, t in w2)
        # Rank 1 alone gets other values for a tensor the next delta changes; the engine still says version "2".
        delta3 = [e.name for e in staged[2].manifest.tensors if e.kind == "delta"]  # type: ignore[union-attr]
        for pattern, error in (("norm", "tensor-parallel ranks disagree"), ("q_proj", "checksum mismatch")):
            bad = next(n for n in delta3 if pattern in n)
            _rank1_only(tp, bad, (dict(w2)[bad].float() + 1.0).to(torch.bfloat16))
            with pytest.raises(RequestError, match=rf"tensor '{bad}'.*{error}"):
                apply_version(tp, staged[2].directory, base_version="2", weight_version=None, flush_cache=True)
            tp.update_weights([(bad, dict(w2)[bad])], version="2")  # every rank right again
    finally:
        for e in engines:
            e.shutdown()


def _rank1_only(engine: Engine, name: str, value: torch.Tensor) -> None:
    """Write whole tensor `value` of `name` into rank 1 of a TP 2 engine only: every rank takes it (the broadcast),
    then rank 0 puts its old part back."""
    assert engine.tp is not None
    old = engine.whole_weights([name])[name]
    engine.tp.apply(engine.model, [(name, value)])
    engine.tp.shard.apply(engine.model, [(name, old)])


@pytest.mark.process
def test_groups_join_and_go_while_a_tp2_engine_generates(tmp_path: Path) -> None:
    """Joining and destroying a weight-update group do not wait for the engine's steps (a join blocks until every
    rank is in): their messages to the other TP ranks go out during a forward. On CPU the forward's all-reduces
    have a gloo group of their own, so the two never mix (they did: a hang, or gloo's "data size doesn't match"),
    and a long greedy generation running meanwhile answers what a TP 1 engine does."""
    ckpt = make_ckpt(tmp_path / "m", "qwen3", 0)
    w = _weights(ckpt, 2)
    ref = Engine.from_pretrained(str(ckpt), EngineConfig(dtype="float32", max_total_tokens=4096))
    ref.update_weights(w, version="1")
    prompts = [list(range(30 + i, 50 + i)) for i in range(4)]
    sampling = SamplingParams(max_new_tokens=96, temperature=0.0, ignore_eos=True)
    reqs = [GenerateRequest(rid=f"r{i}", input_ids=tuple(p), sampling=sampling) for i, p in enumerate(prompts)]
    want = [run(ref, r)[r.rid].output_ids for r in reqs]
    ref.shutdown()
    server = start_server(ckpt, tmp_path / "s", "--tp-size", "2", "--dtype", "float32")
    try:

        async def main() -> None:
            client = EngineClient(server.url, connect_retries=0)
            spec = GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, bucket_bytes=1 << 15, timeout_s=60)
            sync = BroadcastSync(spec)
            try:
                await sync.connect([client])
                await sync.push(iter(w), "1")
                await sync.close()
                params = {"max_new_tokens": 96, "temperature": 0.0, "ignore_eos": True}
                gens = [asyncio.ensure_future(client.generate(p, params)) for p in prompts]
                cycles = 0
                while not all(g.done() for g in gens) or cycles < 2:
                    cycles += 1
                    sync = BroadcastSync(spec)
                    await asyncio.wait_for(sync.connect([client]), 60)
                    await asyncio.wait_for(sync.close(), 60)
                outs = await asyncio.wait_for(asyncio.gather(*gens), 120)
                assert [o.output_ids for o in outs] == want
                assert all(o.weight_version == "1" for o in outs)
            finally:
                await sync.close()
                await client.close()

        asyncio.run(main())
        assert server.proc.poll() is None, "the engine exited"
    finally:
        server.stop()
