"""Decode-only steps through persistent device buffers, replayed from CUDA graphs captured per padded batch size.

Stage: engine (`ModelRunner.run` hands a decode-only step of a dense model to `DecodeRunner`; sampling stays
outside, on the logits it returns).

How: the inputs of a decode step are token ids, positions and block-table rows. They are copied into fixed
buffers (ids/positions int64 [2, max_batch], block tables int32 [max_batch, max_blocks_per_seq]); everything else
(slots, context lengths, RoPE, the forward) is computed from them on the device by the captured `DecodeFn`, which
writes logits into a fixed [max_batch, vocab] buffer. A batch of n runs the graph of the smallest captured size
>= n (1, 2, 4, 8, then steps of 16 / 32 up to 256); rows past n are padding.

Invariants:
- Padding rows never touch real KV: their position is 0 and their block-table row starts with the scratch block
  (a block the allocator never hands out), so they write and read only that block's slot 0.
- Graphs read the model's parameters and the KV cache in place: weight updates by in-place `copy_` (weights.py)
  keep them valid; nothing may re-allocate a parameter or the cache after capture.
- Capture happens once, at construction (before any other thread uses the device); without graphs (CPU, or
  `EngineConfig.cuda_graphs=False`) the same buffers and padding are used eagerly.
- Only the rows' table columns that the step needs are copied in; stale columns past them are never read.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

log = logging.getLogger(__name__)

# (ids int64 [n], positions int64 [n], block_tables int32 [n, W], logits_out [n, vocab]) -> None
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

MAX_GRAPH_BATCH = 256


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, 16, 32, ..., 128 (steps of 16), 160, ..., 256 (steps of 32),
    capped at `max_batch` (which is itself included)."""
    sizes = [1, 2, 4, 8, *range(16, 129, 16), *range(160, MAX_GRAPH_BATCH + 1, 32)]
    cap = min(max_batch, MAX_GRAPH_BATCH)
    return sorted({s for s in sizes if s < cap} | {cap})


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
    ) -> None:
        self.forward = forward
        self.max_batch = max_batch
        self.scratch_block = scratch_block
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        self.idpos = torch.zeros(2, max_batch, dtype=torch.int64, device=device)
        self.tables = torch.full((max_batch, table_width), scratch_block, dtype=torch.int32, device=device)
        self.logits = torch.zeros(max_batch, vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if use_graphs:
            self.capture()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size in `sizes`, largest first (smaller ones reuse its memory pool)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):
            args = self._args(bs)
            # Warm up on a side stream (Triton compiles, cuBLAS picks kernels) as torch's graph docs ask.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.forward(*args)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.forward(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d decode graphs (batch %s) in %.2f s", len(self.graphs), self.sizes, time.perf_counter() - t0
        )

    def _args(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.idpos[0, :bs], self.idpos[1, :bs], self.tables[:bs], self.logits[:bs]

    def padded(self, n: int) -> int:
        """The batch size a step of n rows runs at: the smallest size in `sizes` >= n, or n past the largest."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else n

    @torch.inference_mode()
    def __call__(self, ids: Sequence[int], positions: Sequence[int], tables: torch.Tensor) -> torch.Tensor:
        """ids/positions of n rows, their block-table rows (CPU int32 [n, width], width >= every row's blocks)
        -> logits [n, vocab] (a view of the runner's buffer, valid until the next call)."""
        n = len(ids)
        if n > self.max_batch:
            raise ValueError(f"decode batch of {n} rows exceeds max_batch={self.max_batch}")
        bs = self.padded(n)
        pad = [0] * (bs - n)
        self.idpos[:, :bs].copy_(torch.tensor([[*ids, *pad], [*positions, *pad]], dtype=torch.int64))
        width = tables.shape[1]
        host = torch.full((bs, width), self.scratch_block, dtype=torch.int32)
        host[:n] = tables
        self.tables[:bs, :width].copy_(host)
        graph = self.graphs.get(bs)
        if graph is not None:
            graph.replay()
        else:
            self.forward(*self._args(bs))
        return self.logits[:n]
