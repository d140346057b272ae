"""The terminal environment (data/terminal_env.py) and the reference agent (rollout/agents.py): reproducible tasks,
every goal reachable with the command set, bad commands answered with an error (never an exception), output cut,
and the agent contract run against a real engine through the router (session affinity, prefix-cache accounting)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from miles_hpc.data.tasks import make_task
from miles_hpc.data.terminal_env import TerminalEnv, make_terminal_task, parse_command


def solve(env: TerminalEnv) -> None:
    """A scripted player: what a good policy would type."""
    t = env.task
    if t.kind == "find":
        word = t.goal.split("word ")[1].split("?")[0]
        hits = [p for p in env.step("find /data -name .txt").split("\n") if word in env.step(f"cat {p}")]
        env.step(f"echo {hits[0]} > /answer.txt")
    elif t.kind == "count":
        n = len([line for line in env.step("grep ERROR /logs/app.log").split("\n") if line])
        env.step(f"echo {n} > /answer.txt")
    else:
        env.step(f"echo '{env.step('head -n 1 /notes/todo.txt')}' > /answer.txt")
    env.step("$ submit")


def test_tasks_are_reproducible_and_solvable() -> None:
    kinds = set()
    for seed in range(60):
        t = make_terminal_task(seed)
        assert t == make_terminal_task(seed) and t.answer
        kinds.add(t.kind)
        env = TerminalEnv(t)
        assert env.reward() == 0.0
        solve(env)
        assert env.done and env.reward() == 1.0, (seed, t.kind)
    assert kinds == {"find", "count", "first_line"}
    recs = make_task("terminal", n=20, seed=4)
    assert recs == make_task("terminal", n=20, seed=4)
    assert all(make_terminal_task(r.metadata["task_seed"]).goal == r.prompt for r in recs)


def test_bad_commands_get_errors_and_output_is_cut() -> None:
    env = TerminalEnv(make_terminal_task(1), max_output_chars=30)
    for bad in ("rm -rf /", "cat /nope", "cd /nowhere", "head -n x /logs/app.log", "grep", "echo 'open", "", "ls /x"):
        assert env.step(bad).startswith("error:"), bad
    out = env.step("cat /logs/app.log")
    assert out.endswith("[output cut at 30 characters]")
    assert parse_command("\n  $ ls /data\nmore") == "ls /data" and env.step("pwd") == "/"
    assert env.step("cd /data") == "" and env.step("pwd") == "/data" and "file0.txt" in env.step("ls")
    assert not env.done and env.files == {**env.task.files}  # reading changes nothing


@pytest.mark.process
def test_reference_agent_meets_the_contract_on_a_real_engine(tmp_path: Path) -> None:
    from test_client_engine import EngineProcess, stop_all
    from transformers import AutoTokenizer

    from miles_hpc.models.presets import init_model
    from miles_hpc.rollout.agents import AgentContext, check_agent, terminal_agent
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.router import Router, RouterConfig

    ckpt = init_model("qwen3", "tiny", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    proc = EngineProcess(ckpt, tmp_path / "engine-0.json")
    try:
        rec = proc.start().wait_ready(120)
        record = make_task("terminal", n=1, seed=0)[0]

        async def main() -> None:
            async with Router([EngineClient(rec.url)], RouterConfig(health_interval_s=60), owns_clients=True) as r:
                ctx = AgentContext(
                    generate_fn=r.generate,
                    tokenizer=tok,
                    session=("g", 0),
                    group_id=7,
                    sampling={"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3},
                    max_turns=4,
                )
                sample = await check_agent(terminal_agent, ctx, record)
                turns = sample.metadata["turns"]
                assert 1 <= turns <= 4 and sample.reward in (0.0, 1.0) and sample.response_len > 0
                # Each later turn re-sends the whole conversation: most of it comes from the prefix cache.
                if turns > 1:
                    assert sample.metadata["cached_tokens"] > 0.5 * sample.metadata["prompt_tokens"]

        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        stop_all([proc])


def test_an_agent_turn_aborted_by_a_weight_update_continues_from_its_tokens(tmp_path: Path) -> None:
    # Fully async, pause mode abort: a turn cut by an update comes back with finish "abort" and its tokens so far;
    # the context continues it (without the seed) and the conversation gets one turn, versions 0 then 1.
    from transformers import AutoTokenizer

    from miles_hpc.models.presets import init_model
    from miles_hpc.rollout.agents import AgentContext
    from miles_hpc.rollout.conversation import Conversation
    from miles_hpc.rollout.responses import FinishReason, GenerateOutput, WeightVersionSpan

    tok = AutoTokenizer.from_pretrained(str(init_model("qwen3", "tiny", tmp_path / "m", seed=0)))
    calls: list[tuple[int, dict]] = []

    async def generate(ids: list[int], params: dict, **kw: object) -> GenerateOutput:
        calls.append((len(ids), dict(params)))
        first = len(calls) == 1
        n, v = (3, "0") if first else (int(params["max_new_tokens"]), "1")
        return GenerateOutput(
            rid=f"r{len(calls)}",
            output_ids=[65 + len(calls)] * n,
            prompt_tokens=len(ids),
            finish_reason=FinishReason(type="abort" if first else "length"),
            completion_tokens=n,
            cached_tokens=0,
            output_logprobs=[-0.5] * n,
            weight_version=v,
            weight_versions=(WeightVersionSpan(version=v, start=0, end=n),),
        )

    async def main() -> None:
        ctx = AgentContext(
            generate_fn=generate,
            tokenizer=tok,
            session=1,
            group_id=1,
            sampling={"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3},
        )
        conv = Conversation.start(tok, [{"role": "user", "content": "ls"}])
        start = len(conv.ids)
        await ctx.generate(conv)
        assert conv.ids[start:] == [66] * 3 + [67] * 5
        s = conv.to_sample(prompt_id=0, group_id=1, reward=0.0)
        assert s.policy_version[start:] == [0] * 3 + [1] * 5 and s.loss_mask[start:] == [1] * 8
        assert calls[1][0] == start + 3 and calls[1][1]["max_new_tokens"] == 5 and "sampling_seed" not in calls[1][1]

    asyncio.run(main())
