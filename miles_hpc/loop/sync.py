"""The synchronous RL loop (stage: loop; STYLE 1: it reads like the algorithm).

    for step: generate n samples per prompt -> rewards -> advantages -> train step -> weight sync (+ verify)
              -> append samples to the HDF5 store -> metrics -> checkpoint

Checked every step: every generated token carries the weight version the trainer published last (``step``),
the trainer re-hashes every sample's tokens (TITO), rollout vs train log-probs are compared (``mismatch/*``), and
the engines' weight checksums equal the trainer's after each sync.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_hpc.config import RunConfig
from miles_hpc.data.prompts import PromptIterator, PromptRecord, TokenizerLike
from miles_hpc.data.store import TrajectoryWriter
from miles_hpc.faults import crash_point
from miles_hpc.loop.rollout_step import (
    Rollout,
    check_reward_failures,
    fits,
    generate_groups,
    reward_failed,
    score,
)
from miles_hpc.loop.warmup import warmup_batches
from miles_hpc.metrics import MetricsLogger
from miles_hpc.rollout.agents import AgentFn
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.distill import opd_advantages, teacher_logprobs
from miles_hpc.rollout.filters import drop_zero_variance_groups
from miles_hpc.rollout.rewards import RewardFn
from miles_hpc.rollout.router import Router
from miles_hpc.sync.publish import Publisher
from miles_hpc.train.advantages import compute_advantages
from miles_hpc.train.batch import TrainBatch


class LoopTrainer(Protocol):
    """The trainer verbs the loops call (the controller's `RankedTrainer`, which runs each on every rank)."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]: ...

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path: ...

    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def _never() -> bool:
    return False


@dataclass(slots=True)
class LoopContext:
    """Everything a loop reads, built once by the controller (launch/controller.py)."""

    cfg: RunConfig
    trainer: LoopTrainer
    router: Router
    publisher: Publisher
    prompts: PromptIterator
    records: Sequence[PromptRecord]  # the prompt records (for the warm-up)
    render: Callable[[PromptRecord], list[int]]  # a record -> its prompt token ids
    tokenizer: TokenizerLike
    reward_fn: RewardFn
    store: TrajectoryWriter | None
    metrics: MetricsLogger
    checkpoints: Path  # RUN/checkpoints
    resumed: dict[str, Any] | None = None  # the checkpoint's extra state when the run resumed
    stop_requested: Callable[[], bool] = _never  # True: checkpoint after this step and return (preemption, walltime)
    agent: AgentFn | None = None  # rollout.agent, loaded (multi-turn episodes)
    teacher: EngineClient | None = None  # the OPD teacher's engine (algo.opd_teacher)
    max_prompt_len: int | None = None  # longer prompts are skipped (rollout_step.max_prompt_len)


class LoopError(RuntimeError):
    """A per-step check failed (version skew, verification); the message says which and where."""


async def run(ctx: LoopContext, start_step: int) -> list[float]:
    """Train from ``start_step`` to ``cfg.steps``; returns the mean reward of each step."""
    cfg = ctx.cfg
    rewards: list[float] = []
    if start_step == 0 and cfg.train.sft_warmup_steps:
        warmup(ctx)
        await publish(ctx, version=0)
    elif start_step == 0 and ctx.publisher.sync.publish_at_start:
        await publish(ctx, version=0)  # e.g. LoRA: the engines serve the adapter by name from the first rollout on
    if start_step > 0:  # resumed: the engines loaded the base model, give them the trainer's weights
        await publish(ctx, version=start_step)
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        groups, rounds, counts = await rollout(ctx, step)
        t_rollout = time.perf_counter() - t0
        check_versions(groups, step)
        opd = await teacher_scores(ctx, groups)
        batch = to_train_batch(groups, cfg, opd)
        t1 = time.perf_counter()
        train_metrics = train(ctx, batch, step)
        t_train = time.perf_counter() - t1
        t2 = time.perf_counter()
        sync_metrics = await publish(ctx, version=step + 1)
        t_sync = time.perf_counter() - t2
        samples = [r.sample for g in groups for r in g]
        for s in samples:
            s.train_step = step
        if ctx.store is not None:
            ctx.store.append(samples)
        crash_point("step:stored")
        step_rewards = [s.reward for s in samples]
        rewards.append(statistics.fmean(step_rewards))
        ctx.metrics.log(
            step,
            {
                **rollout_metrics(samples),
                **train_metrics,
                **sync_metrics,
                **counts,
                "weight_version": step + 1,
                "rollout/rounds": rounds,
                **({} if opd is None else {"opd/reverse_kl": opd_kl(groups, cfg, opd)}),
                "time/rollout_s": t_rollout,
                "time/train_s": t_train,
                "time/sync_s": t_sync,
                "perf/tokens_per_s": (batch.num_tokens if batch else 0) / max(1e-9, time.perf_counter() - t0),
            },
        )
        if end_of_step(ctx, step):
            break
    return rewards


def warmup(ctx: LoopContext) -> None:
    """Supervised warm-up on the prompt data (loop/warmup.py), logged to the console only."""
    cfg = ctx.cfg
    batches = warmup_batches(
        ctx.records,
        ctx.render,
        ctx.tokenizer,
        steps=cfg.train.sft_warmup_steps,
        batch_size=cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
        shuffle_labels=cfg.train.sft_warmup_shuffle_labels,
        seed=cfg.seed,
    )
    for i, batch in enumerate(batches):
        m = ctx.trainer.train_step(batch)
        # Warm-up batches carry rollout log-probs of 0, so the trainer's mean |train - rollout| log-prob difference
        # is the answer tokens' mean negative log-likelihood before the update.
        if (i + 1) % 10 == 0 or i + 1 == cfg.train.sft_warmup_steps:
            nll = m["mismatch/mean_abs_logprob_diff"]
            print(f"[miles-hpc] warm-up {i + 1}/{cfg.train.sft_warmup_steps} | answer nll {nll:.3f}", flush=True)


def train(ctx: LoopContext, batch: TrainBatch | None, step: int) -> dict[str, float]:
    """One train step on every rank (none when every sample was left out); the publisher learns the trainer moved."""
    if batch is None:
        print(f"[miles-hpc] step {step}: no sample to train on (every one failed its reward)", flush=True)
        return {}
    out = ctx.trainer.train_step(batch)
    ctx.publisher.note_trained()
    return out


async def rollout(ctx: LoopContext, step: int) -> tuple[list[list[Rollout]], int, dict[str, float]]:
    """Groups for one step, rounds of generation, counts (failed rewards, skipped prompts); with dynamic sampling,
    drop zero-variance groups and generate more until full. Prompts too long for the engines are skipped."""
    cfg = ctx.cfg
    want = cfg.rollout.prompts_per_step
    kept: list[list[Rollout]] = []
    rounds = skipped = 0
    traces: list[str] = []
    while len(kept) < want:
        rounds += 1
        drawn = ctx.prompts.next_batch()
        rendered = [(r, ctx.render(r)) for r in drawn]
        fitting = [(r, ids) for r, ids in rendered if fits(ids, ctx.max_prompt_len)]
        skipped += len(rendered) - len(fitting)
        if not fitting:
            if rounds >= cfg.algo.max_sampling_rounds:
                raise LoopError(
                    f"step {step}: every prompt drawn in {rounds} rounds is longer than the engines take "
                    f"({ctx.max_prompt_len} tokens = context - rollout.max_new_tokens - 2)"
                )
            continue
        records = [r for r, _ in fitting]
        groups = await generate_groups(
            ctx.router,
            records,
            [ids for _, ids in fitting],
            cfg.rollout,
            ctx.tokenizer,
            first_group_id=step * 1_000_000 + rounds * 10_000,
            seed=cfg.seed,
            routed_experts=cfg.algo.routing_replay,
            indexer_topk=cfg.algo.indexer_replay,
            agent=ctx.agent,
        )
        if ctx.agent is None:  # an agent's environment has scored its episodes
            traces += await score(groups, ctx.reward_fn)
        if not cfg.algo.dynamic_sampling:
            kept = groups
            break
        useful, _ = drop_zero_variance_groups([[r.sample for r in g] for g in groups])
        useful_ids = {g[0].group_id for g in useful}
        kept += [g for g in groups if g[0].sample.group_id in useful_ids]
        if rounds >= cfg.algo.max_sampling_rounds and len(kept) < want:
            kept += [g for g in groups if g[0].sample.group_id not in useful_ids][: want - len(kept)]
    kept = kept[:want]
    failed = check_reward_failures([r.sample for g in kept for r in g], cfg.reward.max_failed_frac, step, traces)
    if skipped:
        print(f"[miles-hpc] step {step}: skipped {skipped} prompts longer than {ctx.max_prompt_len} tokens", flush=True)
    return kept, rounds, {"rollout/failed": failed, "rollout/skipped_prompts": skipped}


def check_versions(groups: list[list[Rollout]], step: int) -> None:
    """In the synchronous loop every generated token comes from the weights published after step - 1."""
    for g in groups:
        for r in g:
            s = r.sample  # generated tokens only (a multi-turn sample also holds tool output, version -1)
            versions = {v for v, m in zip(s.policy_version[s.prompt_len :], s.loss_mask[s.prompt_len :]) if m}
            if versions - {step}:
                raise LoopError(
                    f"step {step}: sample of group {r.sample.group_id} has tokens from weight "
                    f"versions {sorted(versions)}; the engines should hold version {step}"
                )


async def teacher_scores(ctx: LoopContext, groups: list[list[Rollout]]) -> list[list[float]] | None:
    """On-policy distillation: the teacher's log-prob of every token of every sample (None when OPD is off)."""
    if ctx.teacher is None:
        return None
    return await teacher_logprobs(ctx.teacher, [r.sample for g in groups for r in g])


def opd_kl(groups: list[list[Rollout]], cfg: RunConfig, teacher: list[list[float]]) -> float:
    samples = [r.sample for g in groups for r in g]
    zeros = [[0.0] * len(s.tokens) for s in samples]
    return opd_advantages(zeros, samples, teacher, cfg.algo.opd_coef)[1]


def trainable(sample: Any, cfg: RunConfig) -> bool:
    """Whether ``sample`` goes into the train batch (a failed reward keeps it out unless reward.train_on_failed)."""
    return cfg.reward.train_on_failed or not reward_failed(sample)


def to_train_batch(
    groups: list[list[Rollout]], cfg: RunConfig, teacher: list[list[float]] | None = None
) -> TrainBatch | None:
    """Samples -> the trainer's batch: per-token advantages (task reward, plus the OPD term with `teacher`). Samples
    whose reward failed are left out (and out of their group's advantages) unless ``reward.train_on_failed``; None
    when none is left."""
    samples = [r.sample for g in groups for r in g]
    keep = [i for i, s in enumerate(samples) if trainable(s, cfg)]
    samples = [samples[i] for i in keep]
    teacher = None if teacher is None else [teacher[i] for i in keep]
    if not samples:
        return None
    adv = compute_advantages(
        [s.reward for s in samples], [s.group_id for s in samples], [s.response_len for s in samples], cfg.algo
    )
    per_token = [[a * m for m in s.loss_mask] for a, s in zip(adv, samples)]
    if teacher is not None:
        per_token, _ = opd_advantages(per_token, samples, teacher, cfg.algo.opd_coef, only=cfg.algo.opd_only)
    return TrainBatch(
        tokens=[list(s.tokens) for s in samples],
        loss_mask=[list(s.loss_mask) for s in samples],
        rollout_logprobs=[list(s.rollout_logprobs) for s in samples],
        advantages=per_token,
        token_hash=[s.token_hash for s in samples],
        group_ids=[s.group_id for s in samples],
        routed_experts=[s.routed_experts for s in samples] if cfg.algo.routing_replay else None,
        indexer_topk=[s.indexer_topk for s in samples] if cfg.algo.indexer_replay else None,
    )


async def publish(ctx: LoopContext, version: int) -> dict[str, float]:
    """Weights of the trainer -> every engine, verified against what was sent (sync/publish.py: pause mode, failed
    engines dropped, checksums); returns the sync metrics."""
    sync = ctx.publisher.sync
    report = await ctx.publisher.publish(sync.source(ctx.trainer), str(version))  # what the strategy sends
    return {
        "sync/engines": report.engines,
        "sync/dropped_engines": len(report.dropped),
        "sync/verified_tensors": report.tensors,  # checksums each engine matched (tensors; p2p: pieces)
        **sync.metrics(),
    }


def rollout_metrics(samples: list[Any]) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    lens = [s.response_len for s in samples]
    status = [int(s.status) for s in samples]
    out = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "response_len_mean": statistics.fmean(lens),
        "response_len_max": max(lens),
        "rollout/truncated_frac": status.count(1) / len(status),
        "rollout/failed_frac": status.count(3) / len(status),
        "rollout/samples": len(samples),
    }
    episodes = [s.metadata for s in samples if "turns" in s.metadata]
    if episodes:  # multi-turn: turns, and how much of what the engines prefilled came from their prefix caches
        prompt = sum(m["prompt_tokens"] for m in episodes)
        out["rollout/turns_mean"] = statistics.fmean(m["turns"] for m in episodes)
        out["prefix_cache_hit_rate"] = sum(m["cached_tokens"] for m in episodes) / prompt if prompt else 0.0
    return out


def end_of_step(
    ctx: LoopContext, step: int, *, at_end: bool = False, state: Callable[[], dict[str, Any]] = dict
) -> bool:
    """After ``step``: checkpoint when a stop was requested (preemption, walltime), every
    ``train.checkpoint_interval`` steps, and after the last step with ``at_end``; ``state()``: what else the
    checkpoint holds. True: the loop returns now (the stop)."""
    every, stop = ctx.cfg.train.checkpoint_interval, ctx.stop_requested()
    if stop or (at_end and step + 1 == ctx.cfg.steps) or (every and (step + 1) % every == 0):
        save_checkpoint(ctx, step + 1, **state())
    if stop:
        print(f"[miles-hpc] stop requested: checkpoint after step {step + 1}, exiting", flush=True)
    return stop


def save_checkpoint(ctx: LoopContext, next_step: int, **state: Any) -> None:
    """Trainer state plus the loop's (next step, data position; ``state``: whatever else the loop must resume)."""
    extra = {"next_step": next_step, "weight_version": next_step, "prompts": ctx.prompts.state_dict(), **state}
    if ctx.store is not None:
        ctx.store.roll()  # the trajectories of every step before the checkpoint survive a crash after it
    crash_point("checkpoint:rolled")  # a crash here: the resume discards the rolled shard's uncovered samples
    ctx.trainer.save(ctx.checkpoints / f"step_{next_step}", extra)
    crash_point("checkpoint:saved")
