"""FSDP2 training backend (stage: train; docs/design.md section 5): `FSDPTrainer` implements the `Trainer` protocol.

Topology: one process per device, all in the default process group (:mod:`miles_hpc.train.dist`); every rank
receives the WHOLE `TrainBatch` from the controller. Parameters are sharded with `fully_shard` per decoder layer
and at the root (a world of 1: the root alone); optimizer state is sharded with them (AdamW over DTensors).

The step itself (mini-batches, data-parallel split, packed micro-batches, loss normalisation, TITO check, metrics)
is `train/step.PackedTrainer`'s; every FSDP rank is a data-parallel rank. A rank with fewer micro-batches runs
dummy ones, so FSDP's all-gathers and reduce-scatters stay matched.

Invariants:
- Master weights are float32; with `mixed_precision` on a GPU, compute is bf16 and gradient reduction fp32.
- `train.compile` (GPU) compiles each decoder layer in place before sharding; attention stays eager (attention.py).
- `zero_kl`: the model runs batch-invariant kernels (`models.batch_invariant`, per-sequence `invariant.attention`)
  and scores tokens with `invariant.log_softmax`, so its log-probs equal an engine's in `batch_invariant` mode bit
  for bit (docs/lora.md, "Zero-KL mode"). Refused with LoRA and with `train.compile`.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from miles_hpc.config import AlgoConfig, LoraConfig, TrainConfig
from miles_hpc.models import CausalLM, iter_hf_tensors, load_pretrained
from miles_hpc.models.batch_invariant import make_batch_invariant, packed_attention
from miles_hpc.models.lora import LoraAdapter, LoraSpec, attach, family_targets
from miles_hpc.train import checkpoint as ckpt
from miles_hpc.train.logprobs import PackedMicroBatch, token_logprobs
from miles_hpc.train.losses import mtp_loss_sum, policy_loss
from miles_hpc.train.optim import build_optimizer, build_scheduler
from miles_hpc.train.shards import ShardMap, shard_map
from miles_hpc.train.step import LossFn, PackedTrainer, check_token_hashes

__all__ = ["FSDPTrainer", "LossFn", "check_token_hashes"]


class FSDPTrainer(PackedTrainer):
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
        lora: LoraConfig | None = None,
        zero_kl: bool = False,
    ) -> None:
        """total_steps: optimizer steps of the whole run (needed by the cosine schedule).
        loss_fn: a function with `policy_loss`'s signature (the default); a plug-in point for custom losses.
        lora: with a rank > 0, LoRA RL: the base weights are frozen and only the adapter (`self.adapter`, replicated
        on every rank, its gradients averaged over them) is trained, checkpointed and, by the lora sync, sent.
        zero_kl: batch-invariant forward and log-probs (module docstring); dense, MoE and MLA models."""
        if not dist.is_initialized():
            raise RuntimeError("FSDPTrainer needs the trainer process group: call dist.init_trainer_world first")
        if zero_kl and ((lora is not None and lora.enabled) or train_cfg.compile):
            raise ValueError(
                "zero_kl: not with lora.rank > 0 (adapter hooks are not batch-invariant) nor with "
                "train.compile (fused kernels change the bits)"
            )
        self.zero_kl = zero_kl
        self.train_cfg, self.algo_cfg, self.loss_fn = train_cfg, algo_cfg, loss_fn
        self.device = torch.device(device)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._dp_rank, self._dp_world = self._rank, self._world  # every rank is a data-parallel rank
        self._step = 0
        self._last_lr = train_cfg.lr
        self._r3 = None  # R3 stats of the training forwards of this step (see _forward)
        self.replays_indexer = True
        torch.manual_seed(seed)
        # Full fp32 copy per rank before sharding: simple, fine up to a few B params per host.
        # TODO(scale): meta-device init + rank-0 load + broadcast (or DCP) for models larger than host memory.
        model = load_pretrained(model_path, dtype=torch.float32, device=self.device)
        self.config = mc = model.config
        self._model_path = Path(model_path)
        _check_model(train_cfg, model, model_path, zero_kl, lora)
        model.train()
        if zero_kl:
            make_batch_invariant(model)  # in place, names unchanged; refuses dynamic RoPE
        self.adapter: LoraAdapter | None = None
        if lora is not None and lora.enabled:
            model.requires_grad_(False)
            spec = LoraSpec(lora.rank, lora.alpha, lora.dropout, family_targets(lora.target_modules, mc.model_type))
            self.adapter = LoraAdapter.for_model(model, spec, device=self.device)
            for t in self.adapter.parameters():  # rank 0's initialisation everywhere
                if self._world > 1:
                    dist.broadcast(t.data, src=0)
            attach(model, self.adapter)  # hooks on the target linears: inside the FSDP units, names unchanged
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
        trained = self.adapter.named_parameters() if self.adapter is not None else model.named_parameters()
        self.optimizer = build_optimizer(train_cfg, trained, self.device)
        self.scheduler = build_scheduler(train_cfg, self.optimizer, total_steps)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return float(self.optimizer.param_groups[0]["lr"])

    def _forward(
        self, mb: PackedMicroBatch, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of one micro-batch. With routing records (R3) the MoE layers replay them when
        `algo.routing_replay`, else only compare; `self._r3` then holds the step's replay stats (device)."""
        kw: dict[str, Any] = {}
        if mb.routing is not None:
            kw = {"routing_replay": mb.routing, "routing_compare": not self.algo_cfg.routing_replay}
        if mb.indexer is not None:  # DSA indexer replay: the rollout's top-k choices
            kw["index_replay"] = mb.indexer
        if self.zero_kl:
            kw["attn_backend"] = packed_attention
        mtp: list[torch.Tensor] | None = None
        if self.train_cfg.mtp_loss_coef and torch.is_grad_enabled() and not mb.is_dummy:
            kw["mtp_out"] = mtp = []
        logits = self.model(mb.input_ids, position_ids=mb.position_ids, cu_seqlens=mb.cu_seqlens, **kw)
        if mtp is not None:
            self._mtp = mtp_loss_sum(mtp, mb.input_ids, mb.loss_mask, mb.seq_ids)
        kl = self.model.take_indexer_kl() if self.train_cfg.indexer_loss_coef else None
        if kl is not None and torch.is_grad_enabled() and not mb.is_dummy:
            self._indexer_kl = kl
        if mb.routing is not None:
            stats = self.model.replay_stats()
            self._r3 = stats if self._r3 is None else self._r3 + stats
        if mb.indexer is not None:
            stats = self.model.index_replay_stats()
            self._dsa = stats if self._dsa is None else self._dsa + stats
        return token_logprobs(
            logits, mb, with_entropy=with_entropy, entropy_grad=entropy_grad, batch_invariant=self.zero_kl
        )

    def _clip_and_step(self) -> torch.Tensor:
        """Clip the global grad norm, step AdamW and the schedule; returns the pre-clip norm as a device scalar
        (identical on every rank)."""
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        if self.adapter is not None:
            norm = _average_and_clip_replicated_(list(self.adapter.parameters()), max_norm, self._world)
        else:
            norm = clip_sharded_grads_(self.model.parameters(), max_norm)
        self._last_lr = self.lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._step += 1
        return norm.detach().float()

    # ------------------------------------------------------------------ weights out
    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in `iter_hf_tensors` order, gathered one parameter at a time (peak memory: one
        full tensor). Every rank yields the same tensors, so callers on all ranks iterate in step."""
        # Reuse the one place that maps our names to HF names by handing it a view whose state_dict gathers
        # lazily: each DTensor is all-gathered only when iter_hf_tensors reaches it.
        # With LoRA: the merged weights (base + scaling * B @ A), which the engines then serve without adapters.
        view = types.SimpleNamespace(
            config=self.config, state_dict=lambda: _GatheredStateDict(self.model, self.adapter)
        )
        yield from iter_hf_tensors(view)  # type: ignore[arg-type]

    def adapter_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapter's tensors by PEFT name (every rank holds them whole; no collective)."""
        if self.adapter is None:
            raise RuntimeError("adapter_for_sync: this trainer has no LoRA adapter (lora.rank = 0)")
        for name, t in self.adapter.peft_state():
            yield name, t.detach()

    def shard_map(self) -> ShardMap:
        """What every rank holds of each HF tensor and this rank's part of it (p2p sync; no collective). With
        LoRA, this rank's rows of the merged weights."""
        sm = shard_map(self.model, self._rank, self._world)
        if self.adapter is None:
            return sm
        local = dict(sm.local)
        for module in self.adapter.modules_:
            name = module + ".weight"
            if name in local:
                (lo, hi), *_ = sm.layout[name][self._rank].dims
                a, b = self.adapter.pair(module)
                local[name] = local[name] + (b[lo:hi] @ a).detach().to(local[name].dtype) * self.adapter.spec.scaling
        return ShardMap(sm.shapes, sm.layout, local)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        if self.adapter is not None:  # LoRA: the frozen base stays where it was loaded from
            return ckpt.save_adapter_checkpoint(
                path,
                self.adapter,
                self.optimizer,
                self.scheduler,
                step=self._step,
                extra=extra or {},
                base_model=str(self._model_path),
            )
        return ckpt.save_checkpoint(
            path, self.model, self.optimizer, self.scheduler, step=self._step, extra=extra or {}
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        if self.adapter is not None:
            self._step, extra = ckpt.load_adapter_checkpoint(path, self.adapter, self.optimizer, self.scheduler)
            return extra
        self._step, extra = ckpt.load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        return extra


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


class _GatheredStateDict:
    """`items()` of the sharded model's state_dict with each DTensor all-gathered on demand (a collective), with a
    LoRA adapter's update merged into the weights it adapts."""

    def __init__(self, model: torch.nn.Module, adapter: LoraAdapter | None = None) -> None:
        self.model, self.adapter = model, adapter

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        adapted = set(self.adapter.modules_) if self.adapter is not None else set()
        for name, t in self.model.state_dict().items():
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            module = name.removesuffix(".weight")
            if module in adapted and self.adapter is not None:
                full = full + self.adapter.delta(module).detach().to(full.dtype)
            yield name, full


def _average_and_clip_replicated_(params: list[torch.nn.Parameter], max_norm: float, world: int) -> torch.Tensor:
    """For parameters every rank holds whole (a LoRA adapter): average the gradients over the ranks (one
    all-reduce of their concatenation; the FSDP parameters' reduce-scatter averages too), then clip by the global
    norm; returns the pre-clip norm."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if world > 1:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g)
            offset += g.numel()
    else:
        for p, g in zip(params, grads):
            p.grad = g
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def _check_model(
    train_cfg: TrainConfig, model: CausalLM, model_path: str | Path, zero_kl: bool, lora: LoraConfig | None
) -> None:
    """Refuse what this model cannot train with this config (naming the key); turn the indexer loss on."""
    if train_cfg.indexer_loss_coef and not model.config.is_dsa:
        raise ValueError(
            f"train.indexer_loss_coef={train_cfg.indexer_loss_coef}: {model_path} is {model.config.model_type}, "
            "which has no DSA indexer (glm_moe_dsa and deepseek_v32 have one)"
        )
    if train_cfg.indexer_loss_coef and lora is not None and lora.enabled:
        raise ValueError(
            f"train.indexer_loss_coef={train_cfg.indexer_loss_coef} with LoRA: the indexer is frozen with the "
            "base weights (no adapter on it), so its loss would train nothing; set train.indexer_loss_coef=0"
        )
    if train_cfg.indexer_loss_coef:
        model.set_indexer_loss(train_cfg.indexer_loss)
    if zero_kl and model.config.is_dsa:
        raise ValueError(
            f"zero_kl: {model_path} is {model.config.model_type}, whose DSA indexer (scoring and top-k) has no "
            "batch-invariant kernels"
        )
    if train_cfg.mtp_loss_coef and not model.config.num_nextn_predict_layers:
        raise ValueError(
            f"train.mtp_loss_coef={train_cfg.mtp_loss_coef}: {model_path} has no multi-token-prediction layers "
            "(num_nextn_predict_layers=0, or none in its weights)"
        )


def _checkpoint_forward(layer: torch.nn.Module) -> None:
    """Recompute the layer's activations in backward (non-reentrant checkpoint). Overriding the instance's
    `forward` keeps parameter names unchanged (checkpoint_wrapper would insert a module level)."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward
