"""megatron-core training backend (stage: train; docs/design.md section 5): `MegatronTrainer` implements the `Trainer`
protocol on megatron-core's `GPTModel` (`train/mcore_model.py`): the step from `train/step.PackedTrainer`,
megatron's DDP, `finalize_model_grads` and optimizer (distributed or not), tensor, pipeline (megatron's 1F1B
schedule, interleaved over virtual stages: `train/mcore_pipeline.py`), context, expert and data parallelism, R3
through megatron's router-replay hook, and checkpoints in megatron's `dist_checkpointing`
(`train/mcore_checkpoint.py`), resumable on another parallel layout. docs/megatron.md says what exists and what does
not yet (Transformer Engine specs).

megatron-core is an optional dependency (`pip install miles-hpc[megatron]`); importing this module without it
raises an ImportError that says so.

Invariants:
- Ranks r*TP .. r*TP+TP-1 form tensor-parallel group r; pipeline stages are the outermost split (megatron's rank
  order); a data-parallel rank's TP and pipeline ranks all run the same micro-batches.
- On the CPU (`train.device=cpu`: CI, laptops) `train/mcore_cpu.py` stands in for megatron-core's CUDA-only
  helpers, and, as megatron's optimizers are CUDA-only, torch's AdamW steps on megatron's reduced gradients, with
  the same clipping; checkpoints then hold its state keyed like megatron's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

import miles_hpc.train.mcore_model  # noqa: F401  first: without megatron-core it raises the ImportError that says so
from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
from miles_hpc.models import iter_hf_tensors, read_config
from miles_hpc.planner.transfer import Box
from miles_hpc.train import checkpoint as ckpt
from miles_hpc.train import mcore_cpu
from miles_hpc.train.context_parallel import cp_token_logprobs
from miles_hpc.train.logprobs import PackedMicroBatch, token_logprobs
from miles_hpc.train.losses import policy_loss
from miles_hpc.train.mcore_checkpoint import (
    adamw_sharded_state,
    check_same_model,
    fix_group_order,
    init_adam_state,
    load_adamw,
    load_distributed_optimizer,
)
from miles_hpc.train.mcore_cp import cp_rows, row_layout
from miles_hpc.train.mcore_dsa import decoder_selection
from miles_hpc.train.mcore_model import (
    R3Replay,
    build_chunks,
    build_gpt,
    chunk_tensors,
    expert_layout,
    finalize_grads,
    full_hf_state,
    init_model_parallel,
    load_hf_weights,
    meta_model,
    moe_router,
    packed_logits,
    pipeline_stage,
    stage_layout,
    transformer_config,
    wrap_ddp,
)
from miles_hpc.train.mcore_pipeline import run_schedule
from miles_hpc.train.mcore_sp import sequence_parallel, sp_length, sp_slice
from miles_hpc.train.mcore_weights import local_hf_parts, mcore_boxes, mcore_rules
from miles_hpc.train.optim import build_optimizer, lr_lambda
from miles_hpc.train.shards import ShardMap
from miles_hpc.train.step import LossFn, PackedTrainer

# the model-level functions are re-exported: tests and scripts use them through this module
__all__ = [
    "MegatronTrainer",
    "build_gpt",
    "finalize_grads",
    "full_hf_state",
    "init_model_parallel",
    "load_hf_weights",
    "packed_logits",
    "transformer_config",
    "wrap_ddp",
]


def _refuse_unbuilt(train_cfg: TrainConfig, algo_cfg: AlgoConfig, megatron_cfg: MegatronConfig) -> None:
    """What this backend does not do, refused by key before any process group or checkpoint is touched."""
    if getattr(train_cfg, "mtp_loss_coef", 0.0):
        raise NotImplementedError(
            f"train.mtp_loss_coef={train_cfg.mtp_loss_coef}: the megatron backend holds the "
            "multi-token-prediction layers (loaded, saved, synced) but does not train them; use train.backend=fsdp"
        )
    if train_cfg.indexer_loss_coef and megatron_cfg.context_parallel > 1:
        raise NotImplementedError(
            f"train.indexer_loss_coef with megatron.context_parallel={megatron_cfg.context_parallel}: the indexer "
            "loss compares the indexer with the attention over whole rows, which CP splits; use context_parallel=1"
        )
    if train_cfg.compile:
        raise NotImplementedError("train.compile: not with the megatron backend yet")
    if train_cfg.activation_checkpointing and algo_cfg.routing_replay and megatron_cfg.pipeline_parallel > 1:
        raise NotImplementedError(
            "train.activation_checkpointing with algo.routing_replay and megatron.pipeline_parallel > 1: a "
            "layer recomputed in backward would replay the records of the micro-batch the 1F1B schedule runs "
            "then, not its own; use pipeline_parallel=1 or no recompute"
        )


class MegatronTrainer(PackedTrainer):
    """One rank of the megatron-core trainer. Construct on every rank after `init_trainer_world`; all methods are
    collectives (see `miles_hpc.train.protocol.Trainer`). Ranks are laid out in megatron's order (TP groups of
    consecutive ranks, then CP, DP and pipeline stages: `init_model_parallel`); the TP and CP ranks of a
    data-parallel rank get the same micro-batches."""

    def __init__(
        self,
        model_path: str | Path,
        train_cfg: TrainConfig,
        algo_cfg: AlgoConfig,
        megatron_cfg: MegatronConfig,
        *,
        device: str | torch.device,
        seed: int,
        total_steps: int | None = None,
        loss_fn: LossFn = policy_loss,
    ) -> None:
        _refuse_unbuilt(train_cfg, algo_cfg, megatron_cfg)
        if not torch.distributed.is_initialized():
            raise RuntimeError("MegatronTrainer needs the trainer process group: call dist.init_trainer_world first")
        self.train_cfg, self.algo_cfg, self.loss_fn = train_cfg, algo_cfg, loss_fn
        self._recompute = megatron_cfg.recompute_granularity if train_cfg.activation_checkpointing else None
        self.device = torch.device(device)
        if self.device.type == "cpu":
            mcore_cpu.enable()
        self._rank, self._world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        init_model_parallel(
            megatron_cfg.tensor_parallel,
            megatron_cfg.expert_parallel,
            pipeline_parallel=megatron_cfg.pipeline_parallel,
            context_parallel=megatron_cfg.context_parallel,
            virtual_pipeline=megatron_cfg.virtual_pipeline,
            seed=seed,
        )
        self._cp = megatron_cfg.context_parallel
        self._dp_rank = parallel_state.get_data_parallel_rank()
        self._dp_world = parallel_state.get_data_parallel_world_size()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._pp = parallel_state.get_pipeline_model_parallel_world_size()
        last_stage = parallel_state.is_pipeline_last_stage()
        self._gathers_logprobs = (  # CP ranks hold the same whole-row log-probs (`cp_token_logprobs`)
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
            and last_stage
        )
        # every rank's (TP rank, EP rank, pipeline stage): what each holds, for the p2p sync's shard map
        coords = (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
            pipeline_stage(),
        )
        self._coords: list[tuple[int, int, int]] = [coords] * self._world
        if self._world > 1:
            torch.distributed.all_gather_object(self._coords, coords)
        self._metrics_pp_group = self._pipeline_metrics_group() if self._pp > 1 else None
        self._step, self._last_lr, self._r3 = 0, train_cfg.lr, None
        torch.manual_seed(seed)
        self.config = read_config(model_path)
        bf16 = train_cfg.mixed_precision and self.device.type == "cuda"
        chunks = self._build(model_path, bf16)
        load_hf_weights(chunks, self.config, model_path)
        self._install_replays(chunks)
        # one chunk, or one per virtual pipeline stage (`megatron.virtual_pipeline`): each in megatron's DDP
        self.chunks = [
            wrap_ddp(
                chunk.to(self.device),
                distributed_optimizer=megatron_cfg.distributed_optimizer,
                fp32_grads=megatron_cfg.main_grads_dtype == "fp32",
                bucketing=v == 0,
            )
            for v, chunk in enumerate(chunks)
        ]
        self.model = self.chunks[0]  # the model without virtual stages
        for chunk in self.chunks:
            chunk.train()
        self._lr_at = lr_lambda(train_cfg, total_steps)
        self.optimizer: Any = self._optimizer(megatron_cfg, bf16)

    def _pipeline_metrics_group(self) -> Any:
        """Under pipeline stages, the group metrics are summed over: per (TP rank, CP rank), its data-parallel ranks
        of every stage (each holds a distinct part: losses on the last stage, R3 statistics on each). Every rank
        creates every group."""
        mine = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank())
        keys: list[tuple[int, int]] = [mine] * self._world
        torch.distributed.all_gather_object(keys, mine)
        out = None
        for key in sorted(set(keys)):
            group = torch.distributed.new_group([r for r in range(self._world) if keys[r] == key])
            if key == mine:
                out = group
        return out

    def _build(self, model_path: str | Path, bf16: bool) -> list[Any]:
        """This rank's GPTModel chunks (random init; one without virtual pipeline stages), the indexers trained when
        `train.indexer_loss_coef` > 0."""
        coef = self.train_cfg.indexer_loss_coef
        if coef and not self.config.is_dsa:
            raise ValueError(
                f"train.indexer_loss_coef={coef}: {model_path} is {self.config.model_type}, which has no DSA indexer "
                "(glm_moe_dsa and deepseek_v32 have one)"
            )
        if coef and self._pp > 1:
            raise NotImplementedError(
                f"train.indexer_loss_coef with megatron.pipeline_parallel={self._pp}: the indexer loss is added on "
                "the stage that computes the loss; use pipeline_parallel=1 (tensor/expert parallelism work)"
            )
        chunks = build_chunks(
            self.config,
            dtype=torch.bfloat16 if bf16 else torch.float32,
            train_indexers=coef > 0,
            recompute=self._recompute,
        )
        self._selection = decoder_selection(chunks[0]) if coef else None  # one pipeline stage, one chunk
        if self._selection is not None:
            self._selection.loss_mode = self.train_cfg.indexer_loss
        return chunks

    def _install_replays(self, chunks: list[Any]) -> None:
        """R3: every MoE layer's router consults its replay (megatron's hook). ``_replays[id(chunk)]``: a model
        chunk's replays with each one's index among the model's MoE layers (the records' layer axis), counting the
        layers of earlier pipeline stages and chunks."""
        cfg = self.config
        moe_index = {i: j for j, i in enumerate(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))}
        self._replays: dict[int, list[tuple[int, R3Replay]]] = {}
        for chunk in chunks:
            routed = [layer for layer in chunk.decoder.layers if moe_router(layer)]
            # layer_number: global, from 1
            mine = [(moe_index[layer.layer_number - 1], R3Replay(cfg.num_experts)) for layer in routed]
            for layer, (_, replay) in zip(routed, mine):
                moe_router(layer).router_replay = replay
            self._replays[id(chunk)] = mine

    def _optimizer(self, megatron_cfg: MegatronConfig, bf16: bool) -> Any:
        """megatron's optimizer on a GPU (distributed or not, optimizer states partly offloaded to the host by
        megatron's HybridDeviceOptimizer, precision-aware); on the CPU torch's AdamW (below)."""
        train_cfg, distributed = self.train_cfg, megatron_cfg.distributed_optimizer
        offload = megatron_cfg.optimizer_offload_fraction
        if self.device.type == "cuda":
            precision = dict(
                use_precision_aware_optimizer=megatron_cfg.precision_aware_optimizer,
                main_grads_dtype=torch.bfloat16 if megatron_cfg.main_grads_dtype == "bf16" else torch.float32,
            )
            offloading = dict(
                optimizer_cpu_offload=offload > 0,
                optimizer_offload_fraction=offload,
                overlap_cpu_optimizer_d2h_h2d=offload > 0,
            )
            opt = OptimizerConfig(
                **precision,
                **offloading,
                optimizer="adam",
                lr=train_cfg.lr,
                weight_decay=train_cfg.weight_decay,
                adam_beta1=train_cfg.adam_betas[0],
                adam_beta2=train_cfg.adam_betas[1],
                adam_eps=train_cfg.adam_eps,
                clip_grad=train_cfg.grad_clip,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=distributed,
            )
            return fix_group_order(get_megatron_optimizer(opt, self.chunks))
        # megatron's optimizers are CUDA-only (CUDA tensor type checks, CUDA scalars): on the CPU the same
        # AdamW as the FSDP backend over this rank's shards, fed megatron's reduced gradients.
        if distributed or offload:
            raise ValueError(
                "megatron.distributed_optimizer and megatron.optimizer_offload_fraction need CUDA (megatron's "
                "optimizer is CUDA-only); set megatron.distributed_optimizer=false on the CPU"
            )
        return build_optimizer(train_cfg, self._named_parameters(), self.device)

    def _named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every chunk's parameters, named as in their chunk."""
        for chunk in self.chunks:
            yield from chunk.module.named_parameters()

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self.train_cfg.lr * self._lr_at(self._step)

    def _forward(
        self, mb: PackedMicroBatch, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self._stage_forward(self.model, mb)
        return self._token_logprobs(logits, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def _token_logprobs(
        self, logits: torch.Tensor, mb: PackedMicroBatch, *, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`token_logprobs`; under context parallelism of this CP rank's rows, gathered into the whole row."""
        if self._cp == 1:
            return token_logprobs(logits, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)
        layout = row_layout(mb.num_tokens, sequence_parallel(self.model))
        group = parallel_state.get_context_parallel_group()
        return cp_token_logprobs(logits, mb, layout, group, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def _backward(self, loss: torch.Tensor) -> None:
        # megatron averages gradients over the data- and context-parallel ranks: undone for both (train/step.py)
        (loss * self._dp_world * self._cp).backward()

    def _local_rows(self, rows: torch.Tensor, sp: bool) -> torch.Tensor:
        """The rows [T, ...] of the tokens this rank's MoE layers route: its CP share of the padded row, then its TP
        chunk of that under sequence parallelism (padding rows: -1, no record)."""
        if self._cp == 1:
            return sp_slice(rows, sp)
        local = cp_rows(rows, row_layout(rows.shape[0], sp))
        if not sp:
            return local
        tp, r = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
        chunk = local.shape[0] // tp
        return local[r * chunk : (r + 1) * chunk]

    def _stage_forward(self, model: Any, mb: PackedMicroBatch) -> torch.Tensor:
        """This pipeline stage's (model chunk's) forward of `mb` (logits on the last one), with its R3 records and
        statistics."""
        sp = sequence_parallel(model)  # MoE under TP: each TP rank routes its chunk of the (padded) row
        replays = self._replays[id(model.module)]
        for j, replay in replays:
            replay.record = None if mb.routing is None else self._local_rows(mb.routing[0, :, j, :], sp)
            replay.compare = not self.algo_cfg.routing_replay
        if self._selection is not None:  # the indexer loss in the forwards that train (not the log-prob ones)
            self._selection.collect_kl = torch.is_grad_enabled()
        out = packed_logits(model, mb, self.config.vocab_size)
        if self._selection is not None and self._selection.kl:  # the indexer loss of this training forward
            if torch.is_grad_enabled() and not mb.is_dummy:
                self._indexer_kl = torch.stack(self._selection.kl).sum()
            self._selection.kl.clear()
        if mb.routing is not None and replays:
            stats = torch.stack([r.stats for _, r in replays if r.stats is not None]).sum(0)
            for _, replay in replays:
                replay.stats = None
            if sp:  # the TP ranks' chunks together
                torch.distributed.all_reduce(stats, group=parallel_state.get_tensor_model_parallel_group())
            if self._cp > 1:  # the CP ranks' shares together
                torch.distributed.all_reduce(stats, group=parallel_state.get_context_parallel_group())
            padded = row_layout(mb.num_tokens, sp).padded if self._cp > 1 else sp_length(mb.num_tokens, sp)
            stats[2] -= (padded - mb.num_tokens) * len(replays)  # the padding's rows: no record, not counted
            self._r3 = stats if self._r3 is None else self._r3 + stats
        return out

    # ------------------------------------------------------------------ pipeline stages (megatron's schedule)
    def _forward_only(self, mbs: list[PackedMicroBatch]) -> list[torch.Tensor | None]:
        if self._pp == 1:
            return super()._forward_only(mbs)
        out: dict[int, torch.Tensor] = {}

        def on_output(mb: PackedMicroBatch, logits: torch.Tensor) -> torch.Tensor:
            out[id(mb)] = self._token_logprobs(logits, mb, with_entropy=False)[0]
            return out[id(mb)]

        run_schedule(self.chunks, mbs, self._stage_forward, on_output, forward_only=True)
        return [out.get(id(mb)) for mb in mbs]

    def _forward_backward(self, mbs: list[PackedMicroBatch], loss_of: Any, entropy_grad: bool) -> None:
        if self._pp == 1:
            return super()._forward_backward(mbs, loss_of, entropy_grad)

        def on_output(mb: PackedMicroBatch, logits: torch.Tensor) -> torch.Tensor:
            lp, ent = self._token_logprobs(logits, mb, with_entropy=True, entropy_grad=entropy_grad)
            return loss_of(mb, lp, ent)

        # the same scaling as `_backward`: data- and context-parallel averaging of gradients undone (train/step.py)
        # (megatron's schedule multiplies the loss by the CP size itself: its `forward_step`)
        run_schedule(self.chunks, mbs, self._stage_forward, on_output, forward_only=False, loss_scale=self._dp_world)
        return None

    def _metrics_group(self) -> Any:
        # losses exist on the last stage, R3 statistics on every stage (each for its layers): sum over both
        return self._dp_group if self._pp == 1 else self._metrics_pp_group

    def _logprobs_to_rank0(self, merged: list[list[float]] | None) -> list[list[float]]:
        if self._pp == 1:
            return super()._logprobs_to_rank0(merged)
        # the last stage's data-parallel rank 0 has them; its pipeline group (TP rank 0, DP rank 0) holds rank 0
        if parallel_state.get_tensor_model_parallel_rank() or self._dp_rank:
            return []
        box = [merged]
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        torch.distributed.broadcast_object_list(
            box, src=torch.distributed.get_global_rank(pp_group, self._pp - 1), group=pp_group
        )
        return box[0] if self._rank == 0 else []

    def _clip_and_step(self) -> torch.Tensor:
        finalize_grads(self.chunks)
        self._last_lr = self.lr
        for group in self.optimizer.param_groups:
            group["lr"] = self._last_lr
        if isinstance(self.optimizer, torch.optim.Optimizer):
            norm = self._clip_cpu()
            self.optimizer.step()
        else:
            ok, norm, _ = self.optimizer.step()
            if not ok:
                raise FloatingPointError(f"megatron optimizer skipped step {self._step} (inf/nan gradients)")
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._step += 1
        return torch.as_tensor(float(norm) if norm is not None else 0.0)

    def _clip_cpu(self) -> float:
        """The CPU optimizer's half of megatron's step: gradients from the fp32 buffers, the global norm with
        replicated (non-TP) parameters counted once, clipping by `train.grad_clip`."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        expert_replica = parallel_state.get_expert_data_parallel_rank()
        sq, sq_experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        grads = []
        for _, p in self._named_parameters():
            if not p.requires_grad:  # frozen (DSA indexers, MTP layers): no gradient buffer
                continue
            p.grad = p.main_grad
            grads.append(p.grad)
            if getattr(p, "shared", False):
                continue  # the last pipeline stage's copy of a tied embedding: counted on the first stage
            if getattr(p, "allreduce", True):  # dense: TP shards count everywhere, TP replicas on TP rank 0
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                    sq += p.grad.double().pow(2).sum()
            elif expert_replica == 0:  # an expert: whole (expert TP 1), counted on one of its replicas
                sq_experts += p.grad.double().pow(2).sum()
        # each expert once: summed over the expert-parallel ranks holding distinct experts, then to every replica
        torch.distributed.all_reduce(sq_experts, group=parallel_state.get_expert_model_parallel_group())
        torch.distributed.all_reduce(sq_experts, group=parallel_state.get_expert_data_parallel_group())
        torch.distributed.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        sq += sq_experts
        if self._pp > 1:
            torch.distributed.all_reduce(sq, group=parallel_state.get_pipeline_model_parallel_group())
        norm = float(sq.sqrt())
        clip = self.train_cfg.grad_clip
        if clip > 0 and norm > clip:
            torch._foreach_mul_(grads, clip / (norm + 1e-6))
        return norm

    # ------------------------------------------------------------------ weights out
    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in `iter_hf_tensors` order, gathered over the TP group one megatron tensor at a
        time; every rank yields the same tensors (data-parallel replicas hold the same weights)."""
        yield from full_hf_state([chunk.module for chunk in self.chunks], self.config)

    def shard_map(self) -> ShardMap:
        """What every rank holds of each HF tensor (its TP rows/columns, its experts) and this rank's data, for the
        p2p sync (no collective: the ranks' coordinates were gathered at construction)."""
        cfg = self.config
        tp, ep = parallel_state.get_tensor_model_parallel_world_size(), expert_layout()[0]
        tp_rank, ep_rank, stage = self._coords[self._rank]
        stages = stage_layout(cfg)
        shapes = {n: tuple(t.shape) for n, t in iter_hf_tensors(meta_model(cfg))}
        params = chunk_tensors(self.chunks)
        layout: dict[str, list[Box]] = {n: [] for n in shapes}
        local: dict[str, torch.Tensor] = {}
        for rule in mcore_rules(cfg):
            name = rule.mcore_name(cfg.num_experts, ep)
            for t_rank, e_rank, s in self._coords:
                for hf_name, box in mcore_boxes(rule, shapes, cfg, t_rank, tp, e_rank, ep).items():
                    layout[hf_name].append(box if stages.stage_of(name) == s else box.with_dim(0, 0, 0))
            (where, chunk), mine_here = (
                stages.place_of(name),
                rule.expert is None or rule.owner(cfg.num_experts, ep) == ep_rank,
            )
            if where == stage and mine_here:
                mine = params[chunk][stages.local_name(name)].detach()
                local.update(
                    (n, t)
                    for n, t in local_hf_parts(rule, mine, cfg, tp_rank, tp).items()
                    if not layout[n][self._rank].empty
                )
        return ShardMap(shapes, {n: tuple(b) for n, b in layout.items()}, local)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """megatron's `dist_checkpointing` of the model and the optimizer state: each rank writes its shards, named
        by the model's global tensor names with this rank's offsets, so `load` reshards them to another data-,
        tensor- or expert-parallel layout. Plus our step, the model config, RNG and the loop's state
        (`train/checkpoint.py`). megatron's optimizer writes its fully reshardable layout (fp32 master weights and
        Adam moments per parameter); the CPU path's AdamW its moments per parameter, as megatron's non-distributed
        optimizer does."""

        def write_state(tmp: Path) -> None:
            (tmp / "mcore").mkdir(exist_ok=True)  # every rank: no rank waits on a directory another makes
            dist_checkpointing.save(self._sharded_state(), str(tmp / "mcore"))
            if self._rank == 0:
                layout = {
                    "step": self._step,
                    "model": self.config.to_hf_dict(),
                    "data_parallel": self._dp_world,
                    "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
                    "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
                    "virtual_pipeline": len(self.chunks),
                    "expert_parallel": expert_layout()[0],
                }
                (tmp / "megatron.json").write_text(json.dumps(layout) + "\n")

        return ckpt.write_checkpoint(
            path, step=self._step, extra=extra or {}, backend="megatron", write_state=write_state
        )

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore what `save` wrote, on any data-parallel size and tensor/expert-parallel layout: weights, optimizer
        state (Adam's moments and step, megatron's fp32 master weights), our step (so the LR schedule's position)
        and this rank's RNG; returns the loop's state. Refuses a checkpoint of another model config."""
        root, extra = ckpt.read_checkpoint(path, "megatron")
        with ckpt.reading(root, "megatron.json"):
            layout = json.loads((root / "megatron.json").read_text())
        check_same_model(root, layout.get("model"), self.config)
        for inner in self._inner_optimizers():
            init_adam_state(inner)
        # megatron's CPU-offload optimizer keeps its sub-optimizers' classes among its hyperparameters, which the
        # common state's weights-only load refuses unless named: torch's own optimizer classes (offload on or off).
        with torch.serialization.safe_globals([torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD]):
            with ckpt.reading(root, "mcore"):
                state = dist_checkpointing.load(self._sharded_state(is_loading=True), str(root / "mcore"))
        models = (
            [state["model"]]
            if len(self.chunks) == 1
            else [state["model"][f"chunk{v}"] for v in range(len(self.chunks))]
        )
        for chunk, loaded in zip(self.chunks, models):
            chunk.module.load_state_dict(loaded)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            load_adamw(self.optimizer, state["optimizer"])
        else:
            subs = self._megatron_optimizers()
            for i, sub in enumerate(subs):  # chained: one state dict per sub-optimizer (dense, experts)
                part = state["optimizer"] if len(subs) == 1 else state["optimizer"][i]
                if "param_state" in part:
                    load_distributed_optimizer(sub, part)
                else:  # the non-distributed optimizer restores Adam's step itself (`common_step`)
                    sub.load_state_dict(part)
        self._step = int(layout["step"])
        return extra

    def _sharded_state(self, *, is_loading: bool = False) -> dict[str, Any]:
        """{"model", "optimizer"} as megatron's sharded state dicts. For loading, the optimizer state must exist
        (`init_adam_state`): megatron builds the loading dict from it."""
        # megatron names each tensor globally (a chunk's layers with their offsets): any chunking reads it back
        parts = [chunk.module.sharded_state_dict() for chunk in self.chunks]
        model_sd = parts[0] if len(parts) == 1 else {f"chunk{v}": sd for v, sd in enumerate(parts)}
        if isinstance(self.optimizer, torch.optim.Optimizer):
            optim_sd = adamw_sharded_state(self.optimizer, model_sd)
        else:
            optim_sd = self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
        return {"model": model_sd, "optimizer": optim_sd}

    def _megatron_optimizers(self) -> list[Any]:
        """megatron's optimizer as its parts (a ChainedOptimizer holds one for dense and one for expert parameters)."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers holding the Adam state: the CPU path's AdamW, or the ones inside megatron's."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            return [self.optimizer]
        return [sub.optimizer for sub in self._megatron_optimizers() if sub.optimizer is not None]
