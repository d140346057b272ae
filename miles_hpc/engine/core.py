"""The engine core's public face: `Engine` (thread-safe) and `RequestError`.

Stage: engine. The HTTP server (server.py) is the only caller: it runs an asyncio loop in the main thread and calls
these methods; `start()` runs the step loop in a background thread. One step = scheduler.schedule() ->
runner.launch() (or run()) -> scheduler.commit() -> scheduler.postprocess(), under `_step_lock`; a fused step's
postprocess runs in the next call, after the step behind it is launched (`step`).

Threading invariants:
- `submit` never waits for a step: it validates, then queues into an inbox the next step drains.
- Control calls (`abort`, `pause`, `update_weights*`, `flush_cache`, `checksums`) run between steps: they hold the
  step lock, and the loop yields to a waiting control call, so they cannot starve.
- `on_done(result)` is called exactly once per accepted request, never while an engine lock is held: from the
  engine thread for requests that finish in a step, from the caller's thread for requests that `abort`/`pause`/
  `shutdown` end. The server wraps it with `loop.call_soon_threadsafe`, which is right in both cases.
- Weight versions: every output token is attributed to the version current when it was sampled
  (`GenerateResult.weight_versions` spans); `update_weights` takes effect from the next step.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch

from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors, load_pretrained, read_config
from miles_hpc.models.batch_invariant import make_batch_invariant
from miles_hpc.sync.wire.checksum import tensor_checksums

from .config import EngineConfig
from .kv_cache import BlockManager
from .latent_cache import geometry, make_cache
from .lora import AdapterSet
from .report import Counters, build_result, engine_stats, model_info, server_config
from .runner import InFlight, ModelRunner, StepOutput
from .scheduler import Req, Scheduled, Scheduler
from .tp import TPDriver, start_tp
from .types import FinishReason, GenerateRequest, GenerateResult
from .validate import Limits, RequestError, check_supported, validate_request
from .weights import apply_named, checksums, eos_token_ids, iter_checkpoint, piece_checksums, recording

__all__ = ["DoneCallback", "Engine", "PauseMode", "RequestError"]

log = logging.getLogger(__name__)
PauseMode = Literal["abort", "retract", "in_place"]
DoneCallback = Callable[[GenerateResult], None]


class Engine:
    """Continuous-batching inference engine over one `CausalLM` with a paged, prefix-cached KV cache."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, *, model_path: str | None = None, tp: TPDriver | None = None
    ) -> None:
        """Take ownership of `model` (moved/cast to config.device/dtype) and allocate the KV cache. `tp`: rank 0
        of a tensor-parallel engine, `model` its shard (`from_pretrained` makes both; tp.py)."""
        self.config = config
        self.device = torch.device(config.device)
        mc = model.config
        if (tp is None) != (config.tp_size == 1):
            raise ValueError(f"tp_size={config.tp_size}: a tensor-parallel engine is made by Engine.from_pretrained")
        self.tp = tp
        self._full_config = mc if tp is None else tp.shard.config
        check_supported(self._full_config, config)
        dtype = config.torch_dtype() or next(model.parameters()).dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        if config.batch_invariant:
            make_batch_invariant(self.model)  # refuses dynamic RoPE (ValueError)
        self.dtype = dtype
        self.model_path = model_path
        self.vocab_size = mc.vocab_size if tp is None else tp.vocab_size
        self.max_context_len = config.max_context_len or mc.max_position_embeddings
        self.num_moe_layers = model.num_moe_layers
        self.top_k = model.top_k
        self.eos_token_ids = eos_token_ids(mc.eos_token_id, model_path)

        num_blocks = self._allocate_cache(mc, dtype, tp)
        self.scheduler = Scheduler(
            self.blocks,
            max_running=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            enable_prefix_cache=config.enable_prefix_cache and not (mc.is_hybrid or mc.spec),  # *_state.py
        )
        self.loras = AdapterSet(self.model, self.device, dtype, max_loras=config.max_loras)
        self.runner = ModelRunner(
            self.model,
            self.cache,
            self.blocks,
            self.device,
            triton_kernels=config.triton_kernels,
            cuda_graphs=config.cuda_graphs,
            fused_extend_tokens=config.fused_extend_tokens,
            loras=self.loras,
            batch_invariant=config.batch_invariant,
            tp=tp,
            tuned_attention_tiles=config.tuned_attention_tiles,
            fused_moe=config.fused_moe,
        )
        self.limits = Limits(
            vocab_size=self.vocab_size,
            max_context_len=self.max_context_len,
            kv_capacity_tokens=num_blocks * config.block_size,
            num_moe_layers=self.num_moe_layers,
            model_type=mc.model_type,
            dsa=mc.is_dsa,
            records_indexer_topk=config.record_indexer_topk,
        )

        self._lock = threading.Lock()  # inbox, live rids, paused flag; held briefly, never across a step
        self._cond, self._step_lock = threading.Condition(self._lock), threading.RLock()  # step lock: one step or call
        self._inbox, self._live = list[Req](), set[str]()
        self._paused = False
        self._stop, self._control_waiting = False, 0
        self._thread: threading.Thread | None = None
        self._inflight: InFlight | None = None  # a launched step whose results are not postprocessed yet
        self._version = "0"
        self._half_updated = False  # see `resume`
        self.instance_id = secrets.token_hex(8)  # names this process's weights for direct writes (handles)
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self._counters = Counters()

    def _allocate_cache(self, mc: ModelConfig, dtype: torch.dtype, tp: TPDriver | None) -> int:
        """The KV cache (and, on a TP engine, the other ranks' of the same geometry) and its block allocator; the
        number of blocks the allocator hands out."""
        config, bs = self.config, self.config.block_size
        # MLA models cache the compressed latent (+ DSA indexer keys), the others per-head K/V (latent_cache.py).
        rec = config.record_indexer_topk  # DSA: each slot keeps its token's indexer selections too
        self.geometry = geometry(mc, dtype, self.num_moe_layers * self.top_k, record_indexer_topk=rec)
        num_blocks = config.num_blocks or self._auto_num_blocks()
        # One block more than the allocator hands out: the scratch block that padding rows of captured decode
        # batches write to (cuda_graphs.py), so they never touch a real request's KV.
        self.cache = make_cache(
            mc,
            num_blocks=num_blocks + 1,
            block_size=bs,
            dtype=dtype,
            device=self.device,
            num_moe_layers=self.num_moe_layers,
            top_k=self.top_k,
            record_indexer_topk=rec,
        )
        if tp is not None:
            tp.start_cache(num_blocks=num_blocks + 1, block_size=bs, record_indexer_topk=rec)
        self.blocks = BlockManager(
            num_blocks, bs, max_rows=config.max_running_requests, max_blocks_per_seq=-(-self.max_context_len // bs)
        )
        return num_blocks

    def _auto_num_blocks(self) -> int:
        if self.device.type != "cuda":
            return -(-self.config.max_total_tokens // self.config.block_size)
        free, _ = torch.cuda.mem_get_info(self.device)
        per_block = self.geometry.bytes_per_token * self.config.block_size
        return max(1, int(free * self.config.kv_cache_fraction) // per_block)

    @classmethod
    def from_pretrained(cls, path: str, config: EngineConfig) -> Engine:
        """Load an HF-format checkpoint directory (config.json + safetensors [+ generation_config.json])."""
        check_supported(read_config(path), config)  # before the (maybe long) load
        if config.tp_size > 1:
            model, driver = start_tp(str(path), config)
            return cls(model, config, model_path=str(path), tp=driver)
        model = load_pretrained(path, dtype=config.torch_dtype(), device=config.device)
        return cls(model, config, model_path=str(path))

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the background step-loop thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop thread (after the step in flight) and abort every request left (on_done is called)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self.abort(None, message="engine shut down")
        if self.tp is not None:
            self.tp.shutdown()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (
                    self._paused
                    or self._control_waiting
                    or not (self._inbox or self._inflight or self.scheduler.has_work())
                ):
                    self._cond.wait()
                if self._stop:
                    return
            try:
                progressed = self.step()
            except Exception as e:  # a bug or OOM in a step must not leave clients hanging forever
                log.exception("engine step failed; failing all requests")
                with self._step_lock:  # a step left in flight is lost with it: collecting it again may raise again
                    self._inflight = None
                self.abort(None, message=f"engine step failed: {type(e).__name__}: {e}", failed=True)
                continue
            if not progressed:
                with self._cond:
                    self._cond.wait(timeout=0.01)

    def step(self) -> bool:
        """Run one scheduler step; False when paused or there was nothing to do. Tests call it without `start`.

        Overlap: a fused step is launched and left in flight; the next call schedules and launches the step after
        it (its pending inputs read on the device), then waits for the first one's results and postprocesses them,
        so the host's work for step n + 1 runs while the device computes step n. A step that cannot be launched so
        (eager path) waits for the one in flight first. Control calls finish the step in flight before they act."""
        with self._step_lock:
            if not self._drain_inbox():
                return False
            prev, self._inflight = self._inflight, None
            batch = self.scheduler.schedule()
            if not batch and prev is None:
                return False
            fused = self.runner.launch(batch, prev) if batch else None
            results = []
            if fused is not None:
                self.scheduler.commit(batch)
                self._inflight = fused
                if prev is not None:
                    results = self._postprocess(prev.batch, self.runner.collect(prev))
            else:
                if prev is not None:
                    results = self._postprocess(prev.batch, self.runner.collect(prev))
                    batch = [s for s in batch if s.r.finish is None]
                if batch:
                    out = self.runner.run(batch)
                    self.scheduler.commit(batch)
                    results += self._postprocess(batch, out)
        _deliver(results)
        return True

    def _postprocess(self, batch: list[Scheduled], out: StepOutput) -> list[tuple[GenerateResult, DoneCallback]]:
        finished, added = self.scheduler.postprocess(
            batch, out.tokens, out.logprobs, out.input_logprobs, self._version, self.eos_token_ids
        )
        self._counters.record_step(added)
        return [self._finish(r) for r in finished]

    def _finish_inflight(self) -> list[tuple[GenerateResult, DoneCallback]]:
        """Wait for the step in flight (if any) and postprocess it (step lock held)."""
        prev, self._inflight = self._inflight, None
        return [] if prev is None else self._postprocess(prev.batch, self.runner.collect(prev))

    def _drain_inbox(self) -> bool:
        """Move submitted requests into the scheduler (step lock held); False when paused."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            paused = self._paused
        for r in inbox:
            self.scheduler.add(r)
        return not paused

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the step lock with no step in flight (the one in flight is finished first; its finished requests
        are delivered after the lock is released)."""
        with self._cond:
            self._control_waiting += 1
        done: list[tuple[GenerateResult, DoneCallback]] = []
        try:
            with self._step_lock:
                done = self._finish_inflight()
                yield
        finally:
            with self._cond:
                self._control_waiting -= 1
                self._cond.notify_all()
            _deliver(done)

    # ---------------------------------------------------------------- requests
    def submit(self, req: GenerateRequest, on_done: DoneCallback) -> None:
        """Validate and queue `req`; raises RequestError (nothing queued) when invalid or `rid` is live.

        Accepted while paused (it waits). `on_done` gets the `GenerateResult` once.
        """
        validate_request(req, self.limits)
        if req.lora_path is not None and req.lora_path not in self.loras:
            raise RequestError(
                f"LoRA adapter {req.lora_path!r} is not loaded (loaded: {sorted(self.loras.adapters)}; "
                "POST /load_lora_adapter first)"
            )
        sp = req.sampling
        prompt = list(req.input_ids)
        early = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        r = Req(
            req=req,
            on_done=on_done,
            seed=0,
            t_submit=time.monotonic(),
            tokens=prompt,
            prompt_len=len(prompt),
            banned_early=tuple(sorted(early)),
            stop_ids=frozenset(sp.stop_token_ids),
            namespace=None if req.lora_path is None else b"lora\0" + req.lora_path.encode(),
        )
        k = req.logprob_start_len
        if req.return_logprob and k >= 0:
            r.input_logprobs = [None] * len(prompt)
            # Row p's logits give the log-prob of prompt token p + 1: rows k.. (token k's stays None, as SGLang's)
            r.lp_next = k if k <= len(prompt) - 2 else None
        with self._cond:
            if req.rid in self._live:
                raise RequestError(f"rid {req.rid!r} is already in flight")
            # Unseeded requests get a seed from the engine's generator: reproducible per engine seed and order.
            seed = sp.sampling_seed
            r.seed = seed if seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
            self._live.add(req.rid)
            self._inbox.append(r)
            if req.log_metrics:  # False: SGLang's /health_generate probe, which no request counter sees
                self._counters.record_request(len(prompt))
            self._cond.notify_all()

    def abort(self, rid: str | None, *, message: str | None = None, failed: bool = False) -> int:
        """Abort one request (`rid`) or all (None): FinishReason("abort") and the tokens so far (`failed`: a step
        raised, the results carry `message` as an error: a 500, not an output). Returns how many (0: unknown rid)."""
        with self._between_steps():
            self._drain_inbox()
            taken = self.scheduler.remove(rid)
            msg = message or ("aborted by request" if rid is not None else "all requests aborted")
            for r in taken:
                r.finish = FinishReason(type="abort", message=msg)
            results = [self._finish(r) for r in taken]
        for result, _ in results if failed else ():
            result.error = msg
        _deliver(results)
        return len(results)

    def pause(self, mode: PauseMode) -> None:
        """Stop stepping, SGLang's `/pause_generation`: "abort" aborts everything; "retract" frees the KV of running
        requests and requeues them (recomputed after resume); "in_place" keeps everything. Returns once no step
        is in flight. Pausing again changes nothing but applies the mode's action."""
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        with self._between_steps():
            with self._cond:
                self._paused = True
            if mode == "retract":
                self.scheduler.retract_all()
        if mode == "abort":
            self.abort(None, message="aborted by pause_generation")

    def resume(self) -> None:
        """Continue stepping (`/continue_generation`). Refused (RequestError) while the weights are half-updated:
        a multi-part update started while paused (parts without a `weight_version`) and its versioned last part
        never came (the trainer died mid-update). Such an engine serves nothing until an update with a version,
        `/update_weight_version`, or a whole checkpoint from disk makes its weights consistent again."""
        if self._half_updated:
            raise RequestError(
                f"weights are half-updated (an update begun after version {self._version} never finished); "
                "finish the update or reload weights from disk before continuing generation"
            )
        self._abort_orphans()
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # ---------------------------------------------------------------- weights
    def update_weights(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str | None,
        flush_cache: bool = True,
        apply: Callable[[CausalLM, Iterable[tuple[str, torch.Tensor]]], list[str]] | None = None,
    ) -> list[str]:
        """Copy HF-named tensors into the model (cast to the engine dtype/device); returns the names applied.

        Unknown name or wrong shape -> RequestError naming the tensor; tensors before it stay applied, that one is
        untouched. Runs between steps (waits for the one in flight). `flush_cache` drops the prefix cache so
        KV computed with the old weights is never reused by a new request (also when a bad tensor stopped the
        update part-way); `version` sets `weight_version` once every tensor is applied.
        """
        with self._between_steps():
            started: list[str] = []
            try:
                if self._paused and version is None:
                    self._half_updated = True  # a bucket of a multi-part update: committed by a versioned one
                # TP: whole tensors go to every rank (tp.apply); an `apply` given: the others have theirs already
                if apply is None:
                    apply = apply_named if self.tp is None else self.tp.apply
                applied = apply(self.model, recording(named, started))
            finally:
                if flush_cache and started:
                    self.blocks.flush()
            if version is not None:
                self._version = str(version)
                self._half_updated = False
        return applied

    def update_weights_from_group(
        self,
        receive: Callable[[], list[tuple[str, torch.Tensor]]],
        *,
        version: str | None,
        flush_cache: bool = True,
        parts: bool = False,
    ) -> list[str]:
        """`update_weights` of the bucket `receive()` takes from a weight-update group (`/update_weights_from_
        distributed`). A tensor-parallel engine receives between steps (its other ranks receive the same
        broadcasts and keep their parts, tp.py), so no step runs on half-updated ranks; rank 0 keeps its part.
        `parts`: `receive()` gave rank 0's parts (the resharded p2p), not whole tensors."""
        if self.tp is None:
            return self.update_weights(receive(), version=version, flush_cache=flush_cache)
        with self._between_steps():
            named = receive()
            apply = self.tp.shard.apply_parts if parts else self.tp.shard.apply
            return self.update_weights(named, version=version, flush_cache=flush_cache, apply=apply)

    def update_weights_from_disk(self, path: str, *, version: str | None, flush_cache: bool = True) -> None:
        """Load every tensor of the HF checkpoint at `path` (same architecture) via `update_weights`.
        The checkpoint's names and shapes are all checked before any tensor is applied."""
        full = self.model if self.tp is None else self.tp.shard.full_meta  # names and whole shapes
        self.update_weights(iter_checkpoint(full, path), version=version, flush_cache=flush_cache)
        self.model_path = str(path)
        self._half_updated = False  # every tensor of a whole checkpoint: consistent weights again

    # ---------------------------------------------------------------- LoRA adapters
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (replacing one of that name: generation must then be paused,
        as a weight update's). The prefix cache is flushed: KV computed under the old adapter is never reused."""
        if self.tp is not None:
            raise RequestError(f"LoRA adapters are not served by tensor-parallel engines (tp_size={self.tp.tp_size})")
        with self._between_steps():
            if name in self.loras and not self._paused and self._uses(name):
                raise RequestError(
                    f"LoRA adapter {name!r} is in use by running requests: pause generation before replacing it"
                )
            try:
                self.loras.load(name, path)
            except (OSError, ValueError, KeyError) as e:
                raise RequestError(f"cannot load LoRA adapter {name!r}: {e}") from None
            self.blocks.flush()

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name`. Refused while requests use it, unless paused (an adapter update: unload, then load
        the new one; requests still naming a missing adapter when generation continues are aborted)."""
        with self._between_steps():
            if not self._paused and self._uses(name):
                raise RequestError(f"LoRA adapter {name!r} is in use by requests in flight")
            try:
                self.loras.unload(name)
            except KeyError as e:
                raise RequestError(str(e.args[0])) from None
            self.blocks.flush()

    def lora_checksums(self, name: str) -> dict[str, str]:
        with self._between_steps():
            try:
                return self.loras.checksums(name)
            except KeyError as e:
                raise RequestError(str(e.args[0])) from None

    def _uses(self, name: str) -> bool:
        self._drain_inbox()
        return any(r.req.lora_path == name for r in (*self.scheduler.running, *self.scheduler.waiting))

    def _abort_orphans(self) -> None:
        """Abort the requests whose LoRA adapter is no longer loaded (unloaded during a pause)."""
        with self._between_steps():
            self._drain_inbox()
            gone = [
                r
                for r in (*self.scheduler.running, *self.scheduler.waiting)
                if r.req.lora_path is not None and r.req.lora_path not in self.loras
            ]
            results = []
            for r in gone:
                self.scheduler.remove(r.rid)
                r.finish = FinishReason(type="abort", message=f"LoRA adapter {r.req.lora_path!r} was unloaded")
                results.append(self._finish(r))
        _deliver(results)

    def checksums(self) -> dict[str, str]:
        """HF name -> `sync.wire.checksum.tensor_checksum` of the engine's tensor (Hub per-expert layout for MoE)."""
        with self._between_steps():
            if self.tp is not None:  # every rank's part, assembled (tp.py)
                return tensor_checksums(self.tp.gather(self.model))
            return checksums(self.model)

    def whole_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """HF name -> the whole tensor the engine holds now, for each of `names` the model has (Hub per-expert
        layout; a tensor-parallel engine's ranks' parts assembled on the CPU, tp.py; TP 1: copies)."""
        with self._between_steps():
            if self.tp is not None:
                return dict(self.tp.gather(self.model, names))
            keep = set(names)
            return {n: t.detach().clone() for n, t in iter_hf_tensors(self.model) if n in keep}

    def piece_checksums(self, boxes: dict[str, list[list[int]]]) -> dict[str, str]:
        """`sync.wire.checksum.piece_key` -> checksum of each box (``[lo0, hi0, lo1, hi1, ...]``) of each HF tensor."""
        with self._between_steps():
            if self.tp is not None:
                return piece_checksums(self.model, boxes, tensors=dict(self.tp.gather(self.model)))
            return piece_checksums(self.model, boxes)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; False (and nothing flushed) while requests are running or waiting, as SGLang."""
        with self._between_steps():
            with self._lock:
                busy = bool(self._live)
            if busy:
                return False
            self.blocks.flush()
            return True

    @property
    def weight_version(self) -> str:
        return self._version

    @property
    def half_updated(self) -> bool:
        return self._half_updated

    def set_weight_version(self, version: str) -> None:
        """Name the current weights (`/update_weight_version`); tokens sampled from the next step carry it."""
        with self._between_steps():
            self._version = str(version)
            self._half_updated = False  # the caller declares the current weights complete

    # ---------------------------------------------------------------- direct weight writes (colocated, CUDA)
    def begin_direct_write(self) -> str:
        """A colocated trainer is about to write new weights straight into this engine's parameters through the
        CUDA IPC handles of `/weights_ipc_handles` (engine/direct_weights.py). Refused unless generation is paused
        and the engine is on a GPU; until `commit_direct_write` the weights count as half-updated (`resume` is
        refused), so a trainer that dies mid-write leaves no engine serving mixed weights. Returns `instance_id`:
        handles opened from another instance (a restarted engine) are stale."""
        with self._between_steps():
            if self.device.type != "cuda":
                raise RequestError(f"direct weight writes need an engine on a GPU (this one runs on {self.device})")
            if self.tp is not None:
                raise RequestError("direct weight writes go to engines of tp_size 1 (this one is tensor-parallel)")
            if not self._paused:
                raise RequestError("pause generation (POST /pause_generation) before a direct weight write")
            self._half_updated = True
        return self.instance_id

    def commit_direct_write(self, *, version: str | None, flush_cache: bool = True) -> None:
        """The trainer wrote every tensor (and synchronised its stream): flush the prefix cache (KV of the old
        weights), name the weights `version`, and count them complete again."""
        with self._between_steps():
            if not self._paused:
                raise RequestError("a direct weight write is committed while generation is paused")
            torch.cuda.synchronize(self.device)
            if flush_cache:
                self.blocks.flush()
            if version is not None:
                self._version = str(version)
            self._half_updated = False

    # ---------------------------------------------------------------- results
    def _finish(self, r: Req) -> tuple[GenerateResult, DoneCallback]:
        """Build the result of a request leaving the scheduler (step lock held), then release its blocks."""
        result = build_result(r, self.cache, self.blocks.block_size, self._version)
        self.scheduler.free(r)
        with self._lock:
            self._live.discard(r.rid)
        return result, r.on_done

    # ---------------------------------------------------------------- info
    def stats(self) -> dict[str, float | int]:
        """Gauges and counters for /metrics and /get_server_info: num_running_reqs, num_queue_reqs, paused,
        num_requests_total, prompt_tokens_total, generation_tokens_total, num_steps_total, cached_tokens_total,
        cache_hit_rate, gen_throughput (tokens/s), kv_blocks_used/cached/total, token_usage, num_retractions_total."""
        queued = len(self._inbox)  # one read of a list's length: no lock needed
        return engine_stats(self.scheduler, self.blocks, self._counters, queued=queued, paused=self._paused)

    def model_info(self) -> dict[str, object]:  # for /get_model_info
        return model_info(self)

    def server_info(self) -> dict[str, object]:
        """For /get_server_info: the EngineConfig, model_info(), the resolved KV geometry and stats()."""
        return {**server_config(self), **self.model_info(), **self.stats()}


def _deliver(results: list[tuple[GenerateResult, DoneCallback]]) -> None:
    for result, cb in results:
        try:
            cb(result)
        except Exception:  # a broken callback must not take the engine down
            log.exception("on_done callback for %s raised", result.rid)
