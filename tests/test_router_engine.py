"""The router over three real embedded engines (``miles-hpc serve`` subprocesses), one SIGKILLed mid-generation.

Every request completes with a valid result (its log-probs are what a surviving engine scores for the same tokens,
its routing covers every position), the killed engine is quarantined, and it is re-admitted once restarted on the
same port.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Iterator

import pytest
from test_client_engine import HAVE_SERVER, EngineProcess, engine_fleet

from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.responses import GenerateOutput, metric_sum
from miles_hpc.rollout.router import Router, RouterConfig
from miles_hpc.rollout.sglang import wait_for_engines

pytestmark = [
    pytest.mark.skipif(not HAVE_SERVER, reason="the embedded engine server (miles-hpc serve) is not built"),
    pytest.mark.process,
]
N_NEW = 160


@pytest.fixture
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with engine_fleet(tmp_path_factory.mktemp("rendezvous"), 3) as procs:
        yield procs


async def _score(client: EngineClient, prompt: list[int], out: GenerateOutput) -> list[float | None]:
    """The log-probs an engine assigns to ``out``'s tokens when fed prompt + output (teacher forcing). Entry 0 of
    ``input_token_logprobs`` (token ``logprob_start_len``) is None on SGLang and on ours, so start one token early."""
    scored = await client.generate(
        prompt + out.output_ids, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=len(prompt) - 1
    )
    assert scored.input_logprobs is not None and scored.input_logprobs[0] is None
    return scored.input_logprobs[1:]


def test_sigkill_mid_generation_loses_nothing_and_readmits(engines: list[EngineProcess]) -> None:
    records = wait_for_engines(engines[0].rendezvous.parent, 3, timeout=90, poll_s=0.05)
    urls = [r.url for r in records]
    for proc, rec in zip(engines, records):
        proc.port = rec.port  # a restart comes back on the same port
    prompts = {(g, s): [(g * 37 + k * 11) % 250 + 3 for k in range(20)] for g in range(4) for s in range(3)}
    cfg = RouterConfig(
        chunk_tokens=32,
        health_interval_s=0.1,
        health_timeout_s=3,
        readmit_after=2,
        all_down_grace_s=30,
        failover_grace_s=0.5,
    )

    async def main() -> None:
        async with Router.from_urls(urls, cfg, connect_retries=0) as router:
            tasks = {
                key: asyncio.create_task(
                    router.generate(
                        p,
                        {"max_new_tokens": N_NEW, "ignore_eos": True},
                        affinity_key=key[0],
                        return_logprob=True,
                        return_routed_experts=True,
                    )
                )
                for key, p in prompts.items()
            }
            # Kill the busiest engine once its generations are well under way (some pieces done, none finished).
            # SIGKILL: no goodbye, no partial output of the running piece.
            victim = -1
            for _ in range(500):
                await asyncio.sleep(0.01)
                in_flight = router.stats().in_flight
                busiest = max(range(3), key=lambda i: in_flight[urls[i]])
                made = metric_sum(await router.clients[busiest].metrics(), "sglang:generation_tokens_total") or 0
                if in_flight[urls[busiest]] >= 2 and made >= 45 * in_flight[urls[busiest]]:  # past the 1st piece
                    victim = busiest
                    break
            assert victim >= 0 and router.stats().completed == 0, "no engine was mid-generation"
            engines[victim].kill(signal.SIGKILL)
            results = {key: await t for key, t in tasks.items()}

            stats = router.stats()
            assert list(stats.quarantined) == [urls[victim]]
            assert stats.completed == len(prompts) and stats.failed == 0 and stats.resubmissions >= 1
            survivor = router.clients[(victim + 1) % 3]
            for key, out in results.items():
                assert out.finish_reason.type == "length" and out.completion_tokens == len(out.output_ids) == N_NEW
                assert out.engine_url != urls[victim]
                assert out.output_logprobs is not None and len(out.output_logprobs) == N_NEW
                assert all(math.isfinite(x) and x <= 0 for x in out.output_logprobs)
                assert out.routed_experts is not None and out.routed_experts.shape == (20 + N_NEW - 1, 2, 2)
                assert [(s.start, s.end) for s in out.weight_versions] == [(0, N_NEW)]
                if out.resubmissions:  # a moved generation is still the model's: a survivor scores it the same
                    assert out.chunks > 1 or out.completion_tokens <= cfg.chunk_tokens
                    scored = await _score(survivor, prompts[key], out)
                    assert scored == pytest.approx(out.output_logprobs, abs=1e-3)
            assert sum(o.resubmissions for o in results.values()) == stats.resubmissions
            print(
                f"killed engine {victim}; resubmissions {stats.resubmissions}; "
                f"chunks {sorted(o.chunks for o in results.values())}"
            )

            # Restarted on the same port: re-admitted after good health checks, then takes traffic again.
            await asyncio.to_thread(lambda: engines[victim].start().wait_ready())
            for _ in range(300):
                if not router.stats().quarantined:
                    break
                await asyncio.sleep(0.05)
            assert router.stats().quarantined == {}
            more = await asyncio.gather(*(router.generate([5, 6, 7], {"max_new_tokens": 4}) for _ in range(6)))
            assert urls[victim] in {o.engine_url for o in more}

            # SIGTERM (e.g. a preempted node): the engine aborts what it runs and answers with the partial output,
            # which the router continues elsewhere.
            tasks = {
                key: asyncio.create_task(
                    router.generate(p, {"max_new_tokens": N_NEW, "ignore_eos": True}, return_logprob=True)
                )
                for key, p in list(prompts.items())[:6]
            }
            while router.stats().in_flight[urls[victim]] == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            assert engines[victim].proc is not None
            engines[victim].proc.send_signal(signal.SIGTERM)
            moved = 0
            for key, t in tasks.items():
                out = await t
                assert out.completion_tokens == N_NEW and out.finish_reason.type == "length"
                if out.resubmissions:
                    moved += 1
                    assert await _score(survivor, prompts[key], out) == pytest.approx(out.output_logprobs, abs=1e-3)
            assert urls[victim] in router.stats().quarantined and moved >= 1

    asyncio.run(asyncio.wait_for(main(), 120))
