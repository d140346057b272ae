"""Batched sampling: temperature, top-k, top-p, min-p, banned tokens, and batch-invariant seeded noise.

Stage: engine (the runner calls `sample` once per step on the rows that sample).

Invariants:
- Everything is vectorised over the batch; no Python loop over rows or tokens.
- A row's token depends only on its logits, its parameters, its seed and its output position: the random part is
  Gumbel-max noise from a counter-based integer hash of (seed, position, vocab index), so the same seeded request
  samples the same tokens alone or inside any batch, and a retracted request resamples identically.
  The hash is 32-bit arithmetic carried in int64 with 16-bit split multiplies (never overflows, same on CPU/GPU).
- Temperature 0 is greedy (argmax); top_k=1 is greedy too. Filters apply in SGLang's order: top-k, then top-p on the
  renormalised probabilities (the first token always stays), then min-p relative to the best token.
- The reported log-prob is log_softmax(logits in float32, temperature 1)[token], unaffected by filters or bans
  (SGLang reports the model's distribution, not the sampling one). In zero-KL mode the runner passes
  `models.invariant.log_softmax`, the function the trainer scores tokens with, so both report the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .types import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), without int64 overflow: split x into 16-bit halves."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + ((hi * (c & 0xFFFF)) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """u in (0, 1), float32 [S, vocab], a pure function of (seed, position, vocab index) per element."""
    dev = seeds.device
    seeds = seeds.to(torch.int64)
    hi, lo = (seeds >> 32) & _M32, seeds & _M32
    row = mix32(mix32(mix32(hi) ^ lo) ^ (positions.to(torch.int64) & _M32))
    row2 = mix32(row ^ 0x9E3779B9)
    col = mix32(torch.arange(vocab, device=dev, dtype=torch.int64) ^ 0x85EBCA6B)
    h = mix32((mix32(row[:, None] ^ col[None, :]) + row2[:, None]) & _M32)
    # 23 random bits + 0.5 is exact in float32; u never reaches 0 or 1.
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def seed_to_int64(seed: int) -> int:
    """Any Python int -> the int64 whose bits are seed mod 2^64 (what the noise hash reads)."""
    s = seed % (1 << 64)
    return s - (1 << 64) if s >= 1 << 63 else s


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device."""

    temperature: torch.Tensor  # f32 [S]; 0 = greedy
    top_k: torch.Tensor  # int64 [S]; vocab when off
    top_p: torch.Tensor  # f32 [S]
    min_p: torch.Tensor  # f32 [S]
    seeds: torch.Tensor  # int64 [S]
    positions: torch.Tensor  # int64 [S]: index of the output token being sampled
    ban_rows: torch.Tensor | None  # int64 [n]: (row, token) pairs masked to -inf (stop ids under min_new_tokens)
    ban_cols: torch.Tensor | None
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        positions: Sequence[int],
        bans: Sequence[Sequence[int]],
        vocab: int,
        device: torch.device,
    ) -> SamplingBatch:
        """`bans[i]`: token ids row i may not sample this step (empty for most rows)."""
        temps = [p.temperature for p in params]
        top_k = [vocab if p.top_k < 0 or p.top_k > vocab else p.top_k for p in params]
        rows = [i for i, b in enumerate(bans) for _ in b]
        cols = [t for b in bans for t in b]

        def t(values: Sequence[float | int], dtype: torch.dtype) -> torch.Tensor:
            host = torch.tensor(values, dtype=dtype)
            if torch.device(device).type != "cuda":
                return host.to(device)
            return host.pin_memory().to(device, non_blocking=True)  # no wait for the step in flight

        return cls(
            temperature=t(temps, torch.float32),
            top_k=t(top_k, torch.int64),
            top_p=t([p.top_p for p in params], torch.float32),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t([seed_to_int64(s) for s in seeds], torch.int64),
            positions=t(positions, torch.int64),
            ban_rows=t(rows, torch.int64) if rows else None,
            ban_cols=t(cols, torch.int64) if rows else None,
            all_greedy=all(x == 0 for x in temps),
            any_top_k=any(k < vocab for k, x in zip(top_k, temps) if x > 0),
            any_top_p=any(p.top_p < 1.0 and p.temperature > 0 for p in params),
            any_min_p=any(p.min_p > 0.0 and p.temperature > 0 for p in params),
        )


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    log_softmax: Callable[[torch.Tensor], torch.Tensor] = _log_softmax,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (token ids int64 [S], log-probs float32 [S] of those tokens at temperature 1).
    `log_softmax`: float32 [S, V] -> float32 log-probs over the last dim (the batch-invariant one in zero-KL mode)."""
    logits = logits.to(torch.float32)
    logprobs_all = log_softmax(logits)
    masked = logits
    if batch.ban_rows is not None:
        masked = logits.index_put((batch.ban_rows, batch.ban_cols), torch.tensor(float("-inf"), device=logits.device))
    greedy = masked.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy
    else:
        tokens = torch.where(batch.temperature == 0, greedy, _sample_stochastic(masked, batch))
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def _sample_stochastic(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    scaled = logits / temp[:, None]
    neg_inf = torch.tensor(float("-inf"), device=logits.device)
    if b.any_top_k or b.any_top_p:
        ordered, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[1], device=scaled.device)
        drop = ranks[None, :] >= b.top_k[:, None]
        if b.any_top_p:
            probs = torch.softmax(ordered.masked_fill(drop, neg_inf), dim=-1)
            # Keep a token while the mass before it is below top_p: the best token always stays.
            drop |= (probs.cumsum(dim=-1) - probs) > b.top_p[:, None]
        scaled = scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), neg_inf)
    if b.any_min_p:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < b.min_p[:, None] * probs.amax(dim=-1, keepdim=True), neg_inf)
    gumbel = -torch.log(-torch.log(uniform_noise(b.seeds, b.positions, scaled.shape[1])))
    return (scaled + gumbel).argmax(dim=-1)
