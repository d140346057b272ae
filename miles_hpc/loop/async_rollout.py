"""The producer and the buffer of the fully async loop (stage: loop; docs/design.md section 5, "fully async").

:class:`Producer` keeps ``max_inflight`` samples in flight across the engines: a group of ``n`` samples per prompt,
each sample holding one slot that it frees the moment it finishes, so a slow trajectory never holds back the
others. A finished group is scored and enters the :class:`GroupBuffer`, waiting while it is full; the producer
starts a new group only while the buffer has room (backpressure) and while the group can still be trained in time
(admission: at trainer version ``v`` at most ``(v + max_staleness + 1) x prompts_per_step`` groups are started,
minus those discarded), so generation is not spent on groups that would only expire. The trainer takes groups from the buffer as soon as enough fresh ones are
there.

Staleness. Every generated token carries the weight version that produced it (the engine's per-token version
spans); a group's staleness is ``trainer version - the oldest version of any of its generated tokens``. Groups over
``max_staleness`` are dropped, or their prompt is generated again (``stale_policy: recycle``).

Partial rollouts. A weight update pauses the engines with ``sync.pause_mode``: ``in_place`` and ``retract`` keep
each request (its later tokens carry the new version); ``abort`` returns the output so far, and the producer
continues the sample from those tokens (:func:`generate_sample`), so no generated token is thrown away.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_hpc.config import RunConfig
from miles_hpc.data.prompts import PromptIterator, PromptRecord
from miles_hpc.loop.rollout_step import Rollout, fits, sampling_params, score, to_sample
from miles_hpc.rollout.agents import AgentContext, AgentFn
from miles_hpc.rollout.filters import drop_zero_variance_groups
from miles_hpc.rollout.pieces import continue_aborted
from miles_hpc.rollout.router import Router

__all__ = ["GroupBuffer", "Producer", "generate_sample", "staleness"]


def staleness(group: Sequence[Rollout], version: int) -> int:
    """``version`` minus the oldest weight version of any generated token of the group (0 for no tokens); the
    tool output and user turns inside a multi-turn sample (loss mask 0, version -1) are not generated."""
    oldest = [
        min((v for v, m in zip(r.sample.policy_version, r.sample.loss_mask) if m), default=version) for r in group
    ]
    return version - min(oldest, default=version)


async def generate_sample(
    router: Router,
    record: PromptRecord,
    ids: list[int],
    params: dict[str, Any],
    group_id: int,
    tokenizer: Any,
    *,
    routed_experts: bool = False,
) -> Rollout:
    """One sample; a generation aborted by a weight update (pause mode ``abort``) continues from its tokens, its
    routing rows (``routed_experts``, R3) stitched across the pieces (`pieces.continue_aborted`)."""
    kw: dict[str, Any] = {"affinity_key": group_id, "return_logprob": True}
    if routed_experts:
        kw["return_routed_experts"] = True
    out = await continue_aborted(router.generate, ids, params, await router.generate(ids, params, **kw), **kw)
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
    return Rollout(record, to_sample(out, ids, record.prompt_id, group_id), text)


class GroupBuffer:
    """Finished, scored groups waiting for the trainer, oldest first; at most ``capacity`` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.groups: collections.deque[list[Rollout]] = collections.deque()
        self.error: BaseException | None = None
        self._changed = asyncio.Condition()

    def __len__(self) -> int:
        return len(self.groups)

    async def put(self, group: list[Rollout]) -> None:
        """Add a finished group, waiting while the buffer is full (it never holds more than ``capacity``)."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.groups) < self.capacity)
            self.groups.append(group)
            self._changed.notify_all()

    async def fail(self, error: BaseException) -> None:
        """The producer failed: every waiting and later ``take`` raises ``error``."""
        async with self._changed:
            self.error = self.error or error
            self._changed.notify_all()

    async def wait_for_room(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.groups) < self.capacity)

    async def take(
        self, n: int, version: int, max_staleness: int, on_stale: Callable[[list[Rollout]], None]
    ) -> list[list[Rollout]]:
        """``n`` groups no staler than ``max_staleness`` at ``version``, stalest first, waiting until there are;
        each staler group met on the way goes to ``on_stale`` and leaves the buffer."""
        async with self._changed:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"the rollout producer failed: {self.error}") from self.error
                for g in [g for g in self.groups if staleness(g, version) > max_staleness]:
                    self.groups.remove(g)
                    on_stale(g)
                if len(self.groups) >= n:
                    # The stalest first (FIFO among equals): a group close to the limit trains now instead of
                    # expiring, which would drop long generations (they start early and finish late) more often
                    # than short ones and bias training towards short responses.
                    order = sorted(self.groups, key=lambda g: -staleness(g, version))
                    taken = order[:n]
                    self.groups = collections.deque(order[n:])
                    self._changed.notify_all()  # room for the producer
                    return taken
                self._changed.notify_all()
                await self._changed.wait()


@dataclass(slots=True)
class ProducerStats:
    started_groups: int = 0
    finished_groups: int = 0
    dropped_zero_variance: int = 0
    skipped_prompts: int = 0  # too long for the engines: drawn, never generated
    busy_slot_seconds: float = 0.0  # integral of samples in flight over time
    since: float = field(default_factory=time.monotonic)


class Producer:
    """Keeps ``max_inflight`` samples generating and feeds finished groups into ``buffer`` (module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        router: Router,
        prompts: PromptIterator,
        render: Callable[[PromptRecord], list[int]],
        tokenizer: Any,
        reward_fn: Any,
        buffer: GroupBuffer,
        *,
        first_group_id: int,
        version: int = 0,
        agent: AgentFn | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        self.cfg, self.router, self.prompts, self.render = cfg, router, prompts, render
        self.agent = agent  # rollout.agent: each sample is an episode its environment scores
        self.max_prompt_len = max_prompt_len  # longer prompts are skipped (counted in stats), never sent
        self.reward_traces: list[str] = []  # the first reward failures' tracebacks (a few), for the stop message
        self.tokenizer, self.reward_fn, self.buffer = tokenizer, reward_fn, buffer
        self.slots = asyncio.Semaphore(cfg.fully_async.max_inflight)
        self.pending: collections.deque[PromptRecord] = collections.deque()  # recycled first, then the iterator's
        self.inflight: dict[int, PromptRecord] = {}  # group id -> its prompt, while any sample runs
        self.stats = ProducerStats()
        self._next_group = first_group_id
        self._tasks: set[asyncio.Task[None]] = set()
        self._base_version = self.version = version
        self.discarded = 0  # groups generated but never to be trained (stale, zero variance): they free admission
        self._admission = asyncio.Condition()
        self._busy = 0
        self._last = time.monotonic()

    def unconsumed(self, buffer: GroupBuffer) -> list[int]:
        """Prompt ids drawn from the data and not trained: buffered groups, groups generating, recycled ones."""
        return (
            [g[0].record.prompt_id for g in buffer.groups]
            + [r.prompt_id for r in self.inflight.values()]
            + [r.prompt_id for r in self.pending]
        )

    def utilisation(self) -> float:
        """Mean fraction of the ``max_inflight`` slots that held a sample since the last call (or the start)."""
        self._account(0)
        now = time.monotonic()
        out = self.stats.busy_slot_seconds / max(1e-9, (now - self.stats.since) * self.cfg.fully_async.max_inflight)
        self.stats.busy_slot_seconds, self.stats.since = 0.0, now
        return out

    async def set_version(self, version: int) -> None:
        """The trainer published ``version``: groups for the next steps may start."""
        async with self._admission:
            self.version = version
            self._admission.notify_all()

    async def discard(self, n: int = 1) -> None:
        """``n`` started groups will not be trained (stale, or no learning signal): start as many others."""
        async with self._admission:
            self.discarded += n
            self._admission.notify_all()

    def _admissible(self) -> bool:
        # AReaL's staleness-aware admission: by version v the trainer consumes v x P groups (P per step), so a
        # group started beyond (v + max_staleness + 1) x P would be stale before its turn; it waits instead of
        # being generated and thrown away.
        steps = self.version - self._base_version + self.cfg.fully_async.max_staleness + 1
        live = self.stats.started_groups - self.discarded
        return live < steps * self.cfg.rollout.prompts_per_step

    def recycle(self, record: PromptRecord) -> None:
        self.pending.appendleft(record)

    def _next_record(self) -> PromptRecord:
        if not self.pending:
            self.pending.extend(self.prompts.next_batch())
        return self.pending.popleft()

    def _account(self, delta: int) -> None:
        now = time.monotonic()
        self.stats.busy_slot_seconds += self._busy * (now - self._last)
        self._busy, self._last = self._busy + delta, now

    async def run(self) -> None:
        """Start groups until cancelled; each group's samples take slots one by one as they free up."""
        n = self.cfg.rollout.samples_per_prompt
        params = sampling_params(self.cfg.rollout)
        samples: list[asyncio.Future[Rollout]] = []  # the group being started (not yet owned by a _finish task)
        try:
            while True:
                await self.buffer.wait_for_room()
                async with self._admission:
                    await self._admission.wait_for(self._admissible)
                record = self._next_record()
                ids = self.render(record) if self.agent is None else []  # an agent renders its own conversation
                if not fits(ids, self.max_prompt_len):
                    self.stats.skipped_prompts += 1
                    continue
                group_id = self._next_group
                self._next_group += 1
                self.inflight[group_id] = record
                self.stats.started_groups += 1
                samples = []
                for j in range(n):
                    await self.slots.acquire()
                    seeded = {
                        **params,
                        "sampling_seed": (self.cfg.seed * 1_000_003 + group_id * 1_024 + j) % (2**31 - 1),
                    }
                    samples.append(asyncio.ensure_future(self._one(record, ids, seeded, group_id)))
                task = asyncio.ensure_future(self._finish(group_id, samples))
                samples = []
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            # Nothing may outlive the producer: a generation left running would hit the router after it closed.
            pending: list[asyncio.Future[Any]] = [*self._tasks, *samples]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _one(self, record: PromptRecord, ids: list[int], params: dict[str, Any], group_id: int) -> Rollout:
        self._account(+1)
        try:
            if self.agent is not None:
                ro = self.cfg.rollout
                ctx = AgentContext(
                    generate_fn=self.router.generate,
                    tokenizer=self.tokenizer,
                    sampling=params,
                    session=group_id,
                    group_id=group_id,
                    max_turns=ro.max_turns,
                    max_output_chars=ro.max_tool_output_chars,
                    routed_experts=self.cfg.algo.routing_replay,
                )
                return Rollout(record, await self.agent(ctx, record), "")
            return await generate_sample(
                self.router,
                record,
                ids,
                params,
                group_id,
                self.tokenizer,
                routed_experts=self.cfg.algo.routing_replay,
            )
        finally:
            self._account(-1)
            self.slots.release()  # the slot is free the moment this sample is

    async def _finish(self, group_id: int, samples: list[asyncio.Future[Rollout]]) -> None:
        try:
            group = list(await asyncio.gather(*samples))
        except asyncio.CancelledError:
            for s in samples:
                s.cancel()
            raise
        except Exception as e:  # noqa: BLE001 (any failure ends the run: the trainer's take() raises it)
            for s in samples:
                s.cancel()
            await self.buffer.fail(e)
            return
        if self.agent is None:  # an agent's environment has scored its episodes
            traces = await score([group], self.reward_fn)
            self.reward_traces += traces[: max(0, 4 - len(self.reward_traces))]
        self.stats.finished_groups += 1
        if self.cfg.algo.dynamic_sampling and not drop_zero_variance_groups([[r.sample for r in group]])[0]:
            self.stats.dropped_zero_variance += 1  # consumed: DAPO's dynamic sampling uses up the prompt
            await self.discard()
        else:
            await self.buffer.put(group)  # may wait for room; the prompt counts as in flight until it is in
        del self.inflight[group_id]
