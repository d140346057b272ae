"""Failed rewards and over-long prompts in the loop (loop/rollout_step.py, loop/sync.py): failures are counted, kept out
of the train batch and of their group's advantages, and stop the run past the threshold with the first traceback;
the prompt limit comes from the engine's own numbers."""

from __future__ import annotations

import asyncio

import pytest

from miles_hpc.config import load_config
from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.sample import Sample, SampleStatus
from miles_hpc.loop.rollout_step import (
    RewardFailures,
    Rollout,
    check_reward_failures,
    fits,
    max_prompt_len,
    score,
)
from miles_hpc.loop.sync import to_train_batch


def rollout(prompt_id: int, group: int, response: str) -> Rollout:
    sample = Sample(
        prompt_id=prompt_id,
        group_id=group,
        tokens=[1, 2, 3, 4],
        prompt_len=2,
        loss_mask=[0, 0, 1, 1],
        rollout_logprobs=[0.0, 0.0, -0.5, -0.5],
        policy_version=[-1, -1, 0, 0],
    )
    return Rollout(PromptRecord(prompt_id=prompt_id, prompt="p", label="a"), sample, response)


def reward(inp) -> float:  # noqa: ANN001
    if inp.response == "boom":
        raise ZeroDivisionError("a bug in the reward")
    if inp.response == "huge":
        return 1e39
    return 1.0 if inp.response == inp.label else 0.0


def scored(responses: list[list[str]]) -> tuple[list[list[Rollout]], list[str]]:
    groups = [[rollout(g, 100 + g, r) for r in rs] for g, rs in enumerate(responses)]
    traces = asyncio.run(score(groups, reward))
    return groups, traces


def test_failures_are_marked_and_their_tracebacks_returned() -> None:
    groups, traces = scored([["a", "boom"], ["huge", "b"]])
    status = [[r.sample.status for r in g] for g in groups]
    assert status == [[SampleStatus.COMPLETED, SampleStatus.FAILED], [SampleStatus.FAILED, SampleStatus.COMPLETED]]
    assert "ZeroDivisionError: a bug in the reward" in groups[0][1].sample.metadata["reward_error"]
    assert "float32" in groups[1][0].sample.metadata["reward_error"]
    assert len(traces) == 2 and "Traceback" in traces[0] and "in reward" in traces[0]


def test_the_failed_fraction_stops_the_run_past_the_threshold() -> None:
    groups, traces = scored([["a", "boom"], ["boom", "b"]])
    samples = [r.sample for g in groups for r in g]
    assert check_reward_failures(samples, 0.5, 3, traces) == 2  # exactly half: goes on
    with pytest.raises(RewardFailures, match=r"step 3: 2 of 4 samples failed .*max_failed_frac=0.4") as info:
        check_reward_failures(samples, 0.4, 3, traces)
    assert "ZeroDivisionError" in str(info.value) and "Traceback" in str(info.value)


def test_failed_samples_stay_out_of_the_batch_and_the_advantages() -> None:
    cfg = load_config("configs/tiny_cpu.yaml")
    groups, _ = scored([["a", "boom", "b"], ["boom", "boom", "boom"]])
    batch = to_train_batch(groups, cfg)
    assert batch is not None and batch.group_ids == [100, 100]
    # Group 100 keeps rewards 1 and 0: their advantages are symmetric, as if the failed sample never existed.
    (first,), (second,) = {a for a in batch.advantages[0] if a}, {a for a in batch.advantages[1] if a}
    assert first == pytest.approx(-second) and first > 0
    trained_on = load_config("configs/tiny_cpu.yaml", ["reward.train_on_failed=true"])
    assert len(to_train_batch(groups, trained_on).group_ids) == 6  # type: ignore[union-attr]
    assert to_train_batch([groups[1]], cfg) is None  # nothing left to train on


def test_the_prompt_limit_uses_the_engines_numbers() -> None:
    """Less the 2 tokens SGLang's scheduler (and our engine) keeps free of max_new_tokens."""
    assert max_prompt_len({"max_context_len": 2048, "max_total_num_tokens": 4096}, 8192, 64) == 2048 - 64 - 2
    assert max_prompt_len({"context_length": 1000, "max_total_num_tokens": 600}, None, 100) == 498
    assert max_prompt_len({}, 512, 12) == 498  # nothing from the engine: the model's positions
    assert max_prompt_len({"context_length": None}, None, 12) is None
    assert fits([1] * 500, 500) and not fits([1] * 501, 500) and fits([1] * 10**6, None)


def test_an_agent_turn_leaves_the_engines_reserved_tokens() -> None:
    """An agent's room is the context less its conversation less the 2 tokens an engine keeps free of
    max_new_tokens, so a turn asks for no more than the engine will generate."""
    from types import SimpleNamespace

    from miles_hpc.rollout.agents import AgentContext

    ctx = AgentContext(generate_fn=None, tokenizer=None, sampling={}, session=0, group_id=0, max_context_len=100)  # type: ignore[arg-type]
    assert ctx.room(SimpleNamespace(ids=[0] * 90)) == 8  # type: ignore[arg-type]
    assert ctx.room(SimpleNamespace(ids=[0] * 98)) == 0  # type: ignore[arg-type]


def test_a_failed_generation_cancels_the_steps_others_and_leaves_no_task_behind() -> None:
    """One generation fails (every engine down): the step raises that error at once, every other generation of
    the step is cancelled and collected, none keeps running or is reported as a never-retrieved exception."""
    from miles_hpc.config import RolloutConfig
    from miles_hpc.loop.rollout_step import generate_groups

    cancelled: list[int] = []

    class Router:
        async def generate(self, ids: list[int], sampling: dict, **kw: object) -> None:  # noqa: ANN401
            if ids == [7]:
                await asyncio.sleep(0.05)
                raise RuntimeError("all 1 engines are down")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(ids[0])
                raise

    async def run() -> None:
        records = [PromptRecord(prompt_id=i, prompt="p", label="a") for i in range(3)]
        cfg = RolloutConfig(samples_per_prompt=2)
        with pytest.raises(RuntimeError, match="engines are down"):
            await asyncio.wait_for(
                generate_groups(Router(), records, [[1], [7], [3]], cfg, None, first_group_id=0, seed=0), 5.0
            )
        assert sorted(cancelled) == [1, 1, 3, 3]
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not others, others

    asyncio.run(run())
