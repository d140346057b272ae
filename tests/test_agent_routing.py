"""R3 across the turns of an agent's conversation and the pieces of an aborted generation: the routing rows of a
sample line up with its tokens (row i: the experts token i went through when the engine ran it), whatever the
engine returned per request (a fake engine that answers as ours does: rows from the asked start up to the tokens it
computed, fewer when a weight update aborted the request mid-prefill)."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import replace

import numpy as np
import pytest

from miles_hpc.rollout.agents import AgentContext
from miles_hpc.rollout.conversation import Conversation
from miles_hpc.rollout.pieces import CLIENT_ABORT, continue_aborted
from miles_hpc.rollout.responses import FinishReason, GenerateOutput, WeightVersionSpan, parse_generate

LAYERS, TOP_K = 2, 2


def code(positions: range | list[int]) -> np.ndarray:
    """The rows a position-faithful engine returns: row p names experts that encode p."""
    p = np.asarray(list(positions), dtype=np.int32)
    return np.stack([np.stack([p % 97, (p + 1) % 97], -1), np.stack([p % 89, (p + 3) % 89], -1)], 1)


class FakeEngine:
    """Generates `n` tokens per call (or `max_new_tokens` when fewer); `aborts[i] = (tokens, rows_short)`: call i
    is aborted by an update after `tokens` tokens, `rows_short` rows before the end it would have computed."""

    def __init__(self, n: int, aborts: dict[int, tuple[int, int]] | None = None) -> None:
        self.n, self.aborts, self.calls = n, aborts or {}, []

    async def generate(self, ids: list[int], params: dict, **kw: object) -> GenerateOutput:
        i = len(self.calls)
        self.calls.append((len(ids), dict(params), dict(kw)))
        n = min(self.n, int(params["max_new_tokens"]))
        short = 0
        if i in self.aborts:
            n, short = self.aborts[i]
        start = int(kw.get("routed_experts_start_len") or 0)
        computed = len(ids) + n - 1 - short  # the last sampled token is never run
        rows = code(range(start, computed)) if kw.get("return_routed_experts") else None
        return GenerateOutput(
            rid=f"r{i}",
            output_ids=[70 + (len(ids) + j) % 50 for j in range(n)],
            prompt_tokens=len(ids),
            finish_reason=FinishReason(type="abort" if i in self.aborts else "length"),
            completion_tokens=n,
            cached_tokens=0,
            output_logprobs=[-0.5] * n,
            weight_version="0",
            weight_versions=(WeightVersionSpan(version="0", start=0, end=n),) if n else (),
            routed_experts=rows,
        )


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> object:
    from transformers import AutoTokenizer

    from miles_hpc.models.presets import init_model

    path = init_model("qwen3", "tiny", tmp_path_factory.mktemp("tok") / "m", seed=0)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize(
    "aborts",
    [
        {},
        {1: (2, 0)},  # turn 2 aborted after 2 tokens, all its rows computed
        {1: (0, 5)},  # turn 2 aborted mid-prefill: no token, its tool message's rows partly computed
        {2: (3, 4), 3: (1, 0)},  # turn 2 aborted short of 4 rows, its continuation aborted again
    ],
    ids=["plain", "abort", "abort_mid_prefill", "abort_twice"],
)
def test_a_conversations_rows_line_up_with_its_tokens(tok: object, aborts: dict[int, tuple[int, int]]) -> None:
    """Three turns with tool messages between them: each turn asks for rows from the first one the conversation
    lacks, so the tool tokens get theirs from the next turn's prefill; a turn aborted by an update continues from
    the first missing row. The sample holds one row per token but the last, each the one the engine computed."""
    engine = FakeEngine(n=4, aborts=aborts)

    async def main() -> Conversation:
        ctx = AgentContext(
            generate_fn=engine.generate,
            tokenizer=tok,
            session=1,
            group_id=1,
            sampling={"max_new_tokens": 6, "temperature": 1.0},
            routed_experts=True,
        )
        conv = Conversation.start(tok, [{"role": "user", "content": "ls"}])
        for turn in range(3):
            await ctx.generate(conv)
            assert conv.routing_rows <= len(conv.ids) - 1
            if turn < 2:
                conv.add_message({"role": "tool", "content": f"output {turn}"})
        return conv

    conv = asyncio.run(main())
    s = conv.to_sample(prompt_id=0, group_id=1)
    assert s.routed_experts is not None
    assert s.routed_experts.shape == (len(s.tokens) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(s.routed_experts, code(range(len(s.tokens) - 1)))
    starts = [kw["routed_experts_start_len"] for _, _, kw in engine.calls]
    assert starts[0] == 0 and starts == sorted(starts)  # each request from the first row missing


async def _continued(engine: FakeEngine, prompt: list[int], params: dict) -> GenerateOutput:
    """One generation with R3 rows through `continue_aborted`, as the fully async producer makes it."""
    kw = {"return_routed_experts": True}
    return await continue_aborted(engine.generate, prompt, params, await engine.generate(prompt, params, **kw), **kw)


def test_a_continuation_asks_from_the_first_missing_row() -> None:
    """`continue_aborted` on a single-turn sample whose aborted first piece computed 3 rows fewer than its tokens:
    the continuation asks from there (not from the last token sampled), and the rows tile the whole sample."""
    engine = FakeEngine(n=5, aborts={0: (4, 3)})
    prompt = list(range(10, 30))
    params = {"max_new_tokens": 9}

    out = asyncio.run(_continued(engine, prompt, params))
    assert len(out.output_ids) == 9
    assert engine.calls[1][2]["routed_experts_start_len"] == len(prompt) + 4 - 1 - 3
    np.testing.assert_array_equal(out.routed_experts, code(range(len(prompt) + 9 - 1)))


@pytest.mark.parametrize("short", [0, 7], ids=["waiting", "mid_prefill"])
def test_a_generation_aborted_before_its_first_token_is_continued(short: int) -> None:
    """A weight update that aborts a request while it waits (no rows) or mid-prefill (some of its prompt's rows)
    before any token: the generation is continued from its prompt, not returned short of its tokens or rows."""
    engine = FakeEngine(n=5, aborts={0: (0, short)})
    prompt = list(range(10, 30))
    params = {"max_new_tokens": 5}

    out = asyncio.run(_continued(engine, prompt, params))
    assert out.finish_reason.type == "length" and len(out.output_ids) == 5 and len(engine.calls) == 2
    assert engine.calls[1][2]["routed_experts_start_len"] == len(prompt) - 1 - short
    np.testing.assert_array_equal(out.routed_experts, code(range(len(prompt) + 5 - 1)))


def test_an_abort_the_caller_asked_for_is_not_continued() -> None:
    out = replace(asyncio.run(FakeEngine(n=2).generate([1, 2, 3], {"max_new_tokens": 4})), finish_reason=CLIENT_ABORT)
    calls: list[object] = []

    async def never(*a: object, **kw: object) -> GenerateOutput:
        calls.append(a)
        raise AssertionError("continued an abort the caller asked for")

    assert asyncio.run(continue_aborted(never, [1, 2, 3], {"max_new_tokens": 4}, out)) is out and not calls


def _answer(rows: np.ndarray, n: int, prompt: int, finish: str) -> dict:
    return {
        "output_ids": list(range(n)),
        "meta_info": {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "finish_reason": {"type": finish},
            "routed_experts": base64.b64encode(rows.astype(np.int32).tobytes()).decode(),
        },
    }


def test_an_aborted_answer_may_hold_fewer_rows_than_its_tokens() -> None:
    """An aborted request holds the rows it computed (none while it waited): decoded as such; the same short payload
    on a finished request is a protocol error, and an aborted one must still split into whole rows."""
    kw = {"return_logprob": False, "return_routed_experts": True, "routing_dims": (LAYERS, TOP_K)}
    got = parse_generate(_answer(code(range(5)), 3, 10, "abort"), **kw)
    np.testing.assert_array_equal(got.routed_experts, code(range(5)))
    assert parse_generate(_answer(code([]), 0, 10, "abort"), **kw).routed_experts.shape == (0, LAYERS, TOP_K)
    with pytest.raises(ValueError, match="do not split into 12 rows"):
        parse_generate(_answer(code(range(5)), 3, 10, "length"), **kw)
    with pytest.raises(ValueError, match="aborted request"):
        parse_generate(_answer(code(range(13)), 3, 10, "abort"), **kw)  # more rows than tokens less one


def test_rows_past_the_conversations_tokens_are_refused(tok: object) -> None:
    conv = Conversation.start(tok, [{"role": "user", "content": "ls"}])
    n = len(conv.ids)
    with pytest.raises(ValueError, match="routing rows from row 0 run past"):
        conv.add_generated([70, 71], None, [0, 0], routed=code(range(n + 2)))
    conv.add_generated([70, 71], None, [0, 0], routed=code(range(n + 1)))
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        conv.add_generated([72], None, [0], routed=np.zeros((1, 3, 2), dtype=np.int32))
