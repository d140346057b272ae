"""Agent harnesses written for the OpenAI client, run inside the RL loop (stage: rollout).

`openai_harness(fn)` makes a `rollout.agent` (`async def agent(ctx, record) -> Sample`) out of a harness
``fn(base_url, session_id, record) -> reward`` that talks to an OpenAI-compatible endpoint (plain function: run in
a worker thread, as the synchronous `openai` client blocks; `async def`: awaited). Each episode is one session of
the loop process's `OpenAISessionServer` (started on first use, on 127.0.0.1, one per event loop), generating
through the episode's `AgentContext`: its router, sampling seeds, session affinity and R3 rows, exactly as
`ctx.generate` would. The episode's sample is the session's conversation (`SessionStore.take_sample`), its reward
what the harness returned.

`terminal_harness` is the reference: `agents.terminal_agent`'s terminal task, played through the OpenAI client (the
terminal's output sent back as a user message: the tiny models call no tools).

Invariants: a harness that raises fails its episode (the loop's error handling applies, nothing half-recorded:
the session is dropped); a harness that never calls the endpoint is an error naming the session.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from miles_hpc.data.prompts import PromptRecord
from miles_hpc.data.sample import Sample
from miles_hpc.data.terminal_env import TerminalEnv, make_terminal_task
from miles_hpc.rollout.agents import TERMINAL_SYSTEM, AgentContext, AgentFn
from miles_hpc.rollout.openai_server import OpenAISessionServer
from miles_hpc.rollout.sessions import SessionStore

__all__ = ["HarnessFn", "openai_harness", "terminal_harness", "terminal_harness_agent"]

HarnessFn = Callable[[str, str, PromptRecord], float | Awaitable[float]]

_SERVERS: dict[int, OpenAISessionServer] = {}  # id(event loop) -> its server
_LOCK: dict[int, asyncio.Lock] = {}


async def _server(ctx: AgentContext) -> OpenAISessionServer:
    """This event loop's session server (one per loop process; sessions carry their own contexts)."""
    key = id(asyncio.get_running_loop())
    async with _LOCK.setdefault(key, asyncio.Lock()):
        if key not in _SERVERS:
            store = SessionStore(ctx.generate_fn, ctx.tokenizer)
            server = OpenAISessionServer(store, model_name="policy")
            await server.start()
            _SERVERS[key] = server
    return _SERVERS[key]


def openai_harness(fn: HarnessFn) -> AgentFn:
    """A `rollout.agent` running harness `fn` (module docstring) once per episode."""

    async def agent(ctx: AgentContext, record: PromptRecord) -> Sample:
        server = await _server(ctx)
        sid = f"ep-{ctx.group_id}-{record.prompt_id}-{uuid.uuid4().hex[:8]}"
        session = server.store.add(sid, ctx)
        try:
            if inspect.iscoroutinefunction(fn):
                reward = await fn(server.url, sid, record)
            else:
                reward = await asyncio.to_thread(fn, server.url, sid, record)
        except BaseException:
            server.store.sessions.pop(sid, None)
            raise
        if session.conv is None:
            server.store.sessions.pop(sid, None)
            raise RuntimeError(f"harness {getattr(fn, '__name__', fn)!r} never called {server.url} for session {sid}")
        return server.store.take_sample(sid, prompt_id=record.prompt_id, group_id=ctx.group_id, reward=float(reward))

    agent.__name__ = f"openai_harness({getattr(fn, '__name__', 'harness')})"
    return agent


def terminal_harness(base_url: str, session_id: str, record: PromptRecord, *, max_turns: int = 4) -> float:
    """The terminal task through the OpenAI client: one command per assistant message, the terminal's output back
    as the next user message, until `submit` or `max_turns`; returns the environment's reward."""
    import openai

    task = make_terminal_task(int(record.metadata["task_seed"]))
    env = TerminalEnv(task, max_output_chars=120)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages: list[Any] = [
        {"role": "system", "content": TERMINAL_SYSTEM},
        {"role": "user", "content": task.goal},
    ]
    for turn in range(max_turns):
        answer = client.chat.completions.create(
            model="policy", messages=messages, extra_body={"session_id": session_id}
        )
        message = answer.choices[0].message
        output = env.step(message.content or "")
        if env.done or turn == max_turns - 1:
            break
        messages += [message.model_dump(exclude_none=True), {"role": "user", "content": output or "(no output)"}]
    return env.reward()


terminal_harness_agent = openai_harness(terminal_harness)
