"""Request router over N engines: placement, health checks, quarantine and fail-over (stage: rollout, client side).

Placement (placement.py) is least-in-flight with prefix affinity: one ``affinity_key`` (the samples of a prompt group,
the turns of a session) stays on one engine for prefix-cache hits unless that engine is busier than the least-loaded
one by more than ``affinity_margin``.

Fail-over: an engine that fails (connection refused/reset, timeout, a 5xx or an unasked abort together with a failing
health probe, a failing background ``/health``) is quarantined at once, and every generation running on it is
resubmitted to another engine. A quarantined engine is re-admitted after ``readmit_after`` consecutive good
``/health`` answers and one good ``/health_generate`` (an engine whose HTTP server lives but whose scheduler hangs
must not come back), then the optional ``on_readmit`` hook (e.g. to push the current weights).

Chunking, the trade-off: an engine killed mid-generation returns nothing, so a resubmission restarts from the
prompt and up to ``max_new_tokens`` of work is lost per request. With ``chunk_tokens = K`` the router drives a
generation in pieces of at most K new tokens, each continuing from ``prompt + output so far`` on the same engine
(pieces.py), so a failure loses at most one piece. The cost per piece: one HTTP round trip, one scheduler admission
(under load the continuation may queue behind waiting requests) and a prefix-cache lookup that finds the whole
prefix (the engine cached the previous piece; placement is sticky). An engine that aborts its requests as it shuts
down (SIGTERM) returns their partial output, and the router continues from it. Only sampling params for which
continuing is exact are chunked or continued (pieces.CONTINUABLE_KEYS: no stop strings, penalties, grammars or
seeds); others run in one piece and restart from the prompt.

Invariants:
- ``generate`` returns exactly one result or raises exactly one exception per call; a dead engine's error reaches
  the caller only when every engine is down for ``all_down_grace_s`` (the error names each engine and its last
  error) or a generation failed ``max_resubmits`` times.
- A merged result is what one uninterrupted request returns (pieces.py).
- An abort the caller asked for (``Router.abort``, a pause in abort mode through ``Router.pause``) comes back as
  ``finish_reason.type == "abort"`` with the output so far, never resubmitted.
- Pause engines through :meth:`Router.pause`: while paused, health answers other than "unreachable" do not
  quarantine (SGLang's ``/health`` generates a token, which a paused engine cannot).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

from miles_hpc.rollout.client import (
    EngineClient,
    EngineError,
    EngineHTTPError,
    EngineTimeoutError,
    EngineUnreachableError,
)
from miles_hpc.rollout.pieces import CLIENT_ABORT, Pieces, continuable, piece_params
from miles_hpc.rollout.placement import EngineSelector, NoEngineAvailableError
from miles_hpc.rollout.requests import PauseMode
from miles_hpc.rollout.responses import GenerateOutput

__all__ = ["NoEngineAvailableError", "Router", "RouterConfig", "RouterStats"]
log = logging.getLogger(__name__)
ReadmitHook = Callable[[int, EngineClient], Awaitable[None]]
STEP_FAILED = "engine step failed"  # how our engine's 500 for a failed step begins (engine/core.py `_loop`)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterConfig:
    affinity_margin: int = 8  # in-flight requests a key's engine may exceed the least-loaded by and keep the key
    affinity_capacity: int = 1 << 16  # keys remembered (least recently used forgotten first)
    health_interval_s: float = 2.0
    health_timeout_s: float = 10.0  # SGLang's /health generates one token: it takes >= 1 s
    readmit_after: int = 2  # consecutive good /health answers before the /health_generate that re-admits
    chunk_tokens: int = 512  # 0 = one request per generation (a killed engine's work restarts from the prompt)
    max_resubmits: int = 8  # per generation: a request that kills every engine it touches must stop somewhere
    all_down_grace_s: float = 30.0  # how long a generation waits for a re-admission when every engine is down
    failover_grace_s: float = 1.0  # how long a quarantined engine's running pieces may still answer (partial output)

    def __post_init__(self) -> None:
        if self.affinity_margin < 0 or self.readmit_after < 1 or self.chunk_tokens < 0 or self.max_resubmits < 0:
            raise ValueError(f"invalid RouterConfig: {self}")
        if (
            min(self.health_interval_s, self.health_timeout_s) <= 0
            or min(self.all_down_grace_s, self.failover_grace_s) < 0
        ):
            raise ValueError(f"invalid RouterConfig: {self}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterStats:
    in_flight: dict[str, int]  # engine url -> pieces running there
    quarantined: dict[str, str]  # engine url -> the error that quarantined it (or its last failed check)
    submitted: int
    completed: int
    failed: int
    resubmissions: int


@dataclass(slots=True)
class _Engine:
    failed: asyncio.Future[EngineError]  # set when quarantined; running pieces race against it
    quarantined: bool = False
    last_error: str = ""
    good_checks: int = 0
    probe: asyncio.Future[bool] | None = None  # one health probe at a time, shared by everyone asking


class _EngineFailed(Exception):
    """Internal: the engine running a piece failed; ``partial`` is the output it returned before dying, if any."""

    def __init__(self, engine: int, error: BaseException, partial: GenerateOutput | None = None) -> None:
        super().__init__(str(error))
        self.engine = engine
        self.error = error
        self.partial = partial


class Router:
    """Routes generations over ``clients`` (module docstring). ``async with Router(clients) as r: ...``."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        config: RouterConfig | None = None,
        *,
        on_readmit: ReadmitHook | None = None,
        owns_clients: bool = False,
        lora_path: str | None = None,
    ) -> None:
        """`lora_path`: the LoRA adapter every generation uses unless it names another (LoRA RL's served policy)."""
        if not clients:
            raise ValueError("Router needs at least one engine")
        self.clients = list(clients)
        self.config = config or RouterConfig()
        self.lora_path = lora_path
        self.selector = EngineSelector(
            len(self.clients), margin=self.config.affinity_margin, capacity=self.config.affinity_capacity
        )
        self._on_readmit = on_readmit
        self._owns_clients = owns_clients
        self._engines: list[_Engine] = []  # futures need the running loop: made in start()
        self._readmitted = asyncio.Event()
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._closing: set[asyncio.Future[None]] = set()  # replaced clients being closed: awaited, never cancelled
        self._running: dict[str, tuple[int, str]] = {}  # rid -> (engine, engine-side rid) of its current piece
        self._aborted: set[str] = set()
        self._paused = False
        self._counts = {"submitted": 0, "completed": 0, "failed": 0, "resubmissions": 0}

    @classmethod
    def from_urls(cls, urls: Sequence[str], config: RouterConfig | None = None, **client_kwargs: Any) -> Router:
        return cls([EngineClient(u, **client_kwargs) for u in urls], config, owns_clients=True)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Start the background health checks (idempotent; generate() calls it)."""
        if not self._engines:
            loop = asyncio.get_running_loop()
            self._engines = [_Engine(failed=loop.create_future()) for _ in self.clients]
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="router-health")

    async def close(self) -> None:
        """Stop health checks and background aborts (await your generations first); close owned clients."""
        tasks = [t for t in (self._health_task, *self._background) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._health_task = None
        # A replaced client's close runs to the end: cancelled before it ran, its session would stay open and
        # aiohttp would warn "Unclosed client session" when it is collected.
        await asyncio.gather(*self._closing, return_exceptions=True)
        if self._owns_clients:
            await asyncio.gather(*(c.close() for c in self.clients))

    # ---------------------------------------------------------------------------------------------------------
    # Generation.

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        affinity_key: Hashable | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        return_routed_experts: bool = False,
        routed_experts_start_len: int | None = None,
        return_indexer_topk: bool = False,
        indexer_topk_start_len: int | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> GenerateOutput:
        """One generation on some engine, surviving engine failures. Arguments as :meth:`EngineClient.generate`,
        plus ``affinity_key`` (e.g. the prompt group id, or the session id of a multi-turn episode)."""
        await self.start()
        rid = rid or uuid.uuid4().hex
        opts = {
            "return_logprob": return_logprob,
            "return_routed_experts": return_routed_experts,
            "return_indexer_topk": return_indexer_topk,
            "lora_path": lora_path if lora_path is not None else self.lora_path,
        }
        self._counts["submitted"] += 1
        try:
            out = await self._drive(
                rid,
                list(input_ids),
                dict(sampling_params),
                affinity_key,
                logprob_start_len,
                (routed_experts_start_len, indexer_topk_start_len),
                opts,
            )
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            self._running.pop(rid, None)
            self._aborted.discard(rid)
        self._counts["completed"] += 1
        return out

    async def _drive(
        self,
        rid: str,
        prompt: list[int],
        sampling: dict[str, Any],
        key: Hashable | None,
        logprob_start_len: int | None,
        starts: tuple[int | None, int | None],
        opts: dict[str, Any],
    ) -> GenerateOutput:
        """The pieces of one generation (module docstring); ``starts``: the first piece's routing and indexer
        record starts."""
        can_continue = continuable(sampling)
        chunk = self.config.chunk_tokens if can_continue else 0
        max_new = int(sampling["max_new_tokens"]) if can_continue else 0
        pieces = Pieces(prompt=prompt)
        resubmits = 0
        engine: int | None = None  # the engine holding this generation's prefix in its cache
        while True:
            done = len(pieces.output_ids)
            if pieces.count and rid in self._aborted:  # aborted between two pieces
                return pieces.result(rid, resubmits, CLIENT_ABORT)
            piece = piece_params(sampling, done, chunk) if can_continue else sampling
            first = pieces.count == 0
            if engine is None or engine in self.selector.quarantined:
                engine = await self._place(key if first else None, rid)
                if key is not None and not first:
                    self.selector.remember(key, engine)  # the continuation moved the session's prefix there
            # Each piece gets its own engine-side rid: an engine may still hold a cancelled piece's rid for a moment,
            # and SGLang refuses a duplicate rid. The result carries the caller's rid.
            attempt = pieces.count + resubmits
            try:
                out = await self._attempt(
                    engine,
                    rid,
                    prompt + pieces.output_ids,
                    piece,
                    rid=rid if attempt == 0 else f"{rid}.{attempt}",
                    # Prompt log-probs and the record starts belong to the first piece; a later piece's routing
                    # and indexer rows start at the last token the previous piece sampled (never fed through the
                    # model there), so the pieces' rows tile the whole generation's.
                    logprob_start_len=logprob_start_len if first else None,
                    routed_experts_start_len=starts[0] if first else len(prompt) + done - 1,
                    indexer_topk_start_len=starts[1] if first else len(prompt) + done - 1,
                    **opts,
                )
            except _EngineFailed as e:
                if e.partial is not None and e.partial.output_ids and can_continue:
                    pieces.add(e.partial)  # an engine shutting down returned what it had: keep it
                resubmits += 1
                self._counts["resubmissions"] += 1
                if resubmits > self.config.max_resubmits:
                    raise NoEngineAvailableError(
                        f"generation {rid}: gave up after {resubmits - 1} resubmissions; last failure: {e.error}"
                    ) from e.error
                log.warning("resubmitting %s (%d tokens kept) after: %s", rid, len(pieces.output_ids), e.error)
                engine = None
                continue
            pieces.add(out)
            if rid in self._aborted:
                return pieces.result(rid, resubmits, CLIENT_ABORT)
            more = (
                can_continue
                and out.finish_reason.type == "length"
                and len(out.output_ids) == piece["max_new_tokens"]  # fewer: the context limit ended it
                and len(pieces.output_ids) < max_new
            )
            if not more:
                return pieces.result(rid, resubmits)

    async def _place(self, key: Hashable | None, rid: str) -> int:
        """An available engine, waiting up to all_down_grace_s for a re-admission when there is none."""
        deadline = time.monotonic() + self.config.all_down_grace_s
        while True:
            try:
                return self.selector.pick(key)
            except NoEngineAvailableError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    down = "; ".join(f"{c.url} ({e.last_error})" for c, e in zip(self.clients, self._engines))
                    raise NoEngineAvailableError(
                        f"generation {rid}: all {len(self.clients)} engines are down: {down}"
                    ) from None
                event = self._readmitted
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    pass

    async def _attempt(
        self, i: int, gen_rid: str, input_ids: list[int], sampling: dict[str, Any], **kw: Any
    ) -> GenerateOutput:
        """One piece of generation ``gen_rid`` on engine ``i``; raises _EngineFailed when the engine (not the request)
        failed."""
        failed = self._engines[i].failed
        piece_rid = kw["rid"]
        self.selector.in_flight[i] += 1
        self._running[gen_rid] = (i, piece_rid)
        task = asyncio.ensure_future(self.clients[i].generate(input_ids, sampling, **kw))
        try:
            # Race the request against the engine's quarantine: a health check that finds the engine dead frees
            # the requests waiting on it now, not when their (long) timeout expires.
            racers: set[asyncio.Future[Any]] = {task, failed}
            await asyncio.wait(racers, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                # An engine shutting down answers its requests (with their partial output) within moments; a dead
                # or hung one does not.
                await asyncio.wait({task}, timeout=self.config.failover_grace_s)
                if not task.done():
                    task.cancel()
                    self._abort_later(i, piece_rid)  # in case it only hangs
                    raise _EngineFailed(i, failed.result())
            try:
                out = task.result()
            except (EngineUnreachableError, EngineTimeoutError) as e:
                self.quarantine(i, e)
                if isinstance(e, EngineTimeoutError):
                    self._abort_later(i, piece_rid)
                raise _EngineFailed(i, e) from e
            except EngineHTTPError as e:
                # A 5xx may be this request's fault or the engine's: ask the engine. A live engine's 5xx goes to
                # the caller (resubmitting a request that breaks engines would take them all down), except a step
                # that failed (a dead tensor-parallel rank, an OOM: our engine's 500 says so), which takes the
                # engine out like a lost connection; max_resubmits still bounds a request that breaks every engine.
                if e.status >= 500 and e.server_message.startswith(STEP_FAILED):
                    self.quarantine(i, e)
                    raise _EngineFailed(i, e) from e
                if e.status >= 500 and not await self._probe(i):
                    raise _EngineFailed(i, e) from e
                raise
            unasked_abort = out.finish_reason.type == "abort" and gen_rid not in self._aborted and not self._paused
            # Nobody asked for this abort: an engine shutting down aborts what it runs. Its partial output is good;
            # the router continues it elsewhere.
            if unasked_abort and not await self._probe(i):
                raise _EngineFailed(i, EngineError(self.clients[i].url, "POST /generate", "engine went away"), out)
            return out
        except asyncio.CancelledError:
            task.cancel()
            self._abort_later(i, piece_rid)
            raise
        finally:
            self.selector.in_flight[i] -= 1

    async def _probe(self, i: int) -> bool:
        """Whether engine ``i`` answers /health now; quarantines it if not. Concurrent callers share one probe."""
        eng = self._engines[i]
        if eng.quarantined:
            return False
        if eng.probe is None:

            async def probe() -> bool:
                try:
                    await self.clients[i].health(timeout=self.config.health_timeout_s, retries=0)
                    return True
                except EngineError as e:
                    self.quarantine(i, e)
                    return False
                finally:
                    eng.probe = None

            eng.probe = asyncio.ensure_future(probe())
        return await asyncio.shield(eng.probe)

    def _abort_later(self, i: int, rid: str) -> None:
        async def abort() -> None:
            try:
                await self.clients[i].abort(rid, timeout=self.config.health_timeout_s)
            except EngineError:
                pass  # best effort: the engine is probably gone

        task = asyncio.create_task(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, rid: str) -> None:
        """Abort one generation: it returns ``finish_reason.type == "abort"`` with the output so far."""
        self._aborted.add(rid)
        running = self._running.get(rid)
        if running is not None and running[0] not in self.selector.quarantined:
            await self.clients[running[0]].abort(running[1])

    # ---------------------------------------------------------------------------------------------------------
    # Engine-wide control, for the weight-sync stage.

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Pause every available engine (module invariants: pause through the router)."""
        self._paused = True
        await asyncio.gather(*(c.pause(mode) for c in self.available_clients()))

    async def continue_generation(self) -> None:
        await asyncio.gather(*(c.continue_generation() for c in self.available_clients()))
        self._paused = False

    @property
    def paused(self) -> bool:
        """True between a pause and the next continue: engine aborts are then the pause's, not failures."""
        return self._paused

    @paused.setter
    def paused(self, value: bool) -> None:
        """For callers that pause engines themselves (the weight-sync publisher, engine by engine)."""
        self._paused = value

    def available_clients(self) -> list[EngineClient]:
        return [self.clients[i] for i in self.selector.available()]

    # ---------------------------------------------------------------------------------------------------------
    # Health.

    def quarantine(self, i: int, error: BaseException) -> None:
        """Take engine ``i`` out of placement and fail over every piece running on it."""
        eng = self._engines[i]
        eng.last_error = str(error)
        eng.good_checks = 0
        if eng.quarantined:
            return
        eng.quarantined = True
        self.selector.quarantined.add(i)
        log.warning("quarantined engine %s: %s", self.clients[i].url, error)
        err = error if isinstance(error, EngineError) else EngineError(self.clients[i].url, "", str(error))
        eng.failed.set_result(err)

    def replace_client(self, i: int, client: EngineClient) -> None:
        """Engine ``i`` now answers at ``client``'s URL (it was restarted): it stays quarantined, with its old work
        failed over, until the health checks re-admit it (``on_readmit`` included). The old client is closed when
        the router owns it."""
        self.quarantine(i, EngineError(self.clients[i].url, "", f"replaced by {client.url}"))
        old, self.clients[i] = self.clients[i], client
        self._engines[i].good_checks = 0
        if self._owns_clients:
            task = asyncio.ensure_future(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _readmit(self, i: int) -> None:
        eng = self._engines[i]
        eng.quarantined = False
        eng.good_checks = 0
        eng.failed = asyncio.get_running_loop().create_future()
        self.selector.quarantined.discard(i)
        log.warning("re-admitted engine %s", self.clients[i].url)
        # Wake every generation waiting for an engine, and arm a fresh event for the next wait.
        self._readmitted.set()
        self._readmitted = asyncio.Event()

    async def check_engine(self, i: int) -> None:
        """One health check of engine ``i``; the background loop runs it for every engine each interval."""
        eng = self._engines[i]
        client = self.clients[i]
        try:
            await client.health(timeout=self.config.health_timeout_s, retries=0)
        except EngineError as e:
            if eng.quarantined:
                eng.good_checks = 0
                eng.last_error = str(e)
            elif not self._paused or isinstance(e, EngineUnreachableError):
                self.quarantine(i, e)
            return
        if not eng.quarantined:
            return
        eng.good_checks += 1
        if eng.good_checks < self.config.readmit_after:
            return
        try:
            await client.health_generate(timeout=self.config.health_timeout_s, retries=0)
            if self._on_readmit is not None:
                await self._on_readmit(i, client)
        except Exception as e:  # the hook may fail any way; the engine then stays out and is tried again
            eng.good_checks = 0
            eng.last_error = f"re-admission check failed: {e}"
            return
        if eng.quarantined:
            self._readmit(i)

    async def _health_loop(self) -> None:
        while True:
            checks = [self.check_engine(i) for i in range(len(self.clients))]
            for client, r in zip(self.clients, await asyncio.gather(*checks, return_exceptions=True)):
                if isinstance(r, Exception):  # a bug in one check must not stop the checks of the others
                    log.error("health check of %s crashed: %r", client.url, r)
            await asyncio.sleep(self.config.health_interval_s)

    def stats(self) -> RouterStats:
        return RouterStats(
            in_flight={c.url: n for c, n in zip(self.clients, self.selector.in_flight)},
            quarantined={c.url: e.last_error for c, e in zip(self.clients, self._engines) if e.quarantined},
            **self._counts,
        )
