"""The RL step over packed micro-batches, shared by the training backends (stage: train): `PackedTrainer` holds
what FSDP2 (`fsdp.py`) and megatron-core (`megatron.py`) do alike; they supply the model's forward, backward,
optimizer step and weights.

How a step is split (all plans are pure functions of the batch, so ranks agree without talking, see packing.py):
  batch -> `updates_per_step` contiguous mini-batches (one optimizer step each)
        -> each mini-batch's samples over data-parallel ranks, balanced by tokens
        -> each rank's samples into packed micro-batches of <= `max_tokens_per_microbatch` tokens (no padding).
A data-parallel rank with fewer micro-batches than the busiest one runs one-token dummy micro-batches (zero loss),
so collectives inside forward and backward stay matched. Ranks of one model-parallel group (megatron TP) are one
data-parallel rank: they get the same micro-batches.

Invariants:
- Loss normalisation is global: `policy_loss` gets the masked-token and sequence counts of the whole mini-batch
  (computed from the full batch every rank holds: no collective needed), so micro-batch losses summed over
  micro-batches AND data-parallel ranks are the mini-batch loss. Both backends average gradients over
  data-parallel ranks; `_backward` multiplies each micro-batch loss by their number, so the reduced gradient is
  the gradient of that sum. A world of 1 and of N give the same update (tests check it).
- `old_logprobs` of the PPO ratio are the trainer's own, computed by `train_step` in a no-grad pass over the same
  micro-batches before the first update of the step (one extra forward; the loop passes nothing). With
  `updates_per_step == 1` the ratio is exactly 1 at the update.
- TITO: `train_step` re-hashes every sample's tokens on every rank and raises before any collective on mismatch.
- Metrics are reduced over the data-parallel group (model-parallel replicas would count twice) and are the same
  on every rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from miles_hpc.config import AlgoConfig, TrainConfig
from miles_hpc.data.sample import token_hash
from miles_hpc.sync.wire.checksum import tensor_checksum
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.dist import all_reduce_floats, group_size
from miles_hpc.train.logprobs import PackedMicroBatch, dummy_microbatch, pack_samples
from miles_hpc.train.packing import pack_microbatches, split_across_ranks, split_minibatches

__all__ = ["LossFn", "PackedTrainer", "check_token_hashes"]

LossFn = Callable[..., tuple[torch.Tensor, Mapping[str, float]]]
# A micro-batch's metrics waiting for the host: (micro-batch, loss, entropy, loss stats, train log-probs if mismatch)
_Pending = tuple[PackedMicroBatch, torch.Tensor, torch.Tensor, Mapping[str, float], torch.Tensor | None]
# (micro-batch, its log-probs, its entropy) -> its loss
_LossOf = Callable[[PackedMicroBatch, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
# policy_loss metrics that are micro-batch means over masked tokens (averaged with token weights across
# micro-batches and ranks); pg_loss is globally normalised (summed); ratio_max is a max.
_SUMMED = ("pg_loss",)
_MAXED = ("ratio_max",)


def supervised_algo(cfg: AlgoConfig) -> AlgoConfig:
    """The loss of a supervised batch (`TrainBatch.supervised`): its log-probs come from no behaviour policy, so
    truncated and masked importance sampling (which would weigh each token by its probability under the model
    against the placeholder 0 and mask nearly all of them) and the KL penalty (no reference log-probs) are off."""
    return dataclasses.replace(cfg, tis_cap=None, mis_low=None, mis_high=None, kl_coef=0.0)


class PackedTrainer:
    """The `Trainer` verbs `compute_logprobs` and `train_step` over packed micro-batches. A backend sets, in its
    constructor, the attributes below and implements `_forward`, `_clip_and_step` (and the weights verbs)."""

    train_cfg: TrainConfig
    algo_cfg: AlgoConfig
    loss_fn: LossFn
    device: torch.device
    _rank: int  # global rank (0 = controller)
    _world: int
    _dp_rank: int = 0  # this rank's data-parallel index and the number of them
    _dp_world: int = 1
    _dp_group: dist.ProcessGroup | None = None  # None: the default group (pure data parallelism)
    _gathers_logprobs: bool = True  # False on model-parallel replicas that hold nothing another rank lacks
    _step: int = 0
    _last_lr: float = 0.0
    _r3: torch.Tensor | None = None
    _mtp: tuple[torch.Tensor, torch.Tensor] | None = None  # (CE sum, targets) of the last training forward
    _indexer_kl: torch.Tensor | None = None  # DSA indexer loss: KL sum over rows and layers, last training forward
    _dsa: torch.Tensor | None = None  # indexer replay stats of the step's training forwards (like _r3)
    replays_indexer = False  # the backend's forward takes TrainBatch.indexer_topk (FSDP)

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

    # ------------------------------------------------------------------ backend hooks
    def _forward(
        self, mb: PackedMicroBatch, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs [T] (and entropy) of one micro-batch (`token_logprobs` of the backend's logits)."""
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's share of the mini-batch loss (see the module's invariants)."""
        (loss * self._dp_world).backward()

    def _forward_only(self, mbs: list[PackedMicroBatch]) -> list[torch.Tensor | None]:
        """No-grad log-probs [T] of each micro-batch; None where this rank does not compute them (a pipeline stage
        before the last). The default runs `_forward` on each."""
        with torch.no_grad():
            return [self._forward(mb, with_entropy=False)[0] for mb in mbs]

    def _forward_backward(self, mbs: list[PackedMicroBatch], loss_of: _LossOf, entropy_grad: bool) -> None:
        """Forward and backward of one mini-batch's micro-batches: `loss_of(mb, logprobs, entropy)` gives the
        micro-batch's loss (and records its metrics). The default runs them one after the other; a pipeline-parallel
        backend runs its schedule and calls `loss_of` on the last stage only."""
        for mb in mbs:
            lp, ent = self._forward(mb, with_entropy=True, entropy_grad=entropy_grad)
            self._backward(loss_of(mb, lp, ent))

    def _metrics_group(self) -> dist.ProcessGroup | None:
        """The group metrics are reduced over: every rank holding a distinct part of them (the data-parallel ranks;
        with pipeline stages, those too)."""
        return self._dp_group

    def _logprobs_to_rank0(self, merged: list[list[float]] | None) -> list[list[float]]:
        """`compute_logprobs`' result, which the data-parallel gather left on one rank (`merged`, None elsewhere),
        on rank 0 ([] elsewhere). The default: that rank is rank 0."""
        return merged if merged is not None and self._rank == 0 else []

    def _clip_and_step(self) -> torch.Tensor:
        """After a mini-batch: clip the global grad norm, step the optimizer and the schedule, count the step;
        returns the pre-clip norm as a device scalar, identical on every rank."""
        raise NotImplementedError

    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named weights (the backend's; see `Trainer.state_for_sync`)."""
        raise NotImplementedError

    def checksums(self, dtype: torch.dtype | None = None) -> dict[str, str]:
        """HF name -> checksum of the full weights (cast to `dtype`), from `state_for_sync`: a collective, every
        rank iterates; complete on rank 0, {} elsewhere."""
        out: dict[str, str] = {}
        for name, t in self.state_for_sync():
            if self._rank == 0:
                out[name] = tensor_checksum(t if dtype is None else t.to(dtype))
        return out

    # ------------------------------------------------------------------ planning
    def _plan(self, batch: TrainBatch, indices: list[int]) -> list[list[int]]:
        """This rank's micro-batches (lists of sample ids) for the samples `indices`, padded with [] (dummy) to
        the busiest data-parallel rank's count (ranks of one model-parallel group get the same plan)."""
        lengths = [len(t) for t in batch.tokens]
        per_rank = split_across_ranks(indices, lengths, self._dp_world)
        plans = [pack_microbatches(p, lengths, self.train_cfg.max_tokens_per_microbatch) for p in per_rank]
        n = max(len(p) for p in plans)
        mine = plans[self._dp_rank]
        return mine + [[] for _ in range(n - len(mine))]

    def _microbatch(self, batch: TrainBatch, ids: list[int]) -> PackedMicroBatch:
        return pack_samples(batch, ids, self.device) if ids else dummy_microbatch(self.device)

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        mbs = [self._microbatch(batch, ids) for ids in self._plan(batch, list(range(len(batch))))]
        mine: dict[int, list[float]] = {}
        for mb, lp in zip(mbs, self._forward_only(mbs)):
            if lp is not None and not mb.is_dummy:
                mine.update(zip(mb.sample_ids, (x.tolist() for x in mb.split(lp.cpu()))))
        merged: list[list[float]] | None = None
        if self._gathers_logprobs:  # else: a model-parallel replica of what another rank sends, or no log-probs
            gathered: list[dict[int, list[float]]] = [mine]
            dst = 0 if self._dp_group is None else dist.get_global_rank(self._dp_group, 0)
            if self._dp_world > 1:
                gathered = [{} for _ in range(self._dp_world)] if self._rank == dst else []
                dist.gather_object(mine, gathered if self._rank == dst else None, dst=dst, group=self._dp_group)
            if self._rank == dst:
                union = {k: v for part in gathered for k, v in part.items()}
                merged = [union[i] for i in range(len(batch))]
        return self._logprobs_to_rank0(merged)

    def _check_batch(self, batch: TrainBatch) -> None:
        check_token_hashes(batch)
        if batch.indexer_topk is not None and not self.replays_indexer:
            raise ValueError(f"TrainBatch.indexer_topk: {type(self).__name__} does not replay DSA indexer records")

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._check_batch(batch)
        minibatches = split_minibatches(len(batch), self.train_cfg.updates_per_step)
        plans = [self._plan(batch, mini) for mini in minibatches]
        algo = supervised_algo(self.algo_cfg) if batch.supervised else self.algo_cfg
        want_entropy = algo.entropy_coef != 0.0
        acc = _Metrics()
        grad_norms: list[torch.Tensor] = []

        # Pass 1 (no grad): old log-probs under the weights before any update of this step; mismatch vs rollout.
        # With one update per step nothing has changed when pass 2 runs its forward, so its detached log-probs ARE
        # the old ones (ratio exactly 1): skip the extra forward, a third of the step's compute.
        single_update = len(minibatches) == 1
        old: dict[int, torch.Tensor] = {}
        for plan in plans if not single_update else ():
            mbs = [self._microbatch(batch, ids) for ids in plan]
            for mb, lp in zip(mbs, self._forward_only(mbs)):
                if lp is None or mb.is_dummy:
                    continue
                old.update(zip(mb.sample_ids, mb.split(lp)))
                _add_mismatch(acc, lp, mb)

        # Pass 2: one optimizer step per mini-batch. Metrics stay on the device until the optimizer step has been
        # launched, then come to the host: no device sync leaves the GPU idle while the host catches up.
        self._r3 = self._dsa = None  # R3 / indexer replay stats from the training forwards only
        for mini, plan in zip(minibatches, plans):
            total_tokens, num_seqs = _global_counts(batch, mini)
            pending: list[_Pending] = []
            mtp_pending: list[tuple[torch.Tensor, torch.Tensor]] = []
            kl_pending: list[torch.Tensor] = []

            def loss_of(mb: PackedMicroBatch, lp: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
                if mb.is_dummy:
                    # Keeps the graph connected to every sharded parameter, so backward's reduce-scatter runs.
                    return lp.sum() * 0.0 + (ent.sum() * 0.0 if ent is not None else 0.0)
                old_lp = lp.detach() if single_update else torch.cat([old[i] for i in mb.sample_ids])
                loss, stats = self.loss_fn(
                    lp,
                    old_lp,
                    mb.advantages,
                    mb.loss_mask,
                    mb.seq_ids,
                    algo,
                    rollout_logprobs=mb.rollout_logprobs,
                    ref_logprobs=mb.ref_logprobs,
                    entropy=ent if want_entropy else None,
                    num_seqs=num_seqs,
                    total_tokens=total_tokens,
                )
                assert ent is not None
                if self._mtp is not None:  # train.mtp_loss_coef: the MTP layers' cross-entropy, per loss token
                    mtp_sum, mtp_n = self._mtp
                    loss = loss + self.train_cfg.mtp_loss_coef * mtp_sum / max(total_tokens, 1)
                    mtp_pending.append((mtp_sum.detach(), mtp_n))
                    self._mtp = None
                loss = self._add_indexer_loss(loss, batch, mb, mini, kl_pending)
                pending.append((mb, loss.detach(), ent.detach(), stats, old_lp if single_update else None))
                return loss

            self._forward_backward([self._microbatch(batch, ids) for ids in plan], loss_of, want_entropy)
            grad_norms.append(self._clip_and_step())
            for mb, loss, ent, stats, train_lp in pending:
                _record(acc, mb, loss, ent, stats, train_lp)
            for mtp_sum, mtp_n in mtp_pending:
                acc.add_sum("mtp/ce_sum", float(mtp_sum))
                acc.add_sum("mtp/targets", float(mtp_n))
            if kl_pending:  # this rank's micro-batches: KL sum, token rows
                kl_sum, kl_rows = torch.stack(kl_pending).sum(0).tolist()
                acc.add_sum("dsa/kl_sum", kl_sum)
                acc.add_sum("dsa/kl_rows", kl_rows)
        if self._r3 is not None:
            for key, v in zip(("r3/recorded", "r3/agree", "r3/tokens"), self._r3.tolist()):
                acc.add_sum(key, float(v))
        if self._dsa is not None:
            for key, v in zip(("dsa/recorded", "dsa/agree", "dsa/tokens"), self._dsa.tolist()):
                acc.add_sum(key, float(v))
        metrics = self._reduce_metrics(acc, batch, len(minibatches))
        metrics["grad_norm"] = float(torch.stack(grad_norms).mean())  # already global: identical on every rank
        return metrics

    def _add_indexer_loss(
        self, loss: torch.Tensor, batch: TrainBatch, mb: PackedMicroBatch, mini: list[int], pending: list[torch.Tensor]
    ) -> torch.Tensor:
        """`train.indexer_loss_coef`: the last training forward's indexer KL (summed over its token rows and the
        layers with an indexer) per token row of the mini-batch `mini` (every token is a query row) added to `loss`;
        (KL sum, this micro-batch's rows) into `pending` for the metric."""
        if self._indexer_kl is None:
            return loss
        rows = sum(len(batch.tokens[i]) for i in mini)
        kl, self._indexer_kl = self._indexer_kl, None
        local_rows = sum(len(batch.tokens[i]) for i in mb.sample_ids)
        pending.append(torch.stack([kl.detach(), kl.new_tensor(local_rows)]))
        return loss + self.train_cfg.indexer_loss_coef * kl / max(rows, 1)

    def _reduce_metrics(self, acc: _Metrics, batch: TrainBatch, num_updates: int) -> dict[str, float]:
        sums, maxes = acc.reduce(self.device, self._metrics_group())
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
        if "mtp/targets" in sums:  # token-mean cross-entropy of the MTP layers over their targets
            out["mtp/loss"] = sums.pop("mtp/ce_sum") / max(sums.pop("mtp/targets"), 1.0)
        if "dsa/kl_rows" in sums:  # the indexer loss: KL per token row, summed over the layers with an indexer
            out["dsa/indexer_kl"] = sums.pop("dsa/kl_sum") / max(sums.pop("dsa/kl_rows"), 1.0)
        recorded, agree, tokens = (sums.pop(k, 0.0) for k in ("dsa/recorded", "dsa/agree", "dsa/tokens"))
        if tokens:  # per (token, indexer layer): attended a recorded selection, and the live top-k was the same
            out["dsa/replay_coverage"] = recorded / tokens
            out["dsa/topk_agreement"] = agree / max(recorded, 1.0)
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
    """Per-rank accumulators, reduced across the data-parallel ranks in two collectives (sum, max) with a fixed key
    order."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    def add_sum(self, key: str, v: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + v

    def add_weighted(self, key: str, v: float, weight: float) -> None:
        self.add_sum(f"w/{key}", v * weight)

    def add_max(self, key: str, v: float) -> None:
        self.maxes[key] = max(self.maxes.get(key, -math.inf), v)

    def reduce(
        self, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        # A rank with only dummy micro-batches has fewer keys: agree on the union first (tiny object collective).
        keys = [sorted(self.sums), sorted(self.maxes)]
        if group_size(group) > 1:
            everyone: list[Any] = [None] * group_size(group)
            dist.all_gather_object(everyone, keys, group=group)
            keys = [sorted({k for e in everyone for k in e[j]}) for j in (0, 1)]
        sums = all_reduce_floats([self.sums.get(k, 0.0) for k in keys[0]], device, "sum", group)
        maxes = all_reduce_floats([self.maxes.get(k, -math.inf) for k in keys[1]], device, "max", group)
        return dict(zip(keys[0], sums)), {k: (v if math.isfinite(v) else 0.0) for k, v in zip(keys[1], maxes)}


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
