"""Continuous-batching scheduler: who runs this step, with how many tokens, in which KV blocks; then bookkeeping.

Stage: engine. `schedule()` -> runner.run() -> `postprocess()`; all host-side, no tensors but the block table.

Invariants:
- A request's `tokens` = prompt + output; `num_computed` tokens of it have KV in its blocks. Each step processes
  `tokens[num_computed : num_computed + n]`; when that reaches the end, the last row samples the next token. So
  decode (n = 1), chunked prefill and the re-prefill of a retracted request (prompt + output so far) are one case.
- Running requests are served first, in admission order: 1 token each when decoding, prefill chunks within the
  step's `max_prefill_tokens`. New requests are admitted FIFO with what budget is left, never in a step that had
  to retract, and only while enough blocks stay free for each running request to grow by one block.
- Out of blocks: the most recently admitted running request is retracted (its blocks released, back to the front of
  the queue, its output kept and recomputed later). A request alone always fits (`Engine.submit` checks).
- Prefix reuse covers whole cached blocks, at most len(tokens) - 1 tokens (one row must compute logits), and stops
  before the first prompt row whose input log-prob is still owed.
- A waiting request whose first uncached block a running request is computing right now waits for it (its later
  requests are admitted past it): once that block is registered it is a hit. Without this, requests that arrive
  together with a shared prefix (the episodes of a step after a weight update flushed the cache: one system
  prompt) would each compute it.
- A step is launched, then `commit`ted (its tokens count as computed, and each sampling row appends `PLACEHOLDER`
  for the token it will sample), then `postprocess`ed with its results (placeholders filled in order). Between
  `commit` and `postprocess` the next step may be scheduled (the engine's overlap of host and device): a request's
  next input may then be a placeholder, which the runner takes from the device; a request whose every token is
  sampled (pending included) is not scheduled again, and one that an earlier result finished (a stop token) is
  skipped when the later step's results come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .kv_cache import BlockManager, block_key
from .types import FinishReason, GenerateRequest, GenerateResult

PLACEHOLDER = -1
"""`Req.tokens` entry of a token sampled by a launched step whose results are not in yet."""


@dataclass(eq=False, slots=True)
class Req:
    """Mutable engine-side state of one request."""

    req: GenerateRequest
    on_done: Callable[[GenerateResult], None]
    seed: int
    t_submit: float
    tokens: list[int]
    prompt_len: int
    banned_early: tuple[int, ...]  # ids masked while len(output) < min_new_tokens
    stop_ids: frozenset[int]
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # by prompt position; [0] stays None
    lp_next: int | None = None  # first prompt row whose logits are still owed for input log-probs; None = none owed
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # chained keys of the full blocks of `tokens`
    namespace: bytes | None = None  # seeds the key chain: the LoRA adapter's name, None for the base model
    num_registered: int = 0  # blocks of `blocks` offered to the prefix index
    num_computed: int = 0
    pending: int = 0  # trailing PLACEHOLDER entries of `tokens` (sampled by steps in flight)
    row: int = -1  # block-table row while running
    epoch: int = 0  # prefix-cache epoch at admission
    cached_tokens: int = 0
    num_retractions: int = 0
    spans: list[dict[str, object]] = field(default_factory=list)
    finish: FinishReason | None = None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def ensure_keys(self, n_blocks: int, block_size: int) -> list[bytes]:
        while len(self.keys) < n_blocks:
            j = len(self.keys)
            parent = self.keys[-1] if self.keys else self.namespace
            chunk = self.tokens[j * block_size : (j + 1) * block_size]
            assert PLACEHOLDER not in chunk, "a block key over a token not sampled yet"
            self.keys.append(block_key(parent, chunk))
        return self.keys[:n_blocks]


@dataclass(slots=True)
class Scheduled:
    """One sequence's share of a step."""

    r: Req
    start: int  # tokens already in the cache
    n: int  # new tokens this step
    sample: bool  # the last row samples a token
    lp_rows: tuple[int, int] | None  # absolute prompt positions [a, b) whose logits give input log-probs a+1..b


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_running: int,
        max_prefill_tokens: int,
        enable_prefix_cache: bool,
    ) -> None:
        self.bm = blocks
        self.bs = blocks.block_size
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = enable_prefix_cache
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retractions = 0
        self.admitted_tokens = 0  # tokens of admitted requests (re-admissions after retraction count again)
        self.cached_tokens = 0  # of those, served from the prefix cache

    def add(self, r: Req) -> None:
        self.waiting.append(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- schedule
    def schedule(self) -> list[Scheduled]:
        budget = self.max_prefill_tokens
        out: list[Scheduled] = []
        retracted = False
        i = 0
        while i < len(self.running):
            r = self.running[i]
            remaining = len(r.tokens) - r.num_computed
            n = 1 if remaining == 1 else min(remaining, budget)
            if n == 0 or 0 < r.req.sampling.max_new_tokens <= r.num_output:  # all sampled: results in flight
                i += 1
                continue
            need = self._blocks_for(r.num_computed + n) - len(r.blocks)
            while need > self.bm.num_available() and self.running[-1] is not r:
                self.retract(self.running[-1])
                retracted = True
            if need > self.bm.num_available():
                self.retract(r)  # r is the most recent: it yields to the older requests
                retracted = True
                break
            self._grow(r, need)
            if remaining > 1:
                budget -= n
            out.append(self._scheduled(r, n))
            i += 1
        if not retracted:
            pending = self._pending_keys()
            j = 0
            while j < len(self.waiting) and len(self.running) < self.max_running and budget > 0:
                w = self.waiting[j]
                if pending and self._first_missing(w) in pending:
                    j += 1  # its prefix is being computed: a hit once registered
                    continue
                s = self._admit(w, budget)
                if s is None:
                    break
                del self.waiting[j]
                budget -= s.n
                out.append(s)
                pending |= self._computing(s.r)
        return out

    def _prefix_keys(self, r: Req) -> list[bytes]:
        """Keys of the full blocks a prefix hit may cover for `r` (module invariants)."""
        cap = len(r.tokens) - 1 if r.lp_next is None else min(len(r.tokens) - 1, r.lp_next)
        return r.ensure_keys(cap // self.bs, self.bs)

    def _first_missing(self, r: Req) -> bytes | None:
        """The key of `r`'s first block the prefix index does not hold (None: all it may reuse are cached)."""
        return next((k for k in self._prefix_keys(r) if k not in self.bm.index), None)

    def _computing(self, r: Req) -> set[bytes]:
        """Keys of the full blocks running request `r` computes and will register (none after a flush); a block
        that ends in a token a step in flight samples is left out until that token is known."""
        if not self.prefix_cache or r.epoch != self.bm.epoch:
            return set()
        return set(r.ensure_keys((len(r.tokens) - r.pending) // self.bs, self.bs)[r.num_registered :])

    def _pending_keys(self) -> set[bytes]:
        if not self.prefix_cache:
            return set()
        return set().union(*(self._computing(r) for r in self.running))

    def _blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.bs)

    def _grow(self, r: Req, n: int) -> None:
        if n > 0:
            new = self.bm.allocate(n)
            assert new is not None
            self.bm.set_row(r.row, len(r.blocks), new)
            r.blocks.extend(new)

    def _admit(self, r: Req, budget: int) -> Scheduled | None:
        hits: list[int] = []
        if self.prefix_cache:
            hits = self.bm.match(self._prefix_keys(r))
        start = len(hits) * self.bs
        n = min(len(r.tokens) - start, budget)
        need = self._blocks_for(start + n) - len(hits)
        # Leave a block per running request so they can grow next step without retracting this one.
        if need + len(self.running) > self.bm.num_available() or not self.bm.free_rows:
            self.bm.release(hits[::-1])
            return None
        new = self.bm.allocate(need)
        assert new is not None
        r.row = self.bm.take_row()
        r.blocks = hits + new
        self.bm.set_row(r.row, 0, r.blocks)
        r.num_computed = start
        r.num_registered = len(hits)
        if not r.num_retractions:  # SGLang's: the first admission's hits (re-prefills count in the engine's totals)
            r.cached_tokens = start
        self.admitted_tokens += len(r.tokens)
        self.cached_tokens += start
        r.epoch = self.bm.epoch
        self.running.append(r)
        return self._scheduled(r, n)

    def _scheduled(self, r: Req, n: int) -> Scheduled:
        start = r.num_computed
        sample = start + n == len(r.tokens) and r.req.sampling.max_new_tokens > 0
        lp_rows = None
        if r.lp_next is not None:
            a, b = max(start, r.lp_next), min(start + n, r.prompt_len - 1)
            lp_rows = (a, b) if b > a else None
        return Scheduled(r, start, n, sample, lp_rows)

    # ---------------------------------------------------------------- state changes
    def retract(self, r: Req) -> None:
        """Free a running request's KV and put it at the front of the queue (its tokens are recomputed)."""
        self.running.remove(r)
        self._free(r)
        r.num_computed = 0
        r.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(r)

    def retract_all(self) -> None:
        """Retract every running request, newest first, so the queue keeps their admission order."""
        while self.running:
            self.retract(self.running[-1])

    def remove(self, rid: str | None) -> list[Req]:
        """Take requests (one rid, or all) out of the scheduler; their blocks stay held until `free`."""
        pick = [r for r in (*self.running, *self.waiting) if rid is None or r.rid == rid]
        ids = {id(r) for r in pick}
        self.running = [r for r in self.running if id(r) not in ids]
        self.waiting = deque(r for r in self.waiting if id(r) not in ids)
        return pick

    def free(self, r: Req) -> None:
        self._free(r)

    def _free(self, r: Req) -> None:
        if r.row >= 0:
            self.bm.give_row(r.row)
            r.row = -1
        self.bm.release(r.blocks[::-1])
        r.blocks = []
        r.num_registered = 0

    # ---------------------------------------------------------------- postprocess
    def commit(self, batch: Sequence[Scheduled]) -> None:
        """A launched step's tokens count as computed; each sampling row appends the PLACEHOLDER of its token."""
        for s in batch:
            r = s.r
            r.num_computed += s.n
            if s.sample:
                r.tokens.append(PLACEHOLDER)
                r.pending += 1

    def postprocess(
        self,
        batch: Sequence[Scheduled],
        tokens: Sequence[int | None],
        logprobs: Sequence[float | None],
        input_lps: Sequence[list[float] | None],
        version: str,
        eos_ids: frozenset[int],
    ) -> tuple[list[Req], int]:
        """Fill a committed step's results in; returns the requests it finished (out of `running`/`waiting`, blocks
        still held so the caller can read their routing before `free`) and how many tokens it added. Rows of
        requests that an earlier step's results already finished are skipped."""
        finished: list[Req] = []
        added = 0
        for s, tok, lp, ilp in zip(batch, tokens, logprobs, input_lps):
            r = s.r
            if r.finish is not None:
                continue
            if s.sample:
                assert tok is not None and lp is not None and r.pending > 0
                self._fill(r, tok, lp, version, eos_ids)
                added += 1
            self._register(r)
            if s.lp_rows is not None and ilp is not None and r.input_logprobs is not None:
                a, b = s.lp_rows
                r.input_logprobs[a + 1 : b + 1] = ilp
                r.lp_next = b if b < r.prompt_len - 1 else None
            if not s.sample and r.req.sampling.max_new_tokens == 0 and r.num_computed == len(r.tokens):
                r.finish = FinishReason(type="length", length=0)
            if r.finish is not None:
                if r.pending:  # tokens sampled after the finishing one (steps in flight) are dropped
                    del r.tokens[len(r.tokens) - r.pending :]
                    r.pending = 0
                if r in self.running:
                    self.running.remove(r)
                else:  # retracted while its last step was in flight
                    self.waiting.remove(r)
                finished.append(r)
        return finished, added

    def _register(self, r: Req) -> None:
        if not self.prefix_cache or r.epoch != self.bm.epoch:
            return
        full = r.num_computed // self.bs
        if full > r.num_registered:
            keys = r.ensure_keys(full, self.bs)
            for j in range(r.num_registered, full):
                self.bm.register(r.blocks[j], keys[j])
            r.num_registered = full

    @staticmethod
    def _fill(r: Req, tok: int, lp: float, version: str, eos_ids: frozenset[int]) -> None:
        """The oldest pending token of `r` is `tok` (log-prob `lp`)."""
        i = len(r.tokens) - r.pending
        r.pending -= 1
        n_out = i - r.prompt_len
        r.tokens[i] = tok
        r.output_logprobs.append(lp)
        if r.spans and r.spans[-1]["version"] == version:
            r.spans[-1]["end"] = n_out + 1
        else:
            r.spans.append({"version": version, "start": n_out, "end": n_out + 1})
        sp = r.req.sampling
        if tok in r.stop_ids or (not sp.ignore_eos and tok in eos_ids):
            r.finish = FinishReason(type="stop", matched=tok)
        elif n_out + 1 >= sp.max_new_tokens:
            r.finish = FinishReason(type="length", length=sp.max_new_tokens)
