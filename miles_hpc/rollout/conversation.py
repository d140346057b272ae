"""A multi-turn conversation held as token ids (TITO: token in, token out) for agentic rollouts (stage: rollout).

The trainer must see exactly the ids the engine generated; re-rendering a conversation through the chat template
after each turn can change them (a template that strips or rewrites earlier text, a decode/encode round trip that
merges tokens differently). So the conversation never re-tokenizes what it holds:
- turn 1 is the template's rendering of the first messages with the generation prompt;
- generated ids are appended exactly as the engine returned them (stop token included), `loss_mask` 1, with the
  engine's log-probs and weight versions;
- a later message (tool result, user turn) is appended as the *suffix* the template adds for it: the template's
  text for (all messages so far + the new one, generation prompt on) minus the text of what is held. The held text
  must be a prefix of that rendering; if the template rewrote earlier text (say it drops an earlier reasoning
  block), `TITOError` names the message and the first differing character instead of silently training on tokens
  the engine never saw. Suffix tokens carry `loss_mask` 0.

Invariants: `ids` = concatenation of every piece sent to and returned by the engine; `loss_mask`, `logprobs`,
`versions` have one entry per id; `prompt_len` is the length of turn 1. R3 (`routed`): the experts every id held
was routed to when the engine ran it, row i for id i, a contiguous prefix of the ids: each turn asks the engine for
the rows from the first one not held (`routing_rows`), so the tool tokens of turn k get theirs from turn k+1's
prefill and only what was never fed (the last id sampled, a message after the last turn) has none (the trainer
routes those live: they carry no loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from miles_hpc.data.sample import Sample, SampleStatus, token_hash

__all__ = ["Conversation", "TITOError"]


class TITOError(ValueError):
    """The chat template is not append-only for this conversation: rendering changed text already held."""


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], gen: bool, kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=gen, **kwargs)


@dataclass
class Conversation:
    tokenizer: Any
    messages: list[dict[str, Any]]
    ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    turns: int = 0  # assistant turns generated
    prompt_tokens: int = 0  # summed over turns: what the engines were asked to prefill (every request of a turn)
    cached_tokens: int = 0  # of those, served from their prefix caches
    last_usage: tuple[int, int] = (0, 0)  # the last turn's prompt and, of it, the tokens its first request found cached
    finish: str = "stop"  # the last generation's finish reason
    routed: list[np.ndarray] = field(default_factory=list)  # R3 rows per turn, [rows, moe_layers, top_k] each

    @property
    def routing_rows(self) -> int:
        """R3 rows held: the ids from 0 whose experts the engine has returned."""
        return sum(r.shape[0] for r in self.routed)

    @classmethod
    def start(cls, tokenizer: Any, messages: Sequence[dict[str, Any]], **template_kwargs: Any) -> Conversation:
        """Turn 1: the template's rendering of `messages` with the generation prompt (e.g. `tools=` goes to it)."""
        ids = _encode(tokenizer, _render(tokenizer, messages, True, template_kwargs))
        n = len(ids)
        return cls(
            tokenizer=tokenizer,
            messages=[dict(m) for m in messages],
            ids=ids,
            prompt_len=n,
            loss_mask=[0] * n,
            logprobs=[0.0] * n,
            versions=[-1] * n,
            template_kwargs=dict(template_kwargs),
        )

    def add_generated(
        self,
        output_ids: Sequence[int],
        logprobs: Sequence[float] | None,
        versions: Sequence[int | str],
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        finish: str = "stop",
        routed: np.ndarray | None = None,
        usage: tuple[int, int] | None = None,
    ) -> str:
        """Append one generation exactly as returned; returns its text (the assistant message: the stop token
        removed, other special tokens kept), which is also recorded in `messages` for the template's later
        renderings. `routed`: its R3 rows, asked from row `routing_rows` on (at most up to its last id but one).
        `prompt_tokens` / `cached_tokens`: what the turn's requests prefilled and found cached (the prefix-cache
        account); `usage`: its prompt and the first request's hits, as an API reports them (default: the account)."""
        n = len(output_ids)
        if logprobs is not None and len(logprobs) != n or len(versions) != n:
            raise ValueError(
                f"generation of {n} ids came with {len(logprobs or [])} log-probs, {len(versions)} versions"
            )
        if routed is not None and routed.shape[0]:
            held = self.routing_rows
            if held + routed.shape[0] > len(self.ids) + n - 1:
                raise ValueError(
                    f"turn {self.turns + 1}: {routed.shape[0]} routing rows from row {held} run past the "
                    f"{len(self.ids) + n} ids less the last (ask the engine from routed_experts_start_len={held})"
                )
            if self.routed and routed.shape[1:] != self.routed[0].shape[1:]:
                raise ValueError(
                    f"turn {self.turns + 1}: routing rows of shape {routed.shape[1:]}, earlier turns "
                    f"{self.routed[0].shape[1:]} (moe layers, top_k)"
                )
            self.routed.append(np.asarray(routed))
        self.ids += list(output_ids)
        self.loss_mask += [1] * n
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * n
        self.versions += [int(v) for v in versions]
        self.turns += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self.last_usage = usage if usage is not None else (prompt_tokens, cached_tokens)
        self.finish = finish
        # The message content is the text between the generation prompt and the stop token, special tokens
        # included (a model may emit markup tokens mid-turn; the template must render them back unchanged).
        body = list(output_ids[:-1]) if output_ids and output_ids[-1] in self._stop_ids() else list(output_ids)
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def _stop_ids(self) -> set[int]:
        eos = self.tokenizer.eos_token_id
        return set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()

    def add_message(self, message: dict[str, Any]) -> list[int]:
        """Append a tool result / user turn as the suffix the template adds for it (module docstring), with the
        generation prompt for the next assistant turn; returns the suffix ids (loss_mask 0)."""
        held = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        full = _render(self.tokenizer, [*self.messages, message], True, self.template_kwargs)
        if not full.startswith(held):
            at = next((i for i, (a, b) in enumerate(zip(held, full)) if a != b), min(len(held), len(full)))
            raise TITOError(
                f"the chat template rewrote earlier text when message {len(self.messages)} "
                f"(role {message.get('role')!r}) was added: first difference at character {at}, held "
                f"{held[at : at + 40]!r} vs rendered {full[at : at + 40]!r}; the trainer would see tokens the engine "
                "never saw. Use a template that renders history append-only (keeps earlier turns as they were)"
            )
        suffix = _encode(self.tokenizer, full[len(held) :])
        self.messages.append(dict(message))
        n = len(suffix)
        self.ids += suffix
        self.loss_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        return suffix

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_sample(
        self, *, prompt_id: int, group_id: int, reward: float = 0.0, metadata: dict[str, Any] | None = None
    ) -> Sample:
        """The conversation as one training sample (all turns; loss only on generated ids)."""
        by_finish = {"stop": SampleStatus.COMPLETED, "length": SampleStatus.TRUNCATED}
        status = by_finish.get(self.finish, SampleStatus.ABORTED)
        meta = {
            "turns": self.turns,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            **(metadata or {}),
        }
        return Sample(
            prompt_id=prompt_id,
            group_id=group_id,
            tokens=list(self.ids),
            prompt_len=self.prompt_len,
            loss_mask=list(self.loss_mask),
            rollout_logprobs=list(self.logprobs),
            policy_version=list(self.versions),
            reward=reward,
            status=status,
            metadata=meta,
            token_hash=token_hash(self.ids),
            routed_experts=np.concatenate(self.routed, axis=0) if self.routed else None,
        )
