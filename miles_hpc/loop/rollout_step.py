"""One rollout step of the synchronous loop: prompts -> groups of samples with rewards (stage: loop).

Invariants:
- A sample's ``tokens`` are the rendered prompt ids followed by exactly the ids the engine returned (TITO: nothing is
  re-tokenised), ``loss_mask`` is 1 on those generated ids only, ``rollout_logprobs`` and ``policy_version`` come
  from the engine per token.
- Every sample of a prompt shares a ``group_id`` and goes to one engine (router affinity), so the prompt's KV is
  computed once.
- A reward function that fails marks only its sample FAILED (reward 0, error in ``metadata["reward_error"]``); the
  loops count such samples, leave them out of the loss (``reward.train_on_failed``) and stop the run when more than
  ``reward.max_failed_frac`` of a step failed (:func:`check_reward_failures`, with the first traceback).
- A prompt that cannot fit the engines' context with ``max_new_tokens`` is skipped and counted (:func:`fits`), never
  sent: an engine refuses it, which would end the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from miles_hpc.config import RolloutConfig
from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.sample import Sample, SampleStatus
from miles_hpc.rollout.requests import ENGINE_RESERVED_TOKENS
from miles_hpc.rollout.responses import GenerateOutput
from miles_hpc.rollout.rewards import RewardInput, score_samples
from miles_hpc.rollout.router import Router

_STATUS = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}


@dataclass(slots=True)
class Rollout:
    record: PromptRecord
    sample: Sample
    response_text: str


def sampling_params(cfg: RolloutConfig) -> dict[str, Any]:
    """SGLang sampling_params from the rollout config (only keys SGLang knows)."""
    return {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
    }


def to_sample(out: GenerateOutput, prompt_ids: list[int], prompt_id: int, group_id: int) -> Sample:
    p, r = len(prompt_ids), len(out.output_ids)
    logprobs = out.output_logprobs if out.output_logprobs is not None else [0.0] * r
    return Sample(
        prompt_id=prompt_id,
        group_id=group_id,
        tokens=prompt_ids + list(out.output_ids),
        prompt_len=p,
        loss_mask=[0] * p + [1] * r,
        rollout_logprobs=[0.0] * p + list(logprobs),
        policy_version=[-1] * p + [int(v) for v in out.token_versions()],
        reward=0.0,
        status=_STATUS[out.finish_reason.type],
        routed_experts=out.routed_experts,
        indexer_topk=out.indexer_topk,
        metadata={},
    )


async def generate_groups(
    router: Router,
    records: Sequence[PromptRecord],
    prompt_ids: Sequence[list[int]],
    cfg: RolloutConfig,
    tokenizer: Any,
    *,
    first_group_id: int,
    seed: int,
    routed_experts: bool = False,
    indexer_topk: bool = False,
    agent: Any = None,
) -> list[list[Rollout]]:
    """``cfg.samples_per_prompt`` samples for every record, all in flight at once.

    Every sample carries its own ``sampling_seed`` derived from (run seed, group id, index in group), so its tokens
    do not depend on the batch, on the engine it lands on or on the engine's history: a resumed run generates what
    the uninterrupted run would have. ``routed_experts`` (R3): also return the experts every token was routed to;
    ``indexer_topk`` (DSA indexer replay): the keys every token's query selected in each indexer layer.
    ``agent`` (rollout/agents.py): each sample is a multi-turn episode it plays (its environment sets the reward);
    every turn of a group's samples goes to one engine (affinity on the group id), so the prefix stays cached.
    """
    params = sampling_params(cfg)

    async def one(record: PromptRecord, ids: list[int], group_id: int, j: int) -> Rollout:
        seeded = {**params, "sampling_seed": (seed * 1_000_003 + group_id * 1_024 + j) % (2**31 - 1)}
        if agent is not None:
            from miles_hpc.rollout.agents import AgentContext

            ctx = AgentContext(
                generate_fn=router.generate,
                tokenizer=tokenizer,
                sampling=seeded,
                session=group_id,
                group_id=group_id,
                max_turns=cfg.max_turns,
                max_output_chars=cfg.max_tool_output_chars,
                routed_experts=routed_experts,
            )
            return Rollout(record, await agent(ctx, record), "")
        out = await router.generate(
            ids,
            seeded,
            affinity_key=group_id,
            return_logprob=True,
            return_routed_experts=routed_experts,
            return_indexer_topk=indexer_topk,
        )
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return Rollout(record, to_sample(out, ids, record.prompt_id, group_id), text)

    tasks = [
        [asyncio.ensure_future(one(rec, ids, first_group_id + g, j)) for j in range(cfg.samples_per_prompt)]
        for g, (rec, ids) in enumerate(zip(records, prompt_ids))
    ]
    flat = [t for group in tasks for t in group]
    try:
        await asyncio.gather(*flat)
    except BaseException:
        # The first failure ends the step: the other generations are cancelled and their outcomes collected
        # (none left running, none left to print "Task exception was never retrieved" at exit).
        for t in flat:
            t.cancel()
        await asyncio.gather(*flat, return_exceptions=True)
        raise
    return [[t.result() for t in group] for group in tasks]


class RewardFailures(RuntimeError):
    """Too many samples of a step failed their reward function (the message holds the first traceback)."""


def reward_failed(sample: Sample) -> bool:
    return sample.status == SampleStatus.FAILED and "reward_error" in sample.metadata


def check_reward_failures(samples: Sequence[Sample], max_failed_frac: float, step: int, traces: list[str]) -> int:
    """The number of samples whose reward failed; raises RewardFailures when they are more than ``max_failed_frac``
    of the step (``traces``: the tracebacks :func:`score` returned, the first is shown)."""
    failed = [s for s in samples if reward_failed(s)]
    if failed and len(failed) > max_failed_frac * len(samples):
        first = failed[0]
        trace = f"\n{traces[0].rstrip()}" if traces else ""
        raise RewardFailures(
            f"step {step}: {len(failed)} of {len(samples)} samples failed their reward function (more than "
            f"reward.max_failed_frac={max_failed_frac:g}); the first (prompt {first.prompt_id}): "
            f"{first.metadata['reward_error']}{trace}"
        )
    return len(failed)


def fits(prompt_ids: Sequence[int], max_prompt_len: int | None) -> bool:
    """Whether a prompt may be sent (``max_prompt_len``: what leaves the engines room for ``max_new_tokens``)."""
    return max_prompt_len is None or len(prompt_ids) <= max_prompt_len


def max_prompt_len(server_info: dict[str, Any], model_max_positions: int | None, max_new_tokens: int) -> int | None:
    """The longest prompt an engine generates ``max_new_tokens`` more for: its context length (our engine's
    ``max_context_len``, SGLang's ``context_length``, else the model's ``max_position_embeddings``) or its KV
    capacity (``max_total_num_tokens``), whichever is smaller, less ``ENGINE_RESERVED_TOKENS``. None when nothing
    says."""
    limits = [
        v
        for v in (
            server_info.get("max_context_len"),
            server_info.get("context_length"),
            server_info.get("max_total_num_tokens"),
        )
        if isinstance(v, int) and not isinstance(v, bool) and v > 0
    ]
    if not any(isinstance(server_info.get(k), int) for k in ("max_context_len", "context_length")):
        limits += [model_max_positions] if model_max_positions else []
    return min(limits) - max_new_tokens - ENGINE_RESERVED_TOKENS if limits else None


async def score(groups: list[list[Rollout]], reward_fn: Any, *, timeout_s: float = 60.0) -> list[str]:
    """Fill ``sample.reward`` (and FAILED status on a reward error) for every rollout, concurrently; returns the
    tracebacks of the failures, in sample order."""
    flat = [r for g in groups for r in g]
    inputs = [
        RewardInput(
            prompt=r.record.prompt,
            response=r.response_text,
            label=r.record.label,
            sample=r.sample,
            metadata=r.record.metadata,
        )
        for r in flat
    ]
    outcomes = await score_samples(inputs, reward_fn, timeout_s=timeout_s)
    traces = []
    for r, o in zip(flat, outcomes):
        r.sample.reward = float(o.reward)
        if o.failed:
            r.sample.status = SampleStatus.FAILED
            r.sample.metadata["reward_error"] = o.error
            traces.append(o.traceback or str(o.error))
    return traces
