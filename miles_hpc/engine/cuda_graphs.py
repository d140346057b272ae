"""Decode-only steps through persistent device buffers, replayed from CUDA graphs captured per padded batch size.

Stage: engine (`ModelRunner` hands a decode-only step of a dense model to `DecodeRunner`).

How: the inputs of a decode step are token ids, positions, block-table rows and, for rows whose token the previous
step sampled and the host has not seen yet, that step's row (`src`). They are staged in pinned host memory and
copied without a host wait into fixed device buffers (ids/positions/src int64 [3, max_batch], block tables int32
[max_batch, max_blocks_per_seq]); everything else is computed from them on the device by the captured step: ids of
`src` rows gathered from the previous step's sampled tokens, the `DecodeFn` (slots, context lengths, RoPE, the
forward) writing logits into a fixed [max_batch, vocab] buffer, then greedy sampling of every row (argmax and its
log-prob under the float32 log-softmax: `DecodeOps.greedy_sample`, one Triton pass on CUDA) into `tokens` /
`logprobs`. Steps that sample otherwise overwrite those rows after the replay (`set_samples`). `read_back` copies the results to pinned
host memory behind an event: the host waits only when it reads them (`Pending.wait`), so it can schedule the next
step while the device runs this one. A batch of n runs the graph of the smallest captured size >= n (1, 2, 4, 8,
then steps of 16 / 32 up to 256); rows past n are padding.

Invariants:
- Padding rows never touch real KV: their position is 0 and their block-table row starts with the scratch block
  (a block the allocator never hands out), so they write and read only that block's slot 0.
- Graphs read the model's parameters and the KV cache in place: weight updates by in-place `copy_` (weights.py)
  keep them valid; nothing may re-allocate a parameter or the cache after capture.
- Capture happens once, at construction (before any other thread uses the device); without graphs (CPU, or
  `EngineConfig.cuda_graphs=False`) the same buffers and padding are used eagerly.
- Only the rows' table columns that the step needs are copied in; stale columns past them are never read.
- Two staging slots alternate: a slot is written again only after the step that last used it was waited for
  (the engine keeps at most one step in flight), so no copy reads a staging buffer the host is rewriting.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from .decode_ops import greedy_sample_reference

log = logging.getLogger(__name__)

# (ids int64 [n], positions int64 [n], block_tables int32 [n, W], logits_out [n, vocab]) -> None
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (logits [n, vocab], tokens_out int64 [n], logprobs_out float32 [n]) -> None
Sampler = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, 16, 32, ..., 128 (steps of 16), 160, ..., 256 (steps of 32),
    capped at `max_batch` (which is itself included)."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, MAX_GRAPH_BATCH + 1, 32)]
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return sorted({s for s in sizes if s < cap} | {cap})


class Pending:
    """Results of a launched step on their way to the host: `wait()` -> (tokens, logprobs) of its first n rows."""

    def __init__(self, event: torch.cuda.Event | None, tokens: torch.Tensor, logprobs: torch.Tensor, n: int) -> None:
        self.event, self.tokens, self.logprobs, self.n = event, tokens, logprobs, n

    def wait(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens[: self.n].tolist(), self.logprobs[: self.n].tolist()


class DecodeRunner:
    """Runs a `DecodeFn` for decode-only batches: graph replay when captured, else eagerly on the same buffers."""

    def __init__(
        self,
        forward: DecodeFn,
        *,
        max_batch: int,
        table_width: int,
        vocab_size: int,
        scratch_block: int,
        device: torch.device,
        dtype: torch.dtype,
        use_graphs: bool,
        sampler: Sampler = greedy_sample_reference,
    ) -> None:
        """`sampler(logits, tokens_out, logprobs_out)`: the greedy sampler run inside the graph (a `DecodeOps`'s)."""
        self.forward = forward
        self.sampler = sampler
        self.max_batch = max_batch
        self.scratch_block = scratch_block
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        self.idpos = torch.zeros(3, max_batch, dtype=torch.int64, device=device)  # ids, positions, src
        self.tables = torch.full((max_batch, table_width), scratch_block, dtype=torch.int32, device=device)
        self.logits = torch.zeros(max_batch, vocab_size, dtype=dtype, device=device)
        self.tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(max_batch, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self._stage_idpos = torch.zeros(2, 3, max_batch, dtype=torch.int64, pin_memory=pin)
        self._stage_tables = torch.zeros(2, max_batch * table_width, dtype=torch.int32, pin_memory=pin)
        self._host_tokens = torch.zeros(2, max_batch, dtype=torch.int64, pin_memory=pin)
        self._host_logprobs = torch.zeros(2, max_batch, dtype=torch.float32, pin_memory=pin)
        self._slot = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size in `sizes`, largest first (smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        self.idpos[2].fill_(-1)
        for bs in reversed(self.sizes):
            # Warm up on a side stream (Triton compiles, cuBLAS picks kernels) as torch's graph docs ask.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._step(bs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._step(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode graphs (batch %s) in %.2f s", len(self.graphs), self.sizes, time.perf_counter() - t0
        )

    def _args(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.idpos[0, :bs], self.idpos[1, :bs], self.tables[:bs], self.logits[:bs]

    def _step(self, bs: int) -> None:
        """The captured step: gather `src` rows' ids from the last step's tokens, forward, greedy-sample every row."""
        ids, src = self.idpos[0, :bs], self.idpos[2, :bs]
        ids.copy_(torch.where(src >= 0, self.tokens.gather(0, src.clamp(min=0)), ids))
        self.forward(*self._args(bs))
        self.sampler(self.logits[:bs], self.tokens[:bs], self.logprobs[:bs])

    def padded(self, n: int) -> int:
        """The batch size a step of n rows runs at: the smallest size in `sizes` >= n, or n past the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else n

    @torch.inference_mode()
    def __call__(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        tables: torch.Tensor,
        src: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """ids/positions of n rows, their block-table rows (CPU int32 [n, width], width >= every row's blocks), and
        per row the previous step's row whose sampled token is this row's id (-1: `ids` has it) -> logits
        [n, vocab] (a view of the runner's buffer, valid until the next call). Launches without a host wait; the
        greedy samples of the rows are in `tokens`/`logprobs` (device), `read_back` brings them to the host."""
        n = len(ids)
        if n > self.max_batch:
            raise ValueError(f"decode batch of {n} rows exceeds max_batch={self.max_batch}")
        bs = self.padded(n)
        self._slot ^= 1
        stage = self._stage_idpos[self._slot]  # whole rows: a contiguous copy from pinned memory does not wait
        stage[:2, n:bs] = 0
        stage[2, n:bs] = -1
        stage[0, :n] = torch.tensor(ids, dtype=torch.int64)
        stage[1, :n] = torch.tensor(positions, dtype=torch.int64)
        stage[2, :n] = -1 if src is None else torch.tensor(src, dtype=torch.int64)
        width = tables.shape[1]
        host = self._stage_tables[self._slot, : bs * width].view(bs, width)
        host[:n] = tables
        host[n:] = self.scratch_block
        self.idpos.copy_(stage, non_blocking=True)
        self.tables[:bs, :width].copy_(host, non_blocking=True)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self._step(bs)
        return self.logits[:n]

    def set_samples(self, rows: torch.Tensor | None, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Replace the greedy samples of `rows` (all rows when None) by another sampler's (device tensors)."""
        if rows is None:
            self.tokens[: tokens.shape[0]].copy_(tokens)
            self.logprobs[: tokens.shape[0]].copy_(logprobs)
        else:
            self.tokens.index_copy_(0, rows, tokens)
            self.logprobs.index_copy_(0, rows, logprobs.to(torch.float32))

    def read_back(self, n: int) -> Pending:
        """Copy the samples of the first n rows to pinned host memory behind an event (no host wait here)."""
        tok, lp = self._host_tokens[self._slot], self._host_logprobs[self._slot]
        tok[:n].copy_(self.tokens[:n], non_blocking=True)
        lp[:n].copy_(self.logprobs[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Pending(event, tok, lp, n)
