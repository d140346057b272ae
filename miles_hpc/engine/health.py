"""`/health_generate`'s judgement: does the engine still make progress? (stage: engine, HTTP layer.)

SGLang 0.5.23 (`http_server.health_generate`) sends a one-token request with ``log_metrics=False`` and answers 200 as
soon as its tokenizer manager has received any output from the scheduler after the probe began
(``last_receive_tstamp``): an engine busy with a full queue, where the probe waits its turn, is healthy. It answers
503 only when nothing arrives within its timeout, and cancels the probe either way.

Invariants:
- Healthy once the engine completes a step after the probe was submitted (its stats' ``num_steps_total`` grows:
  any step, prefill or decode, whoever it served), or once the probe itself gets its token (not an error or an
  abort, as in a shutdown: those are 503s naming them). A step that raised does not count (the engine counts only
  steps it postprocessed). An engine paused during the check (a weight sync began) is healthy too: the server
  answers a pause at once (server.py).
- The probe is a 1-token greedy request on prompt ``[0]`` with ``log_metrics=False`` (no request counter sees it)
  and is aborted as soon as the answer is known, so it never holds a queue slot after the check.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from .core import Engine
from .types import GenerateRequest, GenerateResult, SamplingParams

Run = Callable[[list[GenerateRequest]], Awaitable[list[GenerateResult]]]
POLL_S = 0.02


def probe_request() -> GenerateRequest:
    """SGLang's probe: rid ``HEALTH_CHECK_<hex>``, input ``[0]``, one greedy token, no metrics."""
    return GenerateRequest(
        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
        input_ids=(0,),
        sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        log_metrics=False,
    )


def _steps(engine: Engine) -> int:
    return int(engine.stats()["num_steps_total"])


async def check_progress(engine: Engine, run: Run, timeout_s: float) -> str | None:
    """None when the engine progressed within ``timeout_s`` (see module invariants), else why not. ``run`` submits
    requests and awaits their results, aborting those left when it is cancelled (`EngineServer._run`)."""
    before = _steps(engine)
    task = asyncio.ensure_future(run([probe_request()]))
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if _steps(engine) > before or engine.paused:  # paused meanwhile (a weight sync): on purpose
                return None
            if task.done():
                if task.exception() is not None:
                    return f"the health probe was refused: {task.exception()}"
                res = task.result()[0]
                if res.error is None and res.finish_reason.type == "abort":  # shutting down, say
                    return f"the health probe was aborted: {res.finish_reason.message}"
                return res.error  # None: the probe got its token
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no engine step completed within {timeout_s:g} s of the health probe"
            await asyncio.wait({task}, timeout=min(POLL_S, left))
    finally:
        if not task.done():
            task.cancel()  # `run` aborts the probe: it must not wait in the queue once the answer is known
