"""The fully async loop's parts (loop/async_rollout.py, loop/fully_async.py): staleness, the bounded buffer and its
stale policy, per-sample slots in the producer (a slow sample frees nothing but its own slot, the cap is never
exceeded, backpressure stops new groups), continuation of samples aborted by a pause, loss-masking of old tokens;
and the whole loop end to end on CPU (tests/test_loop_e2e.py style), with a checkpoint that carries every prompt
drawn but not yet trained.

The producer tests drive the real Producer/GroupBuffer against a stand-in router whose generations take seeded,
long-tailed times (the engine itself is covered by the end-to-end test)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles_hpc.config import load_config
from miles_hpc.data.prompts import PromptIterator, PromptRecord
from miles_hpc.data.sample import Sample, SampleStatus
from miles_hpc.loop.async_rollout import GroupBuffer, Producer, generate_sample, staleness
from miles_hpc.loop.fully_async import mask_old_tokens
from miles_hpc.loop.rollout_step import Rollout
from miles_hpc.rollout.responses import FinishReason, GenerateOutput, WeightVersionSpan

REPO = Path(__file__).resolve().parents[1]


def rollout(versions: list[int], prompt_len: int = 2, group_id: int = 0, prompt_id: int = 0) -> Rollout:
    n = len(versions)
    sample = Sample(
        prompt_id=prompt_id,
        group_id=group_id,
        tokens=[1] * (prompt_len + n),
        prompt_len=prompt_len,
        loss_mask=[0] * prompt_len + [1] * n,
        rollout_logprobs=[0.0] * (prompt_len + n),
        policy_version=[-1] * prompt_len + versions,
        reward=0.0,
        status=SampleStatus.COMPLETED,
        metadata={},
    )
    return Rollout(PromptRecord(prompt_id=prompt_id, prompt="p"), sample, "")


def test_staleness_is_the_oldest_generated_token() -> None:
    group = [rollout([3, 3, 4]), rollout([4, 4])]
    assert staleness(group, 4) == 1 and staleness(group, 6) == 3
    assert staleness([rollout([])], 5) == 0  # nothing generated: nothing stale (prompt tokens are -1)


def test_buffer_takes_fresh_groups_and_hands_stale_ones_back() -> None:
    async def main() -> None:
        buf = GroupBuffer(capacity=4)
        for gid, v in enumerate([0, 2, 3, 3]):
            await buf.put([rollout([v], group_id=gid)])
        stale: list[int] = []
        taken = await buf.take(2, version=3, max_staleness=1, on_stale=lambda g: stale.append(g[0].sample.group_id))
        assert [g[0].sample.group_id for g in taken] == [1, 2] and stale == [0] and len(buf) == 1
        # Not enough fresh groups: take waits until the producer puts more.
        waiting = asyncio.ensure_future(buf.take(2, version=3, max_staleness=1, on_stale=stale.append))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await buf.put([rollout([3], group_id=9)])
        assert [g[0].sample.group_id for g in await waiting] == [3, 9]
        # A failed producer ends every take with its error.
        await buf.fail(ValueError("engine gone"))
        with pytest.raises(RuntimeError, match="engine gone"):
            await buf.take(1, version=3, max_staleness=1, on_stale=stale.append)

    asyncio.run(main())


class LongTailRouter:
    """Stand-in for Router.generate: each call sleeps a seeded lognormal time (p99 >> median) and returns
    ``max_new_tokens`` tokens at the current weight ``version``; records the concurrency it sees."""

    def __init__(self, seed: int = 0, *, scale: float = 0.004) -> None:
        self.rng, self.scale = random.Random(seed), scale
        self.version, self.running, self.peak, self.calls = 0, 0, 0, 0
        self.abort_next = 0  # the next k generations come back aborted halfway (a pause in abort mode)

    async def generate(self, ids: list[int], params: dict[str, Any], **kw: Any) -> GenerateOutput:
        self.calls += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.scale * self.rng.lognormvariate(0.0, 1.0))
        finally:
            self.running -= 1
        n = int(params["max_new_tokens"])
        finish = "length"
        if self.abort_next and n > 1:
            self.abort_next -= 1
            n, finish = n // 2, "abort"
        v = str(self.version)
        return GenerateOutput(
            rid=f"r{self.calls}",
            output_ids=[7] * n,
            finish_reason=FinishReason(type=finish),
            prompt_tokens=len(ids),
            completion_tokens=n,
            cached_tokens=0,
            output_logprobs=[-0.5] * n,
            weight_version=v,
            weight_versions=(WeightVersionSpan(version=v, start=0, end=n),) if n else (),
        )


class Tok:
    def decode(self, ids: list[int], **kw: Any) -> str:
        return "x" * len(ids)


async def reward(inp: Any) -> float:
    return float(inp.sample.group_id % 2)  # groups alternate 0/1: zero variance inside, as dynamic sampling sees


def producer_for(router: LongTailRouter, buffer: GroupBuffer, *overrides: str) -> Producer:
    cfg = load_config(
        REPO / "configs/tiny_cpu.yaml",
        ["mode=fully_async", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", *overrides],
    )
    records = [PromptRecord(prompt_id=i, prompt=f"{i}+1=", label=str(i + 1)) for i in range(64)]
    prompts = PromptIterator(records, batch_size=4, seed=0, shuffle=False)
    return Producer(cfg, router, prompts, lambda r: [1, 2, 3], Tok(), reward, buffer, first_group_id=0)


def test_producer_keeps_slots_full_without_waiting_for_the_slowest_sample() -> None:
    async def main() -> None:
        router = LongTailRouter()
        buffer = GroupBuffer(capacity=100_000)  # never full here
        producer = producer_for(
            router,
            buffer,
            "fully_async.max_inflight=8",
            "fully_async.buffer_groups=100000",
            "fully_async.max_staleness=100000",
        )  # no admission limit here
        task = asyncio.ensure_future(producer.run())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert router.peak == 8  # the cap is reached and never exceeded
        assert producer.stats.finished_groups >= 10 and len(buffer) == producer.stats.finished_groups
        # Slots are per sample: a group's slow sample does not stop the next groups from starting, so far more
        # groups were started than the 2 (= 8 slots / 4 samples) a per-group scheduler would run at once.
        assert producer.stats.started_groups - producer.stats.finished_groups <= 8
        assert producer.utilisation() > 0.5
        group = buffer.groups[0]
        assert len(group) == 4 and all(r.sample.response_len == 6 for r in group)

    asyncio.run(main())


def test_backpressure_stops_new_groups_when_the_buffer_is_full() -> None:
    async def main() -> None:
        router = LongTailRouter(scale=0.001)
        buffer = GroupBuffer(capacity=8)
        producer = producer_for(
            router,
            buffer,
            "fully_async.max_inflight=8",
            "fully_async.buffer_groups=8",
            "fully_async.max_staleness=100000",
        )
        task = asyncio.ensure_future(producer.run())
        await asyncio.sleep(0.3)
        started = producer.stats.started_groups
        # Full, never over; every started group is buffered or still in flight (generating, holding at most the 8
        # slots, or scored and waiting to be put: how many of those there are depends on how late the scoring
        # ran, so no fixed bound: a loaded CI machine saw 13 started with 8 buffered).
        assert len(buffer) == 8 and started == 8 + len(producer.inflight)
        assert producer._busy <= 8
        await asyncio.sleep(0.1)
        assert producer.stats.started_groups == started  # nothing new while full
        await buffer.take(4, version=0, max_staleness=0, on_stale=lambda g: None)
        await asyncio.sleep(0.1)
        assert producer.stats.started_groups > started  # room again: the producer goes on
        assert sorted(producer.unconsumed(buffer)) == sorted(
            [g[0].record.prompt_id for g in buffer.groups]
            + [r.prompt_id for r in producer.inflight.values()]
            + [r.prompt_id for r in producer.pending]  # drawn from the data (a batch at a time), not started
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_admission_starts_only_groups_that_can_train_before_they_expire() -> None:
    async def main() -> None:
        buffer = GroupBuffer(capacity=1000)
        producer = producer_for(
            LongTailRouter(scale=0.0005),
            buffer,
            "rollout.prompts_per_step=4",
            "fully_async.max_staleness=1",
            "fully_async.buffer_groups=1000",
        )
        task = asyncio.ensure_future(producer.run())
        await asyncio.sleep(0.15)
        assert producer.stats.started_groups == (0 + 1 + 1) * 4  # version 0, staleness 1: two steps' worth
        await producer.set_version(1)
        await asyncio.sleep(0.1)
        assert producer.stats.started_groups == 3 * 4
        await producer.discard(2)  # two groups will never train (stale, or zero variance): two more may start
        await asyncio.sleep(0.1)
        assert producer.stats.started_groups == 3 * 4 + 2
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_a_sample_aborted_by_a_pause_continues_from_its_tokens() -> None:
    async def main() -> None:
        router = LongTailRouter(scale=0.0)
        router.abort_next = 1  # 3 of 6 tokens at version 0, then the update to version 1
        params = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 5}

        async def generate(ids: list[int], p: dict[str, Any], **kw: Any) -> GenerateOutput:
            out = await LongTailRouter.generate(router, ids, p, **kw)
            router.version = 1
            return out

        router.generate = generate  # type: ignore[method-assign]
        r = await generate_sample(router, PromptRecord(prompt_id=0, prompt="p"), [1, 2], params, 0, Tok())  # type: ignore[arg-type]
        assert r.sample.response_len == 6 and r.sample.policy_version[2:] == [0, 0, 0, 1, 1, 1]
        assert router.calls == 2

    asyncio.run(main())


def test_mask_old_tokens() -> None:
    s = rollout([1, 2, 3]).sample
    mask, adv = [list(s.loss_mask)], [[0.0, 0.0, 1.0, 1.0, 1.0]]
    mask_old_tokens(mask, adv, [s], oldest=2)
    assert mask == [[0, 0, 0, 1, 1]] and adv == [[0.0, 0.0, 0.0, 1.0, 1.0]]


def cli_argv(run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        "mode=fully_async",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "train.world_size=1",
        "train.sft_warmup_steps=0",
        "fully_async.max_inflight=8",
        "fully_async.buffer_groups=4",
        *overrides,
    ]


def run_cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_argv(run_dir, *overrides), capture_output=True, text=True, timeout=600, cwd=REPO, check=False
    )


@pytest.mark.process
def test_fully_async_loop_end_to_end_and_resume_accounts_for_every_prompt(tmp_path: Path) -> None:
    from miles_hpc.data import TrajectoryReader

    run_dir = tmp_path / "run"
    proc = run_cli(run_dir, "steps=3", "train.checkpoint_interval=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in m] == [1, 2, 3]
    for r in m:
        assert 0 <= r["async/staleness_max"] <= 2 and 0.0 <= r["async/trainer_idle_frac"] <= 1.0
        assert r["async/buffer_depth"] <= 4 and 0.0 < r["async/engine_util"] <= 1.0 + 1e-9
    pending3 = json.loads((run_dir / "checkpoints" / "step_3" / "extra.json").read_text())["async_pending"]
    # Resume for 2 more steps: the prompts pending at the checkpoint are generated first; none trained twice.
    proc = run_cli(run_dir, "steps=5", "train.checkpoint_interval=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trained = [s.prompt_id for s in TrajectoryReader(run_dir / "trajectories")]
    per_prompt = {p: trained.count(p) for p in set(trained)}
    assert set(per_prompt.values()) == {2}, per_prompt  # each trained prompt: its 2 samples, in one step only
    assert len(per_prompt) == 5 * 2
    assert set(pending3) & set(per_prompt), "prompts pending at the checkpoint were trained after the restart"


@pytest.mark.process
def test_killed_mid_flight_then_resumed_trains_every_drawn_prompt_once(tmp_path: Path) -> None:
    import os
    import signal
    import time

    from miles_hpc.data import TrajectoryReader

    run_dir = tmp_path / "run"
    argv = cli_argv(run_dir, "steps=40", "train.checkpoint_interval=2")
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, start_new_session=True
    )
    metrics, ckpt = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "step_2"
    deadline = time.monotonic() + 300
    try:
        while not (ckpt.exists() and metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run, mid-flight: no chance to save anything
        proc.wait()
        # Its engines run in sessions of their own (as on a node, where the job's cgroup would end them): end them.
        for rec in (run_dir / "rendezvous").glob("engine-*.json"):
            try:
                os.kill(int(json.loads(rec.read_text())["pid"]), signal.SIGKILL)
            except (ProcessLookupError, ValueError, KeyError):
                pass
    pending = json.loads((ckpt / "extra.json").read_text())["async_pending"]
    resumed = run_cli(run_dir, "steps=4", "train.checkpoint_interval=2")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    # What counts: steps 0-1 of the killed run (before its checkpoint), then steps 2-3 of the resumed one.
    trained: list[int] = []
    for f in sorted((run_dir / "trajectories").glob("*.h5")):
        keep = (lambda s: s.train_step < 2) if f.name.startswith("traj-s000000") else (lambda s: True)
        trained += [s.prompt_id for s in TrajectoryReader(f) if keep(s)]
    counts = {p: trained.count(p) for p in set(trained)}
    assert len(counts) == 4 * 2 and set(counts.values()) == {2}, counts  # 4 steps x 2 prompts, each once (2 samples)
    assert set(pending) <= set(counts) | set(
        json.loads((run_dir / "checkpoints" / "step_4" / "extra.json").read_text())["async_pending"]
    )


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
@pytest.mark.process
def test_an_update_mid_generation_on_a_real_engine_keeps_every_token(mode: str, tmp_path: Path) -> None:
    """A real engine, a real broadcast publish while a long generation runs: the sample comes back whole (abort
    mode: continued from its tokens), its first tokens at version 0 and its last at version 1, with a routing row
    (R3) for every token but the last (abort mode: the pieces' rows stitched)."""
    import torch
    from test_client_engine import engine_fleet, tiny_model

    from miles_hpc.launch.local import free_port
    from miles_hpc.models import iter_hf_tensors, load_pretrained
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.router import Router, RouterConfig
    from miles_hpc.sync.publish import Publisher
    from miles_hpc.sync.strategies.base import GroupSyncSpec
    from miles_hpc.sync.strategies.broadcast import BroadcastSync

    model = load_pretrained(tiny_model())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    named = [(n, t.detach().clone()) for n, t in iter_hf_tensors(model)]
    with engine_fleet(tmp_path, 1, wait=True) as procs:

        async def main() -> None:
            clients = [EngineClient(f"http://127.0.0.1:{p.port}", connect_retries=0) for p in procs]
            async with Router(clients, RouterConfig(health_interval_s=0.2), owns_clients=True) as router:
                sync = BroadcastSync(GroupSyncSpec(master_address="127.0.0.1", next_port=free_port, timeout_s=30))
                publisher = Publisher(sync, router, pause_mode=mode)  # type: ignore[arg-type]
                params = {"max_new_tokens": 600, "temperature": 1.0, "ignore_eos": True}
                gen = asyncio.ensure_future(
                    generate_sample(
                        router, PromptRecord(prompt_id=0, prompt="p"), [1, 2, 3], params, 0, Tok(), routed_experts=True
                    )
                )
                await asyncio.sleep(0.3)
                assert not gen.done(), "the generation finished before the update: make it longer"
                try:
                    await publisher.publish(lambda: iter(named), "1")
                finally:
                    await sync.close()
                r = await gen
                versions = r.sample.policy_version[3:]
                assert r.sample.response_len == 600 and versions[0] == 0 and versions[-1] == 1, versions[::50]
                assert versions == sorted(versions)  # one switch, old tokens first
                rows = r.sample.routed_experts
                assert rows is not None and rows.shape[0] == len(r.sample.tokens) - 1 and (rows >= 0).all()
                assert router.selector.quarantined == set()  # the pause's aborts are not engine failures

        asyncio.run(main())
