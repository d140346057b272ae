"""Model runner: turns a scheduled step into one packed forward, samples, and reads back log-probs.

Stage: engine (`Engine.step` calls `run` between `Scheduler.schedule` and `Scheduler.postprocess`).

Invariants:
- One forward per step: B = 1, the step's sequences concatenated, absolute positions (prefix + offset), the
  paged-attention backend built from per-step metadata tensors (slot mapping, block tables, context lengths,
  query start locations).
- The LM head runs only on the rows that are needed: the last row of each sampling sequence, plus the prompt
  rows owed input log-probs (`logits_indices`).
- MoE models always capture routing (cheap next to the experts) into the cache's slot-indexed routing store, so
  every cached block carries the expert ids of its tokens.
- One host sync per step for the results (`.tolist()`), none per token.
- Fused steps are launched without a host wait (`launch` -> `InFlight`, `collect` waits for its results): inputs
  are copied from pinned memory, sampling runs on the device (greedy inside the captured graph), results come back
  behind an event. A row whose input token the previous, still running, step sampled (`scheduler.PLACEHOLDER`)
  reads it on the device from that step's row, so the engine schedules step n + 1 while the device runs step n.
- On CUDA with Triton (`triton_kernels`): decode rows use the paged-decode kernel; a step of a dense model whose
  chunks are all decodes or short prefills (<= `fused_extend_tokens`, no input log-probs) goes to `DecodeRunner`
  (fused `DecodeForward`, replayed from a CUDA graph when `cuda_graphs`), which needs the cache's scratch block (one
  block past the allocator's) for its padding rows. A short prefill chunk becomes one row per token: every row
  writes its K/V before any row attends, and row j attends the cache up to its own position, which is causal
  attention over prefix + chunk. MoE models go there only with `fused_moe`, whose routed experts (SiLU) run as
  triton_moe's two grouped GEMMs (no host sync, `fused_experts`; not on a tensor-parallel engine); otherwise they
  stay eager (the torch experts read their counts on the host). MLA models (DeepSeek-V3, the DSA families) have a latent
  cache and attend through `LatentAttention` (latent_attention.py), the torch path, on every device. Hybrid models
  (Gated DeltaNet layers) carry each sequence's recurrent state in a slot per block-table row
  (recurrent_state.py) and run eagerly. DeepSeek-V4 and Inkling (families.FAMILY_MODULES, whose backbones run their
  own layers) keep a decode state per row (family_states.py) and run eagerly; a family module without one is
  recomputed: each step runs every scheduled sequence from its first token (`recomputes`), exact and O(length).
- Batch-invariant (zero-KL) mode (`batch_invariant`): the model was made invariant (`models.batch_invariant`), so
  no normal decode kernel or fused step runs (their GEMMs and reductions have batch-dependent shapes); every
  reported log-prob (sampled tokens and input log-probs) comes from `invariant.log_softmax` of its logits row, as
  the trainer computes it. On CUDA with the Triton invariant kernels, a dense model's decode-only steps (and short
  prefills as rows) go to `DecodeRunner` with `InvariantDecodeForward` (invariant_decode.py: the model's invariant
  forward, attention by `triton_invariant.paged_attention` through the block tables, captured when `cuda_graphs`);
  every other step is one eager forward with attention per sequence by `invariant.packed_attention`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from miles_hpc.models import CausalLM, invariant
from miles_hpc.models.families import logits_width

from . import invariant_decode
from .cuda_graphs import DecodeFn, DecodeRunner, Pending, Sampler
from .decode_forward import DecodeForward, unsupported_reason
from .family_states import FamilyStates, keeps_state
from .kv_cache import BlockManager, KVCache
from .latent_attention import LatentAttention
from .latent_cache import LatentCache
from .lora import AdapterSet
from .paged_attention import AttentionMetadata, DecodeKernel, PagedAttention
from .recurrent_state import RecurrentStates
from .sampling import SamplingBatch, sample
from .scheduler import PLACEHOLDER, Scheduled

if TYPE_CHECKING:
    from .tp import TPDriver

_LP_CHUNK_ROWS = 1024
log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepOutput:
    tokens: list[int | None]  # per scheduled sequence: the sampled token, None if it did not sample
    logprobs: list[float | None]
    input_logprobs: list[list[float] | None]  # per sequence: log-probs of prompt tokens a+1..b for lp_rows (a, b)


@dataclass(slots=True)
class StepInputs:
    """What one step's forward needs beyond the weights and the cache: the same on every tensor-parallel rank."""

    ids: list[int]  # the step's new tokens, sequences concatenated
    starts: list[int]  # per sequence: its first new token's position (tokens already cached before it)
    lens: list[int]  # per sequence: new tokens
    tables: torch.Tensor  # int, host: the sequences' block-table rows, as wide as the longest needs
    logits_indices: torch.Tensor  # int64, host: packed rows whose logits come back
    adapters: list[str | None]  # per packed row: the LoRA adapter, or None
    rows: list[int] = dataclasses.field(default_factory=list)  # per sequence: its block-table row (state slot)
    history: list[list[int]] | None = None  # recomputing families: per sequence, its tokens before `starts`


class StepExecutor:
    """One packed forward of the model over the paged cache (module docstring), from `StepInputs`: what a
    ModelRunner runs each eager step and what each other tensor-parallel rank runs on its shard (tp.py)."""

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache | LatentCache,
        block_size: int,
        device: torch.device,
        *,
        decode_kernel: DecodeKernel | None = None,
        loras: AdapterSet | None = None,
        batch_invariant: bool = False,
        states: RecurrentStates | None = None,
    ) -> None:
        self.model, self.cache, self.block_size, self.device = model, cache, block_size, device
        self.decode_kernel, self.loras, self.batch_invariant = decode_kernel, loras, batch_invariant
        self.is_moe = model.num_moe_layers > 0
        self.states = states  # hybrid models: the linear-attention layers' per-row state
        self.family = FamilyStates(model) if keeps_state(model) else None  # DeepSeek-V4, Inkling: their own caches
        self.recompute = recomputes(model)

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [len(logits_indices), vocab]; MoE routing of every new token goes into the cache's store."""
        if self.recompute:
            return self._recompute(inputs)
        meta = AttentionMetadata.build(
            inputs.starts,
            inputs.lens,
            inputs.tables.to(self.device, non_blocking=True),
            self.block_size,
            self.device,
            gather_decode=self.decode_kernel is None,
            batch_invariant=self.batch_invariant,
        )
        backend: PagedAttention | LatentAttention
        if isinstance(self.cache, LatentCache):
            backend = LatentAttention(self.cache, meta)
        else:
            backend = PagedAttention(self.cache, meta, self.decode_kernel)
        loras = self.loras.step(inputs.adapters) if self.loras is not None else contextlib.nullcontext()
        linear = None
        if self.states is not None:  # a sequence whose first new token is not its first continues from its row
            linear = self.states.backend(inputs.rows, [st > 0 for st in inputs.starts])
        family = None if self.family is None else self.family.for_step(inputs.rows, inputs.starts)
        with loras:
            out = self.model(
                torch.tensor(inputs.ids, dtype=torch.int64, device=self.device)[None],
                position_ids=meta.positions[None],
                cu_seqlens=meta.query_start_loc,
                return_routed_experts=self.is_moe,
                attn_backend=backend,
                logits_indices=inputs.logits_indices.to(self.device),
                linear_backend=linear,
                family_states=family,
            )
        if not self.is_moe:
            return out[0]
        logits, routed = out
        assert self.cache.routing is not None
        self.cache.routing.index_copy_(0, meta.slot_mapping, routed[0].to(self.cache.routing.dtype))
        return logits[0]

    def _recompute(self, inputs: StepInputs) -> torch.Tensor:
        """A family whose attention state the engine does not cache yet (`recomputes`): one packed forward over each
        sequence's whole token list (its history, then its new tokens), the new rows' logits and routing kept.
        Exact (the model's own forward), at O(length) work per new token."""
        assert inputs.history is not None, "a recomputing family's step needs each sequence's history"
        full: list[int] = []
        remap: list[int] = []  # new-token row -> its row in the packed full sequences
        cu = [0]
        for hist, st, n, q in zip(inputs.history, inputs.starts, inputs.lens, _offsets(inputs.lens), strict=True):
            new = inputs.ids[q : q + n]
            remap.extend(range(len(full) + st, len(full) + st + n))
            full.extend(hist[:st] + new)
            cu.append(len(full))
        rows = torch.tensor(remap, dtype=torch.int64)
        # A sequence's adapter on each of its rows, history included (`adapters` names it on each new-token row).
        firsts = [inputs.adapters[q] for q in _offsets(inputs.lens)]
        per_row = [a for a, lo, hi in zip(firsts, cu[:-1], cu[1:], strict=True) for _ in range(hi - lo)]
        loras = self.loras.step(per_row) if self.loras is not None else contextlib.nullcontext()
        with loras:
            out = self.model(
                torch.tensor(full, dtype=torch.int64, device=self.device)[None],
                cu_seqlens=torch.tensor(cu, dtype=torch.int32),
                return_routed_experts=self.is_moe,
                logits_indices=rows[inputs.logits_indices].to(self.device),
            )
        if not self.is_moe:
            return out[0]
        logits, routed = out
        assert self.cache.routing is not None
        meta = AttentionMetadata.build(
            inputs.starts, inputs.lens, inputs.tables.to(self.device), self.block_size, self.device
        )
        new = routed[0, rows.to(self.device)].to(self.cache.routing.dtype)
        self.cache.routing.index_copy_(0, meta.slot_mapping, new)
        return logits[0]


def recomputes(model: CausalLM) -> bool:
    """A family whose backbone runs its own layers (`families.FAMILY_MODULES`) and keeps no state between calls
    (no `new_state`, family_states.py): the engine recomputes each of its sequences every step."""
    return hasattr(model.model, "run") and not keeps_state(model)


def _offsets(lens: Sequence[int]) -> list[int]:
    out, o = [], 0
    for n in lens:
        out.append(o)
        o += n
    return out


@dataclass(slots=True)
class InFlight:
    """A launched fused step whose results are on their way (`ModelRunner.collect`)."""

    batch: list[Scheduled]
    sample_rows: list[int]  # per sampling sequence, in batch order: its row in the step
    row_of: dict[int, int]  # id(Req) -> its sampling row, for the next step's PLACEHOLDER inputs
    pending: Pending


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache | LatentCache,
        blocks: BlockManager,
        device: torch.device,
        *,
        triton_kernels: bool = False,
        cuda_graphs: bool = False,
        fused_extend_tokens: int = 0,
        loras: AdapterSet | None = None,
        batch_invariant: bool = False,
        tp: TPDriver | None = None,
        tuned_attention_tiles: bool = False,
        fused_moe: bool = False,
    ) -> None:
        """`triton_kernels` / `cuda_graphs` take effect on CUDA where Triton imports (EngineConfig's knobs).
        `loras`: the engine's LoRA adapters; a step with a request that names one runs eagerly (the hooks that
        apply adapters run in the model's own forward, not in the fused decode step).
        `batch_invariant`: zero-KL mode (module docstring); the caller has made `model` invariant.
        `tp`: rank 0 of a tensor-parallel engine (`model` is its shard): every step is eager, the other ranks run
        it too (tp.py), and the logits of the vocabulary-parallel head come back whole.
        `tuned_attention_tiles`, `fused_moe`: the EngineConfig knobs."""
        self.model, self.cache, self.bm, self.device = model, cache, blocks, device
        self.loras = loras
        self.fused_extend_tokens = fused_extend_tokens
        self.tp = tp
        self.vocab = logits_width(model.config) if tp is None else tp.vocab_size
        self.is_moe = model.num_moe_layers > 0
        self.decode_kernel: DecodeKernel | None = None
        self.decode: DecodeRunner | None = None  # decode-only steps; tests may inject a CPU one
        self.batch_invariant = batch_invariant
        self.fused_experts = 0  # MoE layers whose routed experts run as triton_moe's grouped GEMMs
        gpu = triton_kernels and device.type == "cuda" and _triton_available()
        if fused_moe and gpu and not batch_invariant and tp is None:
            from .triton_moe import install

            self.fused_experts = install(model)
        if batch_invariant and tp is None:
            self._invariant_decode(triton_kernels, cuda_graphs)
        elif tp is None and not hasattr(model.model, "run"):  # else eager (module docstring)
            self._gpu_decode(triton_kernels, cuda_graphs, tuned_attention_tiles)
        states = None
        if model.config.is_hybrid:  # a state slot per block-table row (recurrent_state.py)
            states = RecurrentStates(model, blocks.tables.shape[0], device)
        self.executor = StepExecutor(
            model,
            cache,
            blocks.block_size,
            device,
            decode_kernel=self.decode_kernel,
            loras=loras,
            batch_invariant=batch_invariant,
            states=states,
        )

    def _gpu_decode(self, triton_kernels: bool, cuda_graphs: bool, tuned_attention_tiles: bool) -> None:
        model, cache, blocks, device = self.model, self.cache, self.bm, self.device
        if not (triton_kernels and device.type == "cuda" and _triton_available()):
            return
        if not isinstance(cache, KVCache):  # MLA: a latent cache (latent_attention.py)
            log.info("MLA model: attention runs through the torch path over the latent cache (no Triton kernel)")
            return
        from .triton_ops import TritonDecodeOps

        ops = TritonDecodeOps(tuned_tiles=tuned_attention_tiles)
        self.decode_kernel = ops.attention
        reason = unsupported_reason(model)
        if reason is None and self.fused_experts < model.num_moe_layers:
            reason = "MoE layers whose experts are not fused (EngineConfig.fused_moe; the torch experts sync the host)"
        if reason is not None or cache.num_blocks <= blocks.num_blocks:
            log.info("decode steps run eagerly: %s", reason or "the KV cache has no scratch block")
            return
        # MoE blocks in a graph are the newest part of this path: should capture fail, the engine serves without.
        what = "the MoE model's" if model.num_moe_layers else None
        self._start_decode(DecodeForward(model, cache, ops), ops.greedy_sample, cuda_graphs, what)

    def _invariant_decode(self, triton_kernels: bool, cuda_graphs: bool) -> None:
        """Zero-KL mode: decode-only steps through `InvariantDecodeForward` (invariant_decode.py) where it can run."""
        if not (triton_kernels and self.device.type == "cuda" and _triton_available()):
            return
        reason = invariant_decode.unsupported_reason(self.model, self.cache)
        if reason is None and self.cache.num_blocks <= self.bm.num_blocks:
            reason = "the KV cache has no scratch block"
        if reason is not None:
            log.info("zero-KL decode steps run eagerly: %s", reason)
            return
        assert isinstance(self.cache, KVCache)  # unsupported_reason refuses the latent cache
        forward = invariant_decode.InvariantDecodeForward(self.model, self.cache)
        self._start_decode(forward, invariant_decode.greedy_sample, cuda_graphs, "zero-KL's")

    def _start_decode(self, forward: DecodeFn, sampler: Sampler, cuda_graphs: bool, fallback: str | None) -> None:
        """`self.decode` for `forward`, captured when `cuda_graphs`; with `fallback` (what to call the step in the
        warning), a capture that fails leaves the step uncaptured instead of stopping the engine."""
        try:
            self.decode = self._decode_runner(forward, sampler, use_graphs=cuda_graphs)
        except RuntimeError as e:
            if not (cuda_graphs and fallback):
                raise
            log.warning("could not capture %s decode step in CUDA graphs (%s): it runs without them", fallback, e)
            self.decode = self._decode_runner(forward, sampler, use_graphs=False)

    def _decode_runner(self, forward: DecodeFn, sampler: Sampler, *, use_graphs: bool) -> DecodeRunner:
        return DecodeRunner(
            forward,
            max_batch=self.bm.tables.shape[0],
            table_width=self.bm.tables.shape[1],
            vocab_size=self.vocab,
            scratch_block=self.bm.num_blocks,
            device=self.device,
            dtype=next(self.model.parameters()).dtype,
            use_graphs=use_graphs,
            sampler=sampler,
        )

    @torch.inference_mode()
    def run(self, batch: Sequence[Scheduled]) -> StepOutput:
        """Run one step and wait for its results."""
        fused = self.launch(batch, None)
        if fused is not None:
            return self.collect(fused)
        lp_counts = [0 if s.lp_rows is None else s.lp_rows[1] - s.lp_rows[0] for s in batch]
        n_lp = sum(lp_counts)
        logits = self._forward(batch)  # [n_lp + n_sample, vocab]: input log-prob rows, then sampling rows
        tokens, logprobs = self._sample(batch, logits[n_lp:])
        input_lps: list[list[float] | None] = [None] * len(batch)
        if n_lp:
            vals = self._input_logprobs(batch, logits[:n_lp])
            o = 0
            for i, c in enumerate(lp_counts):
                if c:
                    input_lps[i] = vals[o : o + c]
                    o += c
        return StepOutput(tokens, logprobs, input_lps)

    def _fits_rows(self, batch: Sequence[Scheduled], max_rows: int) -> bool:
        """Whether the step can run as rows of the fused decode step (see the module docstring)."""
        rows = 0
        for s in batch:
            if s.lp_rows is not None or (s.n > 1 and s.n > self.fused_extend_tokens):
                return False
            rows += s.n
        return rows <= max_rows

    @torch.inference_mode()
    def launch(self, batch: Sequence[Scheduled], prev: InFlight | None) -> InFlight | None:
        """Launch `batch` as rows of the fused decode step without waiting for it; None when it cannot run so (the
        caller then waits for `prev` and calls `run`). One row per new token at its absolute position, with its
        sequence's block-table row; each sampling sequence samples from its last row. `prev`: the step still in
        flight, whose sampled tokens are the PLACEHOLDER inputs of this one."""
        decode = self.decode
        if decode is None or any(s.r.req.lora_path is not None for s in batch):
            return None
        if not self._fits_rows(batch, decode.max_batch):
            return None
        ids: list[int] = []
        src: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        sample_rows: list[int] = []
        row_of: dict[int, int] = {}
        for s in batch:
            for tok in s.r.tokens[s.start : s.start + s.n]:
                if tok == PLACEHOLDER:
                    assert prev is not None, "a pending token without the step that samples it"
                    src.append(prev.row_of[id(s.r)])
                    ids.append(0)
                else:
                    src.append(-1)
                    ids.append(tok)
            positions.extend(range(s.start, s.start + s.n))
            rows.extend([s.r.row] * s.n)
            if s.sample:
                sample_rows.append(len(ids) - 1)
                row_of[id(s.r)] = len(ids) - 1
        width = -(-(max(positions) + 1) // self.bm.block_size)
        greedy = all(s.r.req.sampling.temperature == 0 and not self._bans(s) for s in batch if s.sample)
        sb = None if greedy else self._sampling_batch(batch)  # its copies go before the forward, not after it
        table = self.bm.tables[:, :width].index_select(0, torch.tensor(rows, dtype=torch.int64))
        logits = decode(ids, positions, table, src if prev is not None else None)
        if sb is not None:
            picked = None if len(sample_rows) == len(ids) else self._device_index(sample_rows)
            tok_t, lp_t = self._sample_rows(logits if picked is None else logits[picked], sb)
            decode.set_samples(picked, tok_t, lp_t)
        return InFlight(list(batch), sample_rows, row_of, decode.read_back(len(ids)))

    def collect(self, step: InFlight) -> StepOutput:
        """Wait for a launched step's samples: the token and log-prob of each sampling sequence."""
        toks, lps = step.pending.wait()
        tokens: list[int | None] = [None] * len(step.batch)
        logprobs: list[float | None] = [None] * len(step.batch)
        it = iter(step.sample_rows)
        for i, s in enumerate(step.batch):
            if s.sample:
                row = next(it)
                tokens[i], logprobs[i] = toks[row], lps[row]
        return StepOutput(tokens, logprobs, [None] * len(step.batch))

    @staticmethod
    def _bans(s: Scheduled) -> bool:
        r = s.r
        return bool(r.banned_early) and r.num_output < r.req.sampling.min_new_tokens

    def _device_index(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _forward(self, batch: Sequence[Scheduled]) -> torch.Tensor:
        ids: list[int] = []
        pieces: list[torch.Tensor] = []  # packed rows whose logits are needed
        sample_rows: list[int] = []
        q0 = 0
        for s in batch:
            ids.extend(s.r.tokens[s.start : s.start + s.n])
            if s.lp_rows is not None:
                pieces.append(torch.arange(q0 + s.lp_rows[0] - s.start, q0 + s.lp_rows[1] - s.start))
            if s.sample:
                sample_rows.append(q0 + s.n - 1)
            q0 += s.n
        pieces.append(torch.tensor(sample_rows, dtype=torch.int64))
        starts, lens = [s.start for s in batch], [s.n for s in batch]
        width = max(-(-(st + n) // self.bm.block_size) for st, n in zip(starts, lens))
        inputs = StepInputs(
            ids=ids,
            starts=starts,
            lens=lens,
            tables=self.bm.tables[torch.tensor([s.r.row for s in batch], dtype=torch.int64), :width],
            logits_indices=torch.cat(pieces),
            adapters=[s.r.req.lora_path for s in batch for _ in range(s.n)],  # per packed row
            rows=[s.r.row for s in batch],
            history=[s.r.tokens[: s.start] for s in batch] if self.executor.recompute else None,
        )
        if self.tp is not None:
            self.tp.step(inputs)  # the other ranks run the same forward on their shards (tp.py)
        return self.executor(inputs)

    def _sampling_batch(self, batch: Sequence[Scheduled]) -> SamplingBatch | None:
        reqs = [s.r for s in batch if s.sample]
        if not reqs:
            return None
        return SamplingBatch.build(
            [r.req.sampling for r in reqs],
            [r.seed for r in reqs],
            [r.num_output for r in reqs],  # the output index being sampled: the noise counter
            [r.banned_early if r.num_output < r.req.sampling.min_new_tokens else () for r in reqs],
            self.vocab,
            self.device,
        )

    def _sample(
        self, batch: Sequence[Scheduled], logits: torch.Tensor, sb: SamplingBatch | None = None
    ) -> tuple[list[int | None], list[float | None]]:
        """`sb`: the step's `_sampling_batch`, when built ahead (before an async forward, to overlap its copies)."""
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[float | None] = [None] * len(batch)
        idx = [i for i, s in enumerate(batch) if s.sample]
        if not idx:
            return tokens, logprobs
        batch_sb = sb if sb is not None else self._sampling_batch(batch)
        assert batch_sb is not None  # some row samples (idx is not empty)
        tok_t, lp_t = self._sample_rows(logits, batch_sb)
        for i, t, lp in zip(idx, tok_t.tolist(), lp_t.tolist()):
            tokens[i], logprobs[i] = t, lp
        return tokens, logprobs

    def _sample_rows(self, logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`sampling.sample`, with the trainer's log-softmax in zero-KL mode."""
        if self.batch_invariant:
            return sample(logits, sb, log_softmax=invariant.log_softmax)
        return sample(logits, sb)

    def _input_logprobs(self, batch: Sequence[Scheduled], logits: torch.Tensor) -> list[float]:
        """log_softmax(float32 logits)[next prompt token] for the lp rows, in row chunks so a long scored prompt
        with a large vocabulary never holds a full float32 copy of its logits."""
        target_ids: list[int] = []
        for s in batch:
            if s.lp_rows is not None:
                target_ids.extend(s.r.tokens[s.lp_rows[0] + 1 : s.lp_rows[1] + 1])
        targets = torch.tensor(target_ids, dtype=torch.int64, device=self.device)
        out = []
        for a in range(0, logits.shape[0], _LP_CHUNK_ROWS):
            chunk = logits[a : a + _LP_CHUNK_ROWS].to(torch.float32)
            if self.batch_invariant:  # the trainer's function, row by row the same bits
                lp = invariant.log_softmax(chunk)
                out.append(lp.gather(1, targets[a : a + _LP_CHUNK_ROWS, None]).squeeze(1))
                continue
            picked = chunk.gather(1, targets[a : a + _LP_CHUNK_ROWS, None]).squeeze(1)
            out.append(picked - torch.logsumexp(chunk, dim=-1))
        return torch.cat(out).tolist()


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None
