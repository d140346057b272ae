"""FSDP2 training backend (stage: train; DESIGN section 5): `FSDPTrainer` implements the `Trainer` protocol.

Topology: one process per device, all in the default process group (:mod:`miles_hpc.train.dist`); every rank
receives the WHOLE `TrainBatch` from the controller. Parameters are sharded with `fully_shard` per decoder layer
and at the root (a world of 1: the root alone); optimizer state is sharded with them (AdamW over DTensors).

How a step is split (all plans are pure functions of the batch, so ranks agree without talking, see packing.py):
  batch -> `updates_per_step` contiguous mini-batches (one optimizer step each)
        -> each mini-batch's samples over ranks, balanced by tokens
        -> each rank's samples into packed micro-batches of <= `max_tokens_per_microbatch` tokens (no padding).
A rank with fewer micro-batches than the busiest rank runs one-token dummy micro-batches (zero loss), so FSDP's
all-gathers and reduce-scatters stay matched.

Invariants:
- Loss normalisation is global: `policy_loss` gets the masked-token and sequence counts of the whole mini-batch
  (computed from the full batch every rank holds: no collective needed), so micro-batch losses summed over
  micro-batches AND ranks are the mini-batch loss. FSDP averages gradients over ranks; we multiply each
  micro-batch loss by world_size so the reduced gradient is the gradient of that sum. A world of 1 and of N give
  the same update (a test checks it).
- `old_logprobs` of the PPO ratio are the trainer's own, computed by `train_step` in a no-grad pass over the same
  micro-batches before the first update of the step (one extra forward; the loop passes nothing). With
  `updates_per_step == 1` the ratio is exactly 1 at the update.
- TITO: `train_step` re-hashes every sample's tokens on every rank and raises before any collective on mismatch.
- Master weights are float32; with `mixed_precision` on a GPU, compute is bf16 and gradient reduction fp32.
- `train.compile` (GPU) compiles each decoder layer in place before sharding; attention stays eager (attention.py).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.models import CausalLM, iter_hf_tensors, load_pretrained
from miles_hpc.sync.checksum import tensor_checksum
from miles_hpc.train import checkpoint as ckpt
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.dist import all_reduce_floats
from miles_hpc.train.logprobs import PackedMicroBatch, dummy_microbatch, pack_samples, token_logprobs
from miles_hpc.train.losses import policy_loss
from miles_hpc.train.optim import build_optimizer, build_scheduler
from miles_hpc.train.packing import pack_microbatches, split_across_ranks, split_minibatches
from miles_hpc.train.shards import ShardMap, shard_map

__all__ = ["FSDPTrainer", "LossFn"]

LossFn = Callable[..., tuple[torch.Tensor, Mapping[str, float]]]
# A micro-batch's metrics waiting for the host: (micro-batch, loss, entropy, loss stats, train log-probs if mismatch)
_Pending = tuple[PackedMicroBatch, torch.Tensor, torch.Tensor, Mapping[str, float], torch.Tensor | None]
# policy_loss metrics that are micro-batch means over masked tokens (averaged with token weights across
# micro-batches and ranks); pg_loss is globally normalised (summed); ratio_max is a max.
_SUMMED = ("pg_loss",)
_MAXED = ("ratio_max",)


class FSDPTrainer:
    """One rank of the FSDP2 trainer. Construct on every rank after `init_trainer_world`; all methods are
    collectives (see `miles_hpc.train.protocol.Trainer`)."""

    def __init__(
        self,
        model_path: str | Path,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        *,
        device: str | torch.device,
        seed: int,
        total_steps: int | None = None,
        loss_fn: LossFn = policy_loss,
    ) -> None:
        """total_steps: optimizer steps of the whole run (needed by the cosine schedule).
        loss_fn: a function with `policy_loss`'s signature (the default); a plug-in point for custom losses."""
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs the trainer process group: call dist.init_trainer_world first")
        self.train_cfg, self.algo_cfg, self.loss_fn = train_cfg, algo_cfg, loss_fn
        self.device = torch.device(device)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._step = 0
        self._last_lr = train_cfg.lr
        self._r3: torch.Tensor | None = None  # R3 stats of the training forwards of this step (see _forward)
        torch.manual_seed(seed)
        # Full fp32 copy per rank before sharding: simple, fine up to a few B params per host.
        # TODO(scale): meta-device init + rank-0 load + broadcast (or DCP) for models larger than host memory.
        model = load_pretrained(model_path, dtype=torch.float32, device=self.device)
        self.config = model.config
        model.train()
        if train_cfg.activation_checkpointing:
            for layer in model.model.layers:
                _checkpoint_forward(layer)
        mp = None
        if train_cfg.mixed_precision and self.device.type == "cuda":
            # Gradients are reduced in fp32 across ranks; a world of 1 reduces nothing, and the bf16 gradient
            # becomes the fp32 sharded one exactly either way, so it skips the fp32 staging copy.
            reduce_dtype = torch.float32 if self._world > 1 else None
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        if train_cfg.compile and self.device.type == "cuda":
            for layer in model.model.layers:
                layer.compile()  # in place: parameter names (and so checkpoints and sync) are unchanged
        mesh = init_device_mesh(self.device.type, (self._world,))
        kw: dict[str, Any] = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        # With more than one rank, each decoder layer is its own FSDP unit: it is gathered just before its forward
        # and freed after it (re-gathered in backward), so only one layer is ever whole. With one rank nothing is
        # sharded, so per-layer units save no memory and cost host time (two hooks per layer per step, which leave
        # the GPU idle): the root is the only unit. The root's parameters (embedding, final norm, LM head) are
        # needed first in backward: kept.
        if self._world > 1:
            for layer in model.model.layers:
                fully_shard(layer, reshard_after_forward=True, **kw)
        fully_shard(model, reshard_after_forward=False, **kw)
        self.model: CausalLM = model
        self.optimizer = build_optimizer(train_cfg, model.named_parameters(), self.device)
        self.scheduler = build_scheduler(train_cfg, self.optimizer, total_steps)

    # ------------------------------------------------------------------ protocol properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def step(self) -> int:
        return self._step

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ planning
    def _plan(self, batch: TrainBatch, indices: list[int]) -> list[list[int]]:
        """This rank's micro-batches (lists of sample ids) for the samples `indices`, padded with [] (dummy) to
        the busiest rank's count."""
        lengths = [len(t) for t in batch.tokens]
        per_rank = split_across_ranks(indices, lengths, self._world)
        plans = [pack_microbatches(p, lengths, self.train_cfg.max_tokens_per_microbatch) for p in per_rank]
        n = max(len(p) for p in plans)
        mine = plans[self._rank]
        return mine + [[] for _ in range(n - len(mine))]

    def _microbatch(self, batch: TrainBatch, ids: list[int]) -> PackedMicroBatch:
        return pack_samples(batch, ids, self.device) if ids else dummy_microbatch(self.device)

    def _forward(
        self, mb: PackedMicroBatch, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of one micro-batch. With routing records (R3) the MoE layers replay them when
        `algo.routing_replay`, else only compare; `self._r3` then holds the step's replay stats (device)."""
        kw: dict[str, Any] = {}
        if mb.routing is not None:
            kw = {"routing_replay": mb.routing, "routing_compare": not self.algo_cfg.routing_replay}
        logits = self.model(mb.input_ids, position_ids=mb.position_ids, cu_seqlens=mb.cu_seqlens, **kw)
        if kw:
            stats = self.model.replay_stats()
            self._r3 = stats if self._r3 is None else self._r3 + stats
        return token_logprobs(logits, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)

    # ------------------------------------------------------------------ Trainer verbs
    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        mine: dict[int, list[float]] = {}
        for ids in self._plan(batch, list(range(len(batch)))):
            mb = self._microbatch(batch, ids)
            lp, _ = self._forward(mb, with_entropy=False)
            if not mb.is_dummy:
                mine.update(zip(mb.sample_ids, (x.tolist() for x in mb.split(lp.cpu()))))
        gathered: list[dict[int, list[float]]] = [mine]
        if self._world > 1:
            gathered = [{} for _ in range(self._world)] if self._rank == 0 else []
            dist.gather_object(mine, gathered if self._rank == 0 else None, dst=0)
        if self._rank != 0:
            return []
        merged = {k: v for part in gathered for k, v in part.items()}
        return [merged[i] for i in range(len(batch))]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        check_token_hashes(batch)
        minibatches = split_minibatches(len(batch), self.train_cfg.updates_per_step)
        plans = [self._plan(batch, mini) for mini in minibatches]
        want_entropy = self.algo_cfg.entropy_coef != 0.0
        acc = _Metrics()
        grad_norms: list[torch.Tensor] = []

        # Pass 1 (no grad): old log-probs under the weights before any update of this step; mismatch vs rollout.
        # With one update per step nothing has changed when pass 2 runs its forward, so its detached log-probs ARE
        # the old ones (ratio exactly 1): skip the extra forward, a third of the step's compute.
        single_update = len(minibatches) == 1
        old: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for plan in plans if not single_update else ():
                for ids in plan:
                    mb = self._microbatch(batch, ids)
                    lp, _ = self._forward(mb, with_entropy=False)
                    if mb.is_dummy:
                        continue
                    old.update(zip(mb.sample_ids, mb.split(lp)))
                    _add_mismatch(acc, lp, mb)

        # Pass 2: one optimizer step per mini-batch. Metrics stay on the device until the optimizer step has been
        # launched, then come to the host: no device sync leaves the GPU idle while the host catches up.
        self._r3 = None  # R3 stats from the training forwards only
        for mini, plan in zip(minibatches, plans):
            total_tokens, num_seqs = _global_counts(batch, mini)
            pending: list[_Pending] = []
            for ids in plan:
                mb = self._microbatch(batch, ids)
                lp, ent = self._forward(mb, with_entropy=True, entropy_grad=want_entropy)
                if mb.is_dummy:
                    # Keeps the graph connected to every sharded parameter, so backward's reduce-scatter runs.
                    loss = lp.sum() * 0.0 + (ent.sum() * 0.0 if ent is not None else 0.0)
                    (loss * self._world).backward()
                    continue
                old_lp = lp.detach() if single_update else torch.cat([old[i] for i in mb.sample_ids])
                loss, stats = self.loss_fn(
                    lp, old_lp, mb.advantages, mb.loss_mask, mb.seq_ids, self.algo_cfg,
                    rollout_logprobs=mb.rollout_logprobs, ref_logprobs=mb.ref_logprobs,
                    entropy=ent if want_entropy else None, num_seqs=num_seqs, total_tokens=total_tokens,
                )  # fmt: skip
                (loss * self._world).backward()
                assert ent is not None
                pending.append((mb, loss.detach(), ent.detach(), stats, old_lp if single_update else None))
            grad_norms.append(self._clip_and_step())
            for mb, loss, ent, stats, train_lp in pending:
                _record(acc, mb, loss, ent, stats, train_lp)
        if self._r3 is not None:
            for key, v in zip(("r3/recorded", "r3/agree", "r3/tokens"), self._r3.tolist()):
                acc.add_sum(key, float(v))
        metrics = self._reduce_metrics(acc, batch, len(minibatches))
        metrics["grad_norm"] = float(torch.stack(grad_norms).mean())  # already global: identical on every rank
        return metrics

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the global grad norm, step AdamW and the schedule; returns the pre-clip norm as a device scalar
        (identical on every rank)."""
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        norm = clip_sharded_grads_(self.model.parameters(), max_norm)
        self._last_lr = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._step += 1
        return norm.detach().float()

    def _reduce_metrics(self, acc: _Metrics, batch: TrainBatch, num_updates: int) -> dict[str, float]:
        sums, maxes = acc.reduce(self.device)
        loss_tokens = max(sums.pop("loss_tokens", 0.0), 1.0)
        out: dict[str, float] = {
            "loss": sums.pop("loss", 0.0) / num_updates,
            "pg_loss": sums.pop("pg_loss", 0.0) / num_updates,
            "lr": self._last_lr,
            "entropy": sums.pop("entropy_sum", 0.0) / loss_tokens,
            "tokens": float(batch.num_tokens),
            "loss_tokens": loss_tokens,
            "mismatch/max_abs_logprob_diff": maxes.pop("mismatch/max_abs_logprob_diff", 0.0),
            "mismatch/mean_abs_logprob_diff": sums.pop("mismatch/abs_diff_sum", 0.0) / loss_tokens,
        }
        recorded, agree, tokens = (sums.pop(k, 0.0) for k in ("r3/recorded", "r3/agree", "r3/tokens"))
        if tokens:  # per (token, MoE layer): routed by a record, and the live router's top-k equal to the record
            out["r3/coverage"] = recorded / tokens
            out["r3/topk_agreement"] = agree / max(recorded, 1.0)
        for k, v in sums.items():  # token-weighted means from policy_loss
            if k.startswith("w/"):
                out[k[2:]] = v / loss_tokens
        out.update(maxes)
        out.setdefault("kl", 0.0)
        out.setdefault("clip_frac", 0.0)
        return out

    # ------------------------------------------------------------------ weights out
    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in `iter_hf_tensors` order, gathered one parameter at a time (peak memory: one
        full tensor). Every rank yields the same tensors, so callers on all ranks iterate in step."""
        # Reuse the one place that maps our names to HF names by handing it a view whose state_dict gathers
        # lazily: each DTensor is all-gathered only when iter_hf_tensors reaches it.
        view = types.SimpleNamespace(config=self.config, state_dict=lambda: _GatheredStateDict(self.model))
        yield from iter_hf_tensors(view)  # type: ignore[arg-type]

    def shard_map(self) -> ShardMap:
        """What every rank holds of each HF tensor and this rank's part of it (p2p sync; no collective)."""
        return shard_map(self.model, self._rank, self._world)

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, t in self.state_for_sync():
            if self._rank == 0:
                out[name] = tensor_checksum(t if dtype is None else t.to(dtype))
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        return ckpt.save_checkpoint(
            path, self.model, self.optimizer, self.scheduler, step=self._step, extra=extra or {}
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        self._step, extra = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        return extra


def check_token_hashes(batch: TrainBatch) -> None:
    """TITO: the tokens we train on must be exactly the ids rollout generated (hash travels with the sample)."""
    if len(batch.token_hash) != len(batch):
        raise ValueError(
            f"TrainBatch.token_hash has {len(batch.token_hash)} entries for {len(batch)} samples: the trainer needs "
            "the rollout's per-sample hashes to prove it trains on the generated tokens (TITO)"
        )
    for i, (toks, expected) in enumerate(zip(batch.tokens, batch.token_hash)):
        got = token_hash(toks)
        if got != expected:
            raise ValueError(
                f"TITO check failed for sample {i}: token_hash of the tokens the trainer received is {got}, the "
                f"rollout recorded {expected} (the token ids changed between generation and training)"
            )


def clip_sharded_grads_(params: Iterator[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`clip_grad_norm_` for FSDP2 parameters (every one a DTensor sharded over the world): the global L2 norm from
    the local shards' norms and one all-reduce, the scaling in place on the local shards; no host sync. Same
    result as torch's DTensor path (coef = max_norm / (norm + 1e-6), capped at 1), without its per-op dispatch."""
    local = []
    for p in params:
        if p.grad is None:
            continue
        if not isinstance(p.grad, DTensor):
            raise TypeError("clip_sharded_grads_ needs FSDP2-sharded parameters (DTensor gradients)")
        local.append(p.grad.to_local())
    if not local:
        return torch.zeros(())
    sq = torch.stack([n.float() for n in torch._foreach_norm(local, 2.0)]).pow(2).sum()
    if dist.get_world_size() > 1:
        dist.all_reduce(sq)
    norm = sq.sqrt()
    if math.isfinite(max_norm):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, coef.to(local[0].dtype))
    return norm


def _global_counts(batch: TrainBatch, indices: list[int]) -> tuple[int, int]:
    """Masked tokens and sequences with at least one of them, over a whole mini-batch (every rank holds it).
    The first token of a sequence never carries loss (no logits before it), as in pack_samples."""
    tokens = seqs = 0
    for i in indices:
        n = sum(1 for m in batch.loss_mask[i][1:] if m)
        tokens += n
        seqs += n > 0
    return tokens, seqs


class _Metrics:
    """Per-rank accumulators, reduced across ranks in two collectives (sum, max) with a fixed key order."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add_sum(self, key: str, v: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + v

    def add_weighted(self, key: str, v: float, weight: float) -> None:
        self.add_sum(f"w/{key}", v * weight)

    def add_max(self, key: str, v: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, -math.inf), v)

    def reduce(self, device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
        # A rank with only dummy micro-batches has fewer keys: agree on the union first (tiny object collective).
        keys = [sorted(self.sums), sorted(self.maxes)]
        if dist.get_world_size() > 1:
            everyone: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, keys)
            keys = [sorted({k for e in everyone for k in e[j]}) for j in (0, 1)]
        sums = all_reduce_floats([self.sums.get(k, 0.0) for k in keys[0]], device, "sum")
        maxes = all_reduce_floats([self.maxes.get(k, -math.inf) for k in keys[1]], device, "max")
        return dict(zip(keys[0], sums)), {k: (v if math.isfinite(v) else 0.0) for k, v in zip(keys[1], maxes)}


class _GatheredStateDict:
    """`items()` of the sharded model's state_dict with each DTensor all-gathered on demand (a collective)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.model.state_dict().items():
            yield name, (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _checkpoint_forward(layer: torch.nn.Module) -> None:
    """Recompute the layer's activations in backward (non-reentrant checkpoint). Overriding the instance's
    `forward` keeps parameter names unchanged (checkpoint_wrapper would insert a module level)."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward  # type: ignore[method-assign]


def _record(
    acc: _Metrics,
    mb: PackedMicroBatch,
    loss: torch.Tensor,
    ent: torch.Tensor,
    stats: Mapping[str, float],
    train_lp: torch.Tensor | None,
) -> None:
    """One micro-batch's metrics into `acc` (the host reads). `train_lp`: its detached training log-probs, when
    they are the step's old log-probs (one update per step) and so the train-vs-rollout mismatch is measured here."""
    if train_lp is not None:
        _add_mismatch(acc, train_lp, mb)
    n_tok = float(mb.loss_mask.sum())
    acc.add_sum("loss", float(loss))
    acc.add_sum("loss_tokens", n_tok)
    acc.add_sum("entropy_sum", float((ent * mb.loss_mask).sum()))
    for k, v in stats.items():
        if k in _SUMMED:
            acc.add_sum(k, v)
        elif k in _MAXED:
            acc.add_max(k, v)
        elif k != "entropy":
            acc.add_weighted(k, v, n_tok)


def _add_mismatch(acc: _Metrics, lp: torch.Tensor, mb: Any) -> None:
    """Train-vs-rollout log-prob differences over the loss tokens of one micro-batch (no grad)."""
    with torch.no_grad():
        diff = (lp.detach() - mb.rollout_logprobs).abs() * mb.loss_mask
        acc.add_max("mismatch/max_abs_logprob_diff", float(diff.max()))
        acc.add_sum("mismatch/abs_diff_sum", float(diff.sum()))
