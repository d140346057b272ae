"""Agent plug-ins: multi-turn rollouts as ``async def agent(ctx, record) -> Sample`` (stage: rollout).

`rollout.agent` names one by dotted path (`module:function`); the loop calls it once per sample with an
`AgentContext` and the prompt record, and trains on the `Sample` it returns (its reward included: the environment
scores its own final state). The context offers what an agent needs and nothing that would break TITO:
- `ctx.generate(conv)`: one assistant turn through the router with the sample's session affinity (every turn of
  every sample of a prompt group goes to one engine, so the growing prefix stays cached), appended to the
  `Conversation` exactly as generated; turn-specific sampling seeds keep the rollout reproducible;
- `ctx.tokenizer`, `ctx.max_turns`, `ctx.max_output_chars`, `ctx.group_id`;
- with `ctx.routed_experts` (R3) each turn also returns the experts of the ids the engine ran that the
  conversation holds no rows for yet (`Conversation.routed`), so the sample's rows line up with its ids.

The reference agent, `terminal_agent`, plays `data/terminal_env.TerminalEnv`: the record's `metadata["task_seed"]`
makes the task; each turn's first line is a command; the terminal's output goes back as a `tool` message.
`check_agent` is the contract test to run against your own agent.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.sample import Sample
from miles_hpc.data.terminal_env import TerminalEnv, make_terminal_task
from miles_hpc.rollout.conversation import Conversation
from miles_hpc.rollout.pieces import continue_aborted
from miles_hpc.rollout.requests import ENGINE_RESERVED_TOKENS

__all__ = ["AgentContext", "AgentFn", "check_agent", "terminal_agent"]

# The environment's manual, sent as the system message of every episode (shared by all of them, so one engine's
# prefix cache serves it once per weight version).
TERMINAL_SYSTEM = """You are working in a small terminal. The filesystem has a few text files under /data, a log
at /logs/app.log and notes under /notes. Reply with exactly one command per turn, on the first line of your message;
the terminal's output comes back as the next message. Finish with `submit` once /answer.txt holds your answer.

Commands:
  ls [DIR]                 list a directory (default: the current one)
  cd DIR                   change the current directory; pwd prints it
  cat FILE                 print a file
  head [-n N] FILE         print the first N lines of a file (default 10)
  grep WORD FILE           print the lines of FILE that contain WORD
  wc -l FILE               count the lines of FILE
  find [DIR] -name TEXT    list the files under DIR whose path contains TEXT
  echo TEXT > FILE         write TEXT to FILE (replacing it)
  submit                   end the task; your answer is what /answer.txt holds

Examples:
  $ grep ERROR /logs/app.log
  $ echo 3 > /answer.txt
  $ find /data -name .txt
Long outputs are cut. A command that fails prints a line starting with `error:`; nothing else changes."""


@dataclass
class AgentContext:
    generate_fn: Callable[..., Awaitable[Any]]  # Router.generate, or anything with its signature
    tokenizer: Any
    sampling: Mapping[str, Any]
    session: Hashable
    group_id: int
    max_turns: int = 4
    max_output_chars: int = 400
    max_context_len: int | None = None  # None: the tokenizer's model_max_length when it states one
    routed_experts: bool = False  # R3 (algo.routing_replay): keep every turn's routing rows
    calls: int = field(default=0, init=False)

    def room(self, conv: Conversation) -> int:
        """Tokens the conversation may still grow by before the model's context is full (less the
        `ENGINE_RESERVED_TOKENS` an engine keeps free of max_new_tokens)."""
        limit = self.max_context_len or getattr(self.tokenizer, "model_max_length", None)
        if not isinstance(limit, int) or limit > 10**8:
            return 10**9
        return limit - len(conv.ids) - ENGINE_RESERVED_TOKENS

    async def generate(self, conv: Conversation, **overrides: Any) -> str:
        """One assistant turn appended to `conv` (max_new_tokens cut to the room left); returns its text."""
        params = {**self.sampling, **overrides}
        if self.room(conv) <= 0:
            raise ValueError(f"the conversation ({len(conv.ids)} tokens) already fills the model's context")
        if "max_new_tokens" in params:
            params["max_new_tokens"] = max(0, min(int(params["max_new_tokens"]), self.room(conv)))
        if "sampling_seed" in params:  # another draw per turn, the same on every rerun
            params["sampling_seed"] = (int(params["sampling_seed"]) + 7919 * self.calls) % (2**31 - 1)
        self.calls += 1
        kw: dict[str, Any] = {"affinity_key": self.session, "return_logprob": True}
        if self.routed_experts:  # rows from the first id without one: the last turn's last id, the tool message
            kw.update(return_routed_experts=True, routed_experts_start_len=conv.routing_rows)
        # A turn aborted by a weight update (fully async, pause mode abort) continues from its tokens.
        out = await continue_aborted(
            self.generate_fn, conv.ids, params, await self.generate_fn(conv.ids, params, **kw), **kw
        )
        return conv.add_generated(
            out.output_ids,
            out.output_logprobs,
            out.token_versions(),
            prompt_tokens=out.prefill_account()[0],
            cached_tokens=out.prefill_account()[1],
            usage=(out.prompt_tokens, out.cached_tokens),
            finish=out.finish_reason.type,
            routed=out.routed_experts if self.routed_experts else None,
        )


AgentFn = Callable[[AgentContext, PromptRecord], Awaitable[Sample]]


async def terminal_agent(ctx: AgentContext, record: PromptRecord) -> Sample:
    """The reference agent: up to `ctx.max_turns` commands against the record's terminal task."""
    task = make_terminal_task(int(record.metadata["task_seed"]))
    env = TerminalEnv(task, max_output_chars=ctx.max_output_chars)
    conv = Conversation.start(
        ctx.tokenizer, [{"role": "system", "content": TERMINAL_SYSTEM}, {"role": "user", "content": task.goal}]
    )
    for turn in range(ctx.max_turns):
        text = await ctx.generate(conv)
        output = env.step(text)
        # A turn cut by max_new_tokens still counts (its first line is the command); the episode ends when the
        # task is submitted, at the turn limit, or when the context has no room for another exchange.
        if env.done or conv.finish == "abort" or turn == ctx.max_turns - 1:
            break
        # Room for the tool message (output, the cut note, template markup: at most a token per character) and
        # a useful next turn.
        if ctx.room(conv) < ctx.max_output_chars + 96 + int(ctx.sampling.get("max_new_tokens", 64)):
            conv.finish = "length"
            break
        conv.add_message({"role": "tool", "content": output or "(no output)"})
    return conv.to_sample(
        prompt_id=record.prompt_id,
        group_id=ctx.group_id,
        reward=env.reward(),
        metadata={"task": task.kind, "commands": env.steps, "submitted": env.done},
    )


async def check_agent(agent: AgentFn, ctx: AgentContext, record: PromptRecord) -> Sample:
    """Contract test: run `agent` once and check what the loop relies on; returns the sample. Raises
    AssertionError naming the broken rule."""
    assert inspect.iscoroutinefunction(agent), "an agent is an `async def agent(ctx, record) -> Sample`"
    sample = await agent(ctx, record)
    assert isinstance(sample, Sample), f"the agent returned {type(sample).__name__}, not a Sample"
    n = len(sample.tokens)
    assert len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.policy_version) == n, (
        "tokens, loss_mask, rollout_logprobs and policy_version must have one entry per token"
    )
    assert not any(sample.loss_mask[: sample.prompt_len]), "no loss on the first prompt"
    assert sample.prompt_id == record.prompt_id and sample.group_id == ctx.group_id, "keep the record's ids"
    assert ctx.calls >= 1, "an agent generates through ctx.generate (TITO, session affinity, metrics)"
    return sample
