"""The fully async RL loop (stage: loop; ``mode: fully_async``). Rollout never stops for training:

    producer (async_rollout.py): keep max_inflight samples generating; finished groups -> scored -> buffer
    for step: take prompts_per_step groups no staler than max_staleness -> advantages -> train step
              -> publish the weights while generation pauses per sync.pause_mode, then goes on -> store, metrics

Versions. The trainer's weights after ``k`` steps are version ``k``; every generated token records the version
that produced it, so a group started before an update and finished after it is mixed, and its staleness is
``k - oldest token version``. Tokens more than ``fully_async.mask_tokens_older_than`` versions behind are
loss-masked (None: all tokens train, with the IS correction of ``algo.tis_cap`` / ``algo.mis_*`` on each token's
rollout log-prob).

Multi-turn agents (``rollout.agent``) run here as in the sync loop: each sample is an episode, its slot held
until the episode ends; its environment scores it. On-policy distillation (``algo.opd_teacher``): the teacher
scores each batch before the step, while the engines keep generating.

Metrics per step: ``async/trainer_idle_frac`` (time waiting for groups / step time), ``async/engine_util`` (mean
fraction of the max_inflight slots generating), ``async/buffer_depth``, ``async/staleness_mean|max`` and the
histogram ``async/staleness_<s>`` (groups of each staleness), ``async/dropped_stale``, ``perf/samples_per_s``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from miles_hpc.loop.async_rollout import GroupBuffer, Producer, staleness
from miles_hpc.loop.rollout_step import Rollout, check_reward_failures
from miles_hpc.loop.sync import (
    LoopContext,
    end_of_step,
    opd_kl,
    publish,
    rollout_metrics,
    teacher_scores,
    to_train_batch,
    train,
    trainable,
    warmup,
)


async def run(ctx: LoopContext, start_step: int) -> list[float]:
    """Train from ``start_step`` to ``cfg.steps`` with rollout running all along; the mean reward per step."""
    cfg, fa = ctx.cfg, ctx.cfg.fully_async
    if start_step == 0 and cfg.train.sft_warmup_steps:
        warmup(ctx)
    await publish(ctx, version=start_step)  # the engines start from the trainer's weights
    buffer = GroupBuffer(fa.buffer_groups)
    producer = _producer(ctx, buffer, start_step)
    stale_dropped = 0

    def on_stale(group: list[Rollout]) -> None:
        nonlocal stale_dropped
        stale_dropped += 1
        producer.discarded += 1  # take() holds the buffer's lock: the admission check runs at the next notify
        if fa.stale_policy == "recycle":
            producer.recycle(group[0].record)

    running = asyncio.ensure_future(producer.run())
    rewards: list[float] = []
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            groups = await _take(buffer, running, cfg.rollout.prompts_per_step, step, fa.max_staleness, on_stale)
            t_wait = time.perf_counter() - t0
            stale = [staleness(g, step) for g in groups]
            samples = [r.sample for g in groups for r in g]
            failed = check_reward_failures(samples, cfg.reward.max_failed_frac, step, producer.reward_traces)
            opd = await teacher_scores(ctx, groups)  # the teacher scores while the engines keep generating
            batch = to_train_batch(groups, cfg, opd)
            if batch is not None and fa.mask_tokens_older_than is not None:
                trained = [s for s in samples if trainable(s, cfg)]
                mask_old_tokens(batch.loss_mask, batch.advantages, trained, step - fa.mask_tokens_older_than)
            t1 = time.perf_counter()
            # In a worker thread: the event loop keeps scheduling generations while the trainer computes.
            train_metrics = await asyncio.to_thread(train, ctx, batch, step)
            t_train = time.perf_counter() - t1
            t2 = time.perf_counter()
            sync_metrics = await publish(ctx, version=step + 1)
            await producer.set_version(step + 1)
            t_sync = time.perf_counter() - t2
            for s in samples:
                s.train_step = step
            if ctx.store is not None:
                ctx.store.append(samples)
            rewards.append(statistics.fmean(s.reward for s in samples))
            wall = time.perf_counter() - t0
            ctx.metrics.log(
                step,
                {
                    **rollout_metrics(samples),
                    **train_metrics,
                    **sync_metrics,
                    "weight_version": step + 1,
                    "rollout/failed": failed,
                    "rollout/skipped_prompts": producer.stats.skipped_prompts,
                    **({} if opd is None else {"opd/reverse_kl": opd_kl(groups, cfg, opd)}),
                    **_async_metrics(producer, buffer, stale, stale_dropped, t_wait / wall),
                    "time/wait_s": t_wait,
                    "time/train_s": t_train,
                    "time/sync_s": t_sync,
                    "perf/samples_per_s": len(samples) / wall,
                    "perf/tokens_per_s": (0 if batch is None else batch.num_tokens) / wall,
                },
            )
            # Prompts drawn from the data but not trained yet (buffered, generating, recycled) go with the
            # checkpoint and are generated first after a restart: none is skipped, none trained twice.
            if end_of_step(ctx, step, at_end=True, state=lambda: {"async_pending": producer.unconsumed(buffer)}):
                break
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return rewards


def _producer(ctx: LoopContext, buffer: GroupBuffer, start_step: int) -> Producer:
    """The producer of groups for ``buffer``, first given the prompts drawn but not trained before a restart."""
    producer = Producer(
        ctx.cfg,
        ctx.router,
        ctx.prompts,
        ctx.render,
        ctx.tokenizer,
        ctx.reward_fn,
        buffer,
        first_group_id=start_step * 1_000_000,
        version=start_step,
        agent=ctx.agent,
        max_prompt_len=ctx.max_prompt_len,
    )
    by_id = {r.prompt_id: r for r in ctx.records}
    for pid in (ctx.resumed or {}).get("async_pending", []):
        producer.pending.append(by_id[pid])
    return producer


async def _take(
    buffer: GroupBuffer,
    running: asyncio.Future[Any],
    n: int,
    step: int,
    max_staleness: int,
    on_stale: Callable[[list[Rollout]], None],
) -> list[list[Rollout]]:
    """The step's ``n`` groups from the buffer, or the producer's error if it stopped first."""
    take = asyncio.ensure_future(buffer.take(n, step, max_staleness, on_stale))
    await asyncio.wait({take, running}, return_when=asyncio.FIRST_COMPLETED)
    if not take.done():  # the producer stopped: its error says why
        take.cancel()
        running.result()
    return take.result()


def _async_metrics(
    producer: Producer, buffer: GroupBuffer, stale: list[int], stale_dropped: int, idle_frac: float
) -> dict[str, float]:
    hist = Counter(stale)
    return {
        "async/trainer_idle_frac": idle_frac,
        "async/engine_util": producer.utilisation(),
        "async/buffer_depth": len(buffer),
        "async/dropped_stale": stale_dropped,
        "async/dropped_zero_variance": producer.stats.dropped_zero_variance,
        "async/staleness_mean": statistics.fmean(stale),
        "async/staleness_max": max(stale),
        **{f"async/staleness_{k}": v for k, v in sorted(hist.items())},
    }


def mask_old_tokens(loss_mask: list[list[int]], advantages: list[list[float]], samples: list, oldest: int) -> None:
    """Loss-mask (and zero the advantage of) generated tokens whose weight version is below ``oldest``."""
    for m, a, s in zip(loss_mask, advantages, samples):
        for i, v in enumerate(s.policy_version):
            if m[i] and v < oldest:
                m[i], a[i] = 0, 0.0
