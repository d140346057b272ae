"""Router logic on CPU with in-process fake engines: placement, chunk merging, fail-over, quarantine, re-admission.

The fake engines are deterministic (the next token is a function of the sequence so far), so a generation that was
chunked or moved between engines must equal the uninterrupted one token for token. Real engine processes killed
mid-generation: tests/test_router_engine.py.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from miles_hpc.rollout.client import EngineHTTPError, EngineTimeoutError, EngineUnreachableError
from miles_hpc.rollout.pieces import Pieces, continuable, piece_params
from miles_hpc.rollout.placement import EngineSelector, NoEngineAvailableError
from miles_hpc.rollout.responses import GenerateOutput, parse_generate
from miles_hpc.rollout.router import Router, RouterConfig

LAYERS, TOP_K = 2, 2
INDEXER_LAYERS, INDEX_TOPK = 2, 3


def next_token(seq: Sequence[int]) -> int:
    return (seq[-1] * 31 + len(seq) * 7 + 3) % 200 + 10


def experts_at(token: int, position: int) -> list[list[int]]:
    return [[(token + position + layer) % 8, (token * 3 + layer) % 8] for layer in range(LAYERS)]


def selection_at(token: int, position: int) -> list[list[int]]:
    """A fake indexer record of the query at `position`: keys <= it, -1 padding."""
    return [
        [(token + layer + j) % (position + 1) if j <= position else -1 for j in range(INDEX_TOPK)]
        for layer in range(INDEXER_LAYERS)
    ]


class FakeEngine:
    """Duck-types EngineClient. ``dead``: refuses connections and breaks running requests; ``hang``: never answers;
    ``fail_500``: answers generate with 500; ``shutdown_abort``: aborts running requests (as on SIGTERM)."""

    def __init__(self, url: str, *, token_delay: float = 0.0, version: str = "0") -> None:
        self.url = url
        self.token_delay = token_delay
        self.version = version
        self.dead = self.hang = self.fail_500 = self.shutdown_abort = False
        self.calls: list[dict[str, Any]] = []
        self.aborts: set[str] = set()
        self.paused: list[str] = []
        self.health_calls = 0

    def _down(self, sent: bool) -> EngineUnreachableError:
        return EngineUnreachableError(self.url, "POST /generate", "connection lost", sent=sent)

    async def generate(self, input_ids: Sequence[int], sampling: dict[str, Any], **kw: Any) -> GenerateOutput:
        if self.dead:
            raise self._down(False)
        self.calls.append({"input_ids": list(input_ids), "sampling": dict(sampling), **kw})
        if self.fail_500:
            raise EngineHTTPError(self.url, "POST /generate", 500, "boom")
        seq, out, finish = list(input_ids), [], {"type": "length"}
        for _ in range(sampling.get("max_new_tokens", 128)):
            await asyncio.sleep(self.token_delay)
            while self.hang:
                await asyncio.sleep(0.01)
            if self.dead:
                raise self._down(True)
            if kw["rid"] in self.aborts or self.shutdown_abort:
                finish = {"type": "abort", "message": "aborted"}
                break
            t = next_token(seq)
            seq.append(t)
            out.append(t)
            if t in sampling.get("stop_token_ids", ()):
                finish = {"type": "stop", "matched": t}
                break
        start = kw.get("routed_experts_start_len") or 0
        rows = np.array([experts_at(seq[p], p) for p in range(start, len(seq) - 1)], dtype=np.int32)
        i_start = kw.get("indexer_topk_start_len") or 0
        picks = np.array([selection_at(seq[p], p) for p in range(i_start, len(seq) - 1)], dtype=np.int32)
        meta = {
            "id": kw["rid"],
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": self.version,
            "weight_versions": [{"version": self.version, "start": 0, "end": len(out)}] if out else [],
            "output_token_logprobs": [[-(t % 7) / 10 - 0.1, t, None] for t in out],
            "routed_experts": base64.b64encode(rows.tobytes()).decode(),
            "indexer_topk": base64.b64encode(picks.tobytes()).decode(),
        }
        return parse_generate(
            {"output_ids": out, "meta_info": meta},
            return_logprob=kw.get("return_logprob", False),
            return_routed_experts=kw.get("return_routed_experts", False),
            routed_experts_start_len=start,
            routing_dims=(LAYERS, TOP_K),
            return_indexer_topk=kw.get("return_indexer_topk", False),
            indexer_topk_start_len=i_start,
            indexer_dims=(INDEXER_LAYERS, INDEX_TOPK),
            engine_url=self.url,
        )

    async def health(self, *, timeout: float | None = None, retries: int | None = None) -> None:
        self.health_calls += 1
        if self.dead:
            raise EngineUnreachableError(self.url, "GET /health", "cannot connect", sent=False)
        if self.hang or self.shutdown_abort:
            raise EngineTimeoutError(self.url, "GET /health", "no answer")

    health_generate = health

    async def abort(self, rid: str | None = None, *, abort_all: bool = False, timeout: float | None = None) -> None:
        if rid is not None:
            self.aborts.add(rid)

    async def pause(self, mode: str = "abort") -> None:
        self.paused.append(mode)

    async def continue_generation(self) -> None:
        self.paused.append("continue")

    async def close(self) -> None:
        pass


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt) :]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


FAST: dict[str, Any] = {
    "health_interval_s": 0.02,
    "health_timeout_s": 0.5,
    "all_down_grace_s": 0.3,
    "failover_grace_s": 0.2,
}

# ------------------------------------------------------------------------------------------- placement


def test_least_in_flight_with_round_robin_ties() -> None:
    sel = EngineSelector(3, margin=2)
    assert [sel.pick() for _ in range(3)] == [0, 1, 2]  # idle fleet: spread, not engine 0 three times
    sel.in_flight[:] = [5, 1, 3]
    assert sel.pick() == 1
    sel.quarantined.add(1)
    assert sel.pick() == 2
    sel.quarantined |= {0, 2}
    with pytest.raises(NoEngineAvailableError):
        sel.pick()


def test_affinity_sticks_within_margin_and_moves_beyond_it() -> None:
    sel = EngineSelector(2, margin=2)
    home = sel.pick("group-7")
    other = 1 - home
    sel.in_flight[home] = 2
    assert sel.pick("group-7") == home  # 2 - 0 <= margin: the prefix cache wins
    sel.in_flight[home] = 3
    assert sel.pick("group-7") == other  # too busy: the key moves ...
    sel.in_flight[home] = 0
    assert sel.pick("group-7") == other  # ... and stays where its prefix now is
    sel.quarantined.add(other)
    assert sel.pick("group-7") == home  # its engine failed: the key moves to one that serves ...
    sel.quarantined.discard(other)
    assert sel.pick("group-7") == home  # ... and stays there (its prefix is there now) when the old one is back


def test_affinity_map_is_bounded() -> None:
    sel = EngineSelector(2, margin=0, capacity=3)
    for k in range(10):
        sel.pick(k)
    assert list(sel.affinity) == [7, 8, 9]


# ------------------------------------------------------------------------------------------- pieces


def test_continuable_and_piece_params() -> None:
    assert continuable({"max_new_tokens": 8, "temperature": 0.7, "top_k": 5, "stop_token_ids": [2]})
    assert not continuable({"max_new_tokens": 8, "sampling_seed": 1})  # our engine keys seeded noise by output index
    assert not continuable({"max_new_tokens": 8, "stop": ["\n"]})  # a stop string may span the boundary
    assert not continuable({"max_new_tokens": 8, "frequency_penalty": 0.5})
    assert not continuable({"temperature": 1.0})  # no budget to split
    assert piece_params({"max_new_tokens": 10, "min_new_tokens": 6}, 4, 4) == {"max_new_tokens": 4, "min_new_tokens": 2}
    assert piece_params({"max_new_tokens": 10, "min_new_tokens": 6}, 8, 4) == {"max_new_tokens": 2, "min_new_tokens": 0}
    assert piece_params({"max_new_tokens": 10}, 3, 0) == {"max_new_tokens": 7}
    with pytest.raises(ValueError):
        Pieces(prompt=[1]).result("r", 0)


@pytest.mark.parametrize("start", [None, 2])
def test_chunked_generation_equals_one_request(start: int | None) -> None:
    prompt = [5, 6, 7, 8]
    sampling = {"max_new_tokens": 10, "temperature": 1.0}
    kw: dict[str, Any] = {"return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": start}
    kw.update(return_indexer_topk=True, indexer_topk_start_len=start)

    async def main() -> tuple[GenerateOutput, GenerateOutput, FakeEngine]:
        whole_engine, chunk_engine = FakeEngine("http://a"), FakeEngine("http://b")
        async with Router([whole_engine], RouterConfig(chunk_tokens=0, **FAST)) as r:  # type: ignore[list-item]
            whole = await r.generate(prompt, sampling, **kw)
        async with Router([chunk_engine], RouterConfig(chunk_tokens=4, **FAST)) as r:  # type: ignore[list-item]
            chunked = await r.generate(prompt, sampling, **kw)
        return whole, chunked, chunk_engine

    whole, chunked, eng = run(main())
    assert whole.chunks == 1 and chunked.chunks == 3
    assert chunked.output_ids == whole.output_ids == expected(prompt, 10)
    assert chunked.output_logprobs == whole.output_logprobs
    assert chunked.completion_tokens == 10 and chunked.prompt_tokens == 4
    assert whole.routed_experts is not None and chunked.routed_experts is not None
    assert chunked.routed_experts.shape == (4 + 10 - 1 - (start or 0), LAYERS, TOP_K)
    np.testing.assert_array_equal(chunked.routed_experts, whole.routed_experts)
    assert whole.indexer_topk is not None and chunked.indexer_topk is not None  # stitched like the routing rows
    assert chunked.indexer_topk.shape == (4 + 10 - 1 - (start or 0), INDEXER_LAYERS, INDEX_TOPK)
    np.testing.assert_array_equal(chunked.indexer_topk, whole.indexer_topk)
    assert [(s.version, s.start, s.end) for s in chunked.weight_versions] == [("0", 0, 10)]
    assert chunked.finish_reason.type == "length"
    # Each piece continues from prompt + output so far; routing restarts at the last sampled token.
    assert [len(c["input_ids"]) for c in eng.calls] == [4, 8, 12]
    assert [c["sampling"]["max_new_tokens"] for c in eng.calls] == [4, 4, 2]
    assert [c["routed_experts_start_len"] for c in eng.calls] == [start, 7, 11]
    assert [c["indexer_topk_start_len"] for c in eng.calls] == [start, 7, 11]


def test_chunking_stops_at_a_stop_token_and_keeps_versions_per_piece() -> None:
    prompt = [1, 2]
    stop = expected(prompt, 6)[5]

    async def main() -> GenerateOutput:
        eng = FakeEngine("http://a", version="3")
        async with Router([eng], RouterConfig(chunk_tokens=2, **FAST)) as r:  # type: ignore[list-item]
            first = r.generate(prompt, {"max_new_tokens": 50, "stop_token_ids": [stop]}, return_logprob=True)
            out = await first
        return out

    out = run(main())
    assert out.output_ids == expected(prompt, 6) and out.finish_reason.type == "stop" and out.chunks == 3


# ------------------------------------------------------------------------------------------- fail-over


def test_engine_killed_mid_generation_loses_nothing() -> None:
    prompt_sets = [[i + 1, i + 2, i + 3] for i in range(8)]

    async def main() -> tuple[list[GenerateOutput], Router, list[FakeEngine]]:
        engines = [FakeEngine(f"http://e{i}", token_delay=0.002) for i in range(3)]
        router = Router(engines, RouterConfig(chunk_tokens=8, **FAST))  # type: ignore[arg-type]
        async with router:
            tasks = [
                asyncio.create_task(
                    router.generate(
                        p, {"max_new_tokens": 40}, affinity_key=i % 3, return_logprob=True, return_routed_experts=True
                    )
                )
                for i, p in enumerate(prompt_sets)
            ]
            await asyncio.sleep(0.03)
            engines[1].dead = True  # SIGKILL: connections break, nothing comes back
            results = await asyncio.gather(*tasks)
        return results, router, engines

    results, router, engines = run(main())
    for p, out in zip(prompt_sets, results):
        assert out.output_ids == expected(p, 40)  # every request completes, token-exact
        assert out.output_logprobs is not None and len(out.output_logprobs) == 40
        assert out.routed_experts is not None and out.routed_experts.shape == (3 + 40 - 1, LAYERS, TOP_K)
    stats = router.stats()
    assert set(stats.quarantined) == {"http://e1"} and "http://e1" in stats.quarantined["http://e1"]
    assert stats.resubmissions >= 1 and stats.completed == 8 and stats.failed == 0
    assert sum(o.resubmissions for o in results) == stats.resubmissions
    assert all(n == 0 for n in stats.in_flight.values())
    # Work was kept: the killed engine's requests resumed from their last finished piece, not from the prompt.
    # (Engine-side rids are "<rid>" for the first piece and "<rid>.<n>" after.)
    on_victim = {c["rid"].split(".")[0] for c in engines[1].calls}
    moved = [c for e in (engines[0], engines[2]) for c in e.calls if c["rid"].split(".")[0] in on_victim]
    assert moved and max(len(c["input_ids"]) for c in moved) > 3
    assert len({c["rid"] for e in engines for c in e.calls}) == sum(len(e.calls) for e in engines)  # all distinct


def test_without_chunking_a_failure_restarts_from_the_prompt() -> None:
    async def main() -> tuple[GenerateOutput, FakeEngine]:
        a, b = FakeEngine("http://a", token_delay=0.002), FakeEngine("http://b")
        async with Router([a, b], RouterConfig(chunk_tokens=0, **FAST)) as r:  # type: ignore[list-item]
            task = asyncio.create_task(r.generate([1, 2], {"max_new_tokens": 30}, affinity_key="k"))
            await asyncio.sleep(0.02)
            (a if a.calls else b).dead = True
            out = await task
        return out, (b if a.dead else a)

    out, survivor = run(main())
    assert out.output_ids == expected([1, 2], 30) and out.resubmissions == 1
    assert survivor.calls[-1]["input_ids"] == [1, 2]


def test_shutdown_abort_keeps_partial_output_and_continues_elsewhere() -> None:
    async def main() -> GenerateOutput:
        a, b = FakeEngine("http://a", token_delay=0.002), FakeEngine("http://b")
        async with Router([a, b], RouterConfig(chunk_tokens=0, **FAST)) as r:  # type: ignore[list-item]
            task = asyncio.create_task(r.generate([4], {"max_new_tokens": 30}))
            await asyncio.sleep(0.02)
            (a if a.calls else b).shutdown_abort = True  # SIGTERM: aborts, /health fails
            return await task

    out = run(main())
    assert out.output_ids == expected([4], 30) and out.chunks == 2 and out.finish_reason.type == "length"


def test_hung_engine_is_quarantined_by_health_and_its_requests_move() -> None:
    async def main() -> tuple[GenerateOutput, Router]:
        a, b = FakeEngine("http://a", token_delay=0.001), FakeEngine("http://b")
        router = Router([a, b], RouterConfig(chunk_tokens=0, **FAST))  # type: ignore[list-item]
        async with router:
            task = asyncio.create_task(router.generate([9], {"max_new_tokens": 200}))
            await asyncio.sleep(0.01)
            (a if a.calls else b).hang = True  # alive socket, stuck scheduler: only the health check sees it
            return await task, router

    out, router = run(main())
    assert out.output_ids == expected([9], 200)
    assert len(router.stats().quarantined) == 1


def test_a_live_engines_500_goes_to_the_caller_a_dead_ones_does_not() -> None:
    async def main() -> None:
        a, b = FakeEngine("http://a"), FakeEngine("http://b")
        async with Router([a, b], RouterConfig(**FAST)) as r:  # type: ignore[list-item]
            a.fail_500 = b.fail_500 = True
            with pytest.raises(EngineHTTPError, match="HTTP 500: boom"):
                await r.generate([1], {"max_new_tokens": 2})
            assert r.stats().quarantined == {}
            a.fail_500 = b.fail_500 = False
            r.selector.in_flight[1] = 5  # place on a
            a.fail_500, a.hang = True, True  # a answers 500 and its health check fails
            out = await r.generate([1], {"max_new_tokens": 2})
            assert out.engine_url == "http://b" and "http://a" in r.stats().quarantined

    run(main())


def test_all_engines_down_is_a_clear_error() -> None:
    async def main() -> None:
        a, b = FakeEngine("http://a"), FakeEngine("http://b")
        a.dead = b.dead = True
        async with Router([a, b], RouterConfig(**FAST)) as r:  # type: ignore[list-item]
            with pytest.raises(NoEngineAvailableError) as info:
                await r.generate([1], {"max_new_tokens": 2})
        msg = str(info.value)
        assert "all 2 engines are down" in msg and "http://a (" in msg and "http://b (" in msg
        assert "cannot connect" in msg

    run(main())


def test_readmission_after_good_checks_and_hook() -> None:
    async def main() -> None:
        a, b = FakeEngine("http://a"), FakeEngine("http://b")
        hooked: list[int] = []
        ok = False

        async def hook(i: int, client: Any) -> None:
            hooked.append(i)
            if not ok:
                raise RuntimeError("weights are stale")

        cfg = RouterConfig(readmit_after=3, **FAST)
        async with Router([a, b], cfg, on_readmit=hook) as r:  # type: ignore[list-item]
            a.dead = True
            while "http://a" not in r.stats().quarantined:
                await asyncio.sleep(0.01)
            a.dead = False  # restarted on the same port
            while not hooked:
                await asyncio.sleep(0.01)
            assert "http://a" in r.stats().quarantined  # the hook failed: still out
            assert "weights are stale" in r.stats().quarantined["http://a"]
            ok = True
            while "http://a" in r.stats().quarantined:
                await asyncio.sleep(0.01)
            assert r.selector.available() == [0, 1]

    run(main())


def test_all_down_waits_for_a_readmission() -> None:
    async def main() -> GenerateOutput:
        a = FakeEngine("http://a")
        cfg = RouterConfig(readmit_after=1, health_interval_s=0.02, all_down_grace_s=5)
        async with Router([a], cfg) as r:  # type: ignore[list-item]
            a.dead = True
            while not r.stats().quarantined:
                await asyncio.sleep(0.01)
            task = asyncio.create_task(r.generate([3], {"max_new_tokens": 3}))
            await asyncio.sleep(0.1)
            a.dead = False
            return await task

    assert run(main()).output_ids == expected([3], 3)


def test_client_abort_returns_partial_output_without_resubmission() -> None:
    async def main() -> tuple[GenerateOutput, Router]:
        a = FakeEngine("http://a", token_delay=0.002)
        router = Router([a], RouterConfig(chunk_tokens=4, **FAST))  # type: ignore[list-item]
        async with router:
            task = asyncio.create_task(router.generate([1], {"max_new_tokens": 500}, rid="victim"))
            await asyncio.sleep(0.05)
            await router.abort("victim")
            return await task, router

    out, router = run(main())
    assert out.finish_reason.type == "abort" and 0 < len(out.output_ids) < 500
    assert out.output_ids == expected([1], len(out.output_ids)) and out.resubmissions == 0
    assert router.stats().quarantined == {}


def test_pause_through_the_router_does_not_quarantine() -> None:
    async def main() -> None:
        a = FakeEngine("http://a")
        async with Router([a], RouterConfig(**FAST)) as r:  # type: ignore[list-item]
            await r.pause("retract")
            a.hang = True  # SGLang's /health cannot generate while paused
            await asyncio.sleep(0.1)
            assert r.stats().quarantined == {}
            a.hang = False
            await r.continue_generation()
            assert a.paused == ["retract", "continue"]

    run(main())


def test_continue_aborted_stitches_routing_and_indexer_rows() -> None:
    """A generation cut short by a weight update (pause mode abort) and continued: the continuation asks for its
    records from the last token sampled before it, so they stitch into the uninterrupted request's."""
    from dataclasses import replace

    from miles_hpc.rollout.pieces import continue_aborted
    from miles_hpc.rollout.responses import FinishReason

    prompt = [5, 6, 7, 8]
    sampling = {"max_new_tokens": 10, "temperature": 1.0}
    kw: dict[str, Any] = {"return_logprob": True, "return_routed_experts": True, "return_indexer_topk": True}
    eng = FakeEngine("http://a")

    async def aborting(ids: list[int], params: dict[str, Any], **k: Any) -> GenerateOutput:
        if not eng.calls:  # the first piece: 3 tokens, then aborted
            out = await eng.generate(ids, {**params, "max_new_tokens": 3}, rid="r", **k)
            return replace(out, finish_reason=FinishReason(type="abort"))
        return await eng.generate(ids, params, rid=f"r.{len(eng.calls)}", **k)

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        whole = await FakeEngine("http://b").generate(prompt, sampling, rid="w", **kw)
        first = await aborting(prompt, sampling, **kw)
        return whole, await continue_aborted(aborting, prompt, sampling, first, **kw)

    whole, stitched = run(main())
    assert stitched.output_ids == whole.output_ids and len(eng.calls) == 2
    assert stitched.routed_experts is not None and stitched.indexer_topk is not None
    np.testing.assert_array_equal(stitched.routed_experts, whole.routed_experts)
    np.testing.assert_array_equal(stitched.indexer_topk, whole.indexer_topk)
    assert [c.get("indexer_topk_start_len") for c in eng.calls] == [None, 4 + 3 - 1]
    assert [c.get("routed_experts_start_len") for c in eng.calls] == [None, 4 + 3 - 1]
    # Its prompt is the request's; the prefix-cache account holds both requests' prompts (the continuation resent
    # the prompt with the 3 tokens, all of it computed again after the update's flush).
    assert stitched.prompt_tokens == 4 and stitched.prefill_account() == (4 + 7, 0)
    assert whole.prefill_account() == (4, 0)


def test_a_replaced_clients_session_is_closed_even_if_the_router_closes_at_once() -> None:
    """`replace_client` closes the old client in the background; closing the router right after must finish that
    close, not cancel it (a cancelled close left the session open: aiohttp's "Unclosed client session")."""
    from miles_hpc.rollout.client import EngineClient

    async def main() -> None:
        router = Router.from_urls(["http://127.0.0.1:9", "http://127.0.0.1:10"])
        await router.start()
        session = router.clients[0]._http()
        router.replace_client(0, EngineClient("http://127.0.0.1:11"))
        await router.close()
        assert session.closed

    asyncio.run(main())
