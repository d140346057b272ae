"""OpenAI chat sessions over TITO conversations (stage: rollout; served by `rollout/openai_server.py`, no HTTP here).

An agent harness written for the OpenAI chat API sends the whole message list every call; a session keeps the
token ids instead. The first call of a session renders its messages once through the chat template (`tools=` given
to the template) into a `Conversation`; every later call must repeat the session's history exactly (what it sent
and what it was answered), and only its new messages (tool results, user turns) are appended, as the template's
suffix for them (TITO: `Conversation.add_message`, which raises naming the message on a template that rewrites
history). Each answer is one turn through `AgentContext.generate` (the router with the session as affinity key,
sampling seeds per turn, turns aborted by a weight update continued, R3 rows when asked), its tool calls parsed
from the generated text (`tool_calls.parse_tool_calls`, the format the chat template teaches). The session's
conversation becomes a trajectory sample with `take_sample`: the ids, log-probs, versions and routing rows exactly
as `/generate` returned them.

Invariants: a request whose history differs from the session's is refused (`SessionError`, HTTP 400) naming the
first differing message, never re-rendered; an assistant message the engine did not generate is refused the same
way; one call runs at a time per session (a lock), so turns never interleave; nothing is dropped silently: a tool
call that does not parse stays in the message content.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles_hpc.data.sample import Sample
from miles_hpc.rollout.agents import AgentContext
from miles_hpc.rollout.conversation import Conversation, TITOError
from miles_hpc.rollout.tool_calls import detect_format, parse_tool_calls

__all__ = ["ChatSession", "SessionError", "SessionStore", "sampling_from_request"]

# OpenAI request fields -> the engine's sampling params (SGLang's names)
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop"}
_REFUSED = {"n": 1, "stream": False, "logprobs": False}  # field -> the only value served


class SessionError(ValueError):
    """A request the session cannot serve as asked (HTTP 400), the message names the field or message."""


def sampling_from_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's sampling params an OpenAI chat request sets (`max_completion_tokens` or `max_tokens`, `seed`
    as `sampling_seed`; what it leaves out keeps the session's defaults); fields this server does not serve
    (``n`` > 1, streaming, log-probs in the answer) refused."""
    for key, only in _REFUSED.items():
        if key in body and body[key] not in (None, only):
            raise SessionError(f"{key}={body[key]!r}: this server answers {key}={only!r} only")
    out = {dst: body[src] for src, dst in _SAMPLING.items() if body.get(src) is not None}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        out["max_new_tokens"] = int(limit)
    if body.get("seed") is not None:
        out["sampling_seed"] = int(body["seed"]) % (2**31 - 1)
    return out


def _normal(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match for a message to be the same one: role, content, tool calls (name and parsed arguments),
    the tool call it answers."""
    calls = tuple(
        (c.get("function", {}).get("name"), json.dumps(_loads(c.get("function", {}).get("arguments")), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (message.get("role"), message.get("content") or "", calls, message.get("tool_call_id"))


def _loads(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


@dataclass
class ChatSession:
    """One harness conversation: the token-level `conv` and the messages as the harness sees them (`seen`)."""

    id: str
    context: AgentContext
    tool_format: str | None
    conv: Conversation | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    created: float = field(default_factory=time.time)

    def _append(self, messages: list[dict[str, Any]], tools: Any) -> None:
        """The request's messages into the conversation: all of them on the first call, else the new ones after
        the history, which must be the session's own."""
        if not messages:
            raise SessionError("messages: empty")
        if self.conv is None:  # (few-shot assistant turns in the first call are rendered as given, no loss on them)
            kwargs = {"tools": tools} if tools else {}
            self.conv = Conversation.start(self.context.tokenizer, messages, **kwargs)
            self.seen = [dict(m) for m in messages]
            return
        n = len(self.seen)
        for i, (old, new) in enumerate(zip(self.seen, messages)):
            if _normal(old) != _normal(new):
                raise SessionError(
                    f"session {self.id}: message {i} (role {new.get('role')!r}) differs from the one this session "
                    f"holds (role {old.get('role')!r}); a session's history is append-only: send it back as it was "
                    "answered, or start a new session"
                )
        if len(messages) <= n:
            raise SessionError(f"session {self.id}: {len(messages)} messages, no new one after the {n} it holds")
        for i, m in enumerate(messages[n:], start=n):
            if m.get("role") == "assistant":
                raise SessionError(
                    f"session {self.id}: message {i} is an assistant message the engine did not generate; the "
                    "trainer would learn from tokens it never sampled"
                )
            try:
                self.conv.add_message(dict(m))
            except TITOError as e:
                raise SessionError(f"session {self.id}: message {i}: {e}") from e
            self.seen.append(dict(m))

    def _mark(self) -> tuple[int, ...] | None:
        c = self.conv
        return None if c is None else (len(c.ids), len(c.messages), len(self.seen), c.turns, len(c.routed))

    def _rollback(self, mark: tuple[int, ...] | None) -> None:
        """Back to the state `_mark` saw (a request that failed half-way appends nothing)."""
        if mark is None:
            self.conv, self.seen = None, []
            return
        c = self.conv
        assert c is not None
        n, msgs, seen, turns, routed = mark
        del c.ids[n:], c.loss_mask[n:], c.logprobs[n:], c.versions[n:], c.messages[msgs:], c.routed[routed:]
        del self.seen[seen:]
        c.turns = turns

    async def chat(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One `/v1/chat/completions` call: the OpenAI answer (one choice)."""
        params = sampling_from_request(body)
        async with self.lock:
            mark = self._mark()
            try:
                self._append(list(body.get("messages") or []), body.get("tools"))
                conv = self.conv
                assert conv is not None
                before = len(conv.ids)
                text = await self.context.generate(conv, **params)
            except BaseException:  # the call left no trace: the harness may send it again
                self._rollback(mark)
                raise
            content, calls = parse_tool_calls(text, self.tool_format, id_prefix=f"call_{self.id}_{conv.turns}")
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [c.to_openai() for c in calls]
            self.seen.append(message)
            finish = "tool_calls" if calls else {"stop": "stop", "length": "length"}.get(conv.finish, conv.finish)
            completion = len(conv.ids) - before
            prompt, cached = conv.last_usage
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model", "")),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
        }


GenerateFn = Callable[..., Awaitable[Any]]


class SessionStore:
    """The sessions of one server: created on first use, taken out as samples. `generate_fn`: `Router.generate`
    (or its signature); `routed_experts`: ask every turn for R3 rows; `tool_format`: a `tool_calls.FORMATS` key,
    None, or "auto" (the chat template's)."""

    def __init__(
        self,
        generate_fn: GenerateFn,
        tokenizer: Any,
        *,
        sampling: Mapping[str, Any] | None = None,
        routed_experts: bool = False,
        default_max_tokens: int = 256,
        max_context_len: int | None = None,
        tool_format: str | None = "auto",
    ) -> None:
        self.generate_fn, self.tokenizer = generate_fn, tokenizer
        self.sampling = dict(sampling or {})
        self.routed_experts = routed_experts
        self.default_max_tokens = default_max_tokens
        self.max_context_len = max_context_len
        # "auto": the format the chat template teaches (`tool_calls.detect_format`); None: no tool-call parsing
        template = getattr(tokenizer, "chat_template", None)
        self.tool_format = detect_format(template) if tool_format == "auto" else tool_format
        self.sessions: dict[str, ChatSession] = {}

    def add(self, session_id: str, context: AgentContext) -> ChatSession:
        """A session that generates through `context` (an agent's: its sampling, seeds, R3 and group), e.g. for a
        harness run inside the RL loop (`rollout/harness.py`)."""
        if session_id in self.sessions:
            raise KeyError(f"session {session_id!r} exists")
        self.sessions[session_id] = ChatSession(session_id, context, self.tool_format)
        return self.sessions[session_id]

    def get(self, session_id: str | None) -> ChatSession:
        """The session of that id (a new one for an unknown id; a fresh anonymous one for None)."""
        sid = session_id or f"anon-{uuid.uuid4().hex}"
        if sid not in self.sessions:
            ctx = AgentContext(
                generate_fn=self.generate_fn,
                tokenizer=self.tokenizer,
                sampling={"max_new_tokens": self.default_max_tokens, **self.sampling},
                session=sid,
                group_id=0,
                max_context_len=self.max_context_len,
                routed_experts=self.routed_experts,
            )
            self.sessions[sid] = ChatSession(sid, ctx, self.tool_format)
        return self.sessions[sid]

    def take_sample(self, session_id: str, *, prompt_id: int = 0, group_id: int = 0, reward: float = 0.0) -> Sample:
        """The session's conversation as one trajectory sample (loss on generated ids only); the session ends."""
        session = self.sessions.pop(session_id, None)
        if session is None or session.conv is None:
            raise KeyError(f"no session {session_id!r} with a conversation (known: {sorted(self.sessions)[:10]})")
        return session.conv.to_sample(
            prompt_id=prompt_id, group_id=group_id, reward=reward, metadata={"session_id": session_id}
        )
