"""megatron-core training backend (stage: train; DESIGN section 5): megatron-core's `GPTModel` built from our HF
model config and loaded from an HF checkpoint with tensor parallelism, trained by `MegatronTrainer` (the `Trainer`
protocol's step from `train/step.PackedTrainer`; megatron's DDP, `finalize_model_grads` and optimizer, distributed
or not), with R3 through megatron's router-replay hook. docs/megatron.md says what exists and what does not yet
(PP/CP, the MLA mapping, resuming from a checkpoint).

megatron-core is an optional dependency (`pip install miles-hpc[megatron]`); importing this module without it
raises an ImportError that says so.

Invariants:
- The model is megatron's own `GPTModel` with the local layer spec (no Transformer Engine needed); our code only
  maps configs and weights (`train/mcore_weights.py`) and feeds it.
- Packed micro-batches (`train/logprobs.PackedMicroBatch`: sequences concatenated, no padding) run as one row with
  a block-diagonal causal mask, so no token attends across sequences. Megatron's RoPE indexes the row by absolute
  position, not by our per-sequence `position_ids`; inside a sequence only position differences enter the scores,
  so the result is the per-sequence one (a test checks it against our model).
- Logits are gathered over tensor-parallel ranks and the vocabulary padding is dropped before any softmax.
- megatron-core's forward calls CUDA-only helpers (a global buffer on `torch.cuda.current_device()`, the CUDA RNG
  tracker, the MoE dispatcher's side stream), and its optimizers and checkpoint writers are CUDA-only: the backend
  runs on GPUs; the CPU tests patch those helpers in tests/ (never here) and step with torch's AdamW.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "train.backend=megatron needs megatron-core: pip install 'miles-hpc[megatron]' (megatron-core 0.16 on "
        "Python 3.11, newer releases on 3.12)"
    ) from e

from miles_hpc.config import AlgoConfig, MegatronConfig, TrainConfig
from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors, load_pretrained, read_config
from miles_hpc.models.moe import merge_replay
from miles_hpc.sync.plan import Box
from miles_hpc.train import checkpoint as ckpt
from miles_hpc.train.logprobs import PackedMicroBatch, token_logprobs
from miles_hpc.train.losses import policy_loss
from miles_hpc.train.optim import build_optimizer, lr_lambda
from miles_hpc.train.step import LossFn, PackedTrainer
from miles_hpc.train.mcore_weights import (
    Rule,
    iter_full_hf,
    local_hf_parts,
    mcore_boxes,
    mcore_rules,
    padded_vocab_size,
    to_mcore,
)
from miles_hpc.train.shards import ShardMap

__all__ = ["MegatronTrainer", "build_gpt", "finalize_grads", "full_hf_state", "init_model_parallel",
           "load_hf_weights", "packed_logits", "transformer_config", "wrap_ddp"]  # fmt: skip

_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def init_model_parallel(tensor_parallel: int = 1, expert_parallel: int = 1, *, seed: int = 0) -> None:
    """megatron's parallel state over the default process group (which must exist): TP groups of
    `tensor_parallel` consecutive ranks, the rest data parallel; MoE experts split over `expert_parallel` of the
    data-parallel ranks (expert TP 1); on GPUs also megatron's per-TP-rank CUDA RNG states (`seed`)."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("megatron needs the trainer process group: call dist.init_trainer_world first")
    world = torch.distributed.get_world_size()
    if world % tensor_parallel:
        raise ValueError(f"megatron.tensor_parallel={tensor_parallel} does not divide the {world} trainer ranks")
    if (world // tensor_parallel) % expert_parallel:
        raise ValueError(f"megatron.expert_parallel={expert_parallel} does not divide the "
                         f"{world // tensor_parallel} data-parallel ranks")  # fmt: skip
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             expert_tensor_parallel_size=1)  # fmt: skip
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """megatron's `TransformerConfig` for our model config (after `init_model_parallel`). Raises, naming the
    field, for what the mapping does not cover yet."""
    mcore_rules(cfg)  # the family check, with its message
    if cfg.rope_scaling is not None:
        raise NotImplementedError(f"megatron backend: rope_scaling {cfg.rope_scaling.rope_type!r} is not mapped yet")
    if cfg.hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(f"megatron backend: hidden_act {cfg.hidden_act!r} is not mapped yet")
    if cfg.o_bias != cfg.mlp_bias:
        raise NotImplementedError(
            f"megatron backend: {cfg.model_type} with attention_bias={cfg.o_bias} and mlp_bias={cfg.mlp_bias}: "
            "megatron has one bias switch (add_bias_linear) for the attention output and the MLP"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    moe: dict[str, Any] = {}
    if cfg.num_experts:
        if tp > 1:
            raise NotImplementedError("megatron backend: MoE with megatron.tensor_parallel > 1 needs megatron's "
                                      "sequence parallelism, not wired yet; split the experts with expert_parallel")
        if cfg.num_experts % parallel_state.get_expert_model_parallel_world_size():
            raise ValueError(f"megatron.expert_parallel does not divide num_experts={cfg.num_experts}")
        # Qwen3-MoE routing: softmax over all experts then top-k, renormalised when norm_topk_prob; megatron's
        # top-k over the logits then softmax over the k is that renormalised form, pre-softmax the other.
        group: dict[str, Any] = {}
        if cfg.group_router:
            # GLM-4.5: sigmoid scores, top-k of scores + the (frozen) correction bias within the best groups, gate =
            # the scores at those ids, renormalised, times routed_scaling_factor; shared experts beside.
            if not cfg.norm_topk_prob:
                raise NotImplementedError("megatron backend: a sigmoid router without norm_topk_prob (megatron "
                                          "always renormalises sigmoid gates)")  # fmt: skip
            if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
                raise NotImplementedError(f"megatron backend: groups scored by their top {cfg.num_experts_per_tok} "
                                          f"// {cfg.topk_group} experts, where the model sums its top 2")  # fmt: skip
            group = dict(
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0, moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
                moe_router_num_groups=cfg.n_group if cfg.n_group > 1 else None,
                moe_router_group_topk=cfg.topk_group if cfg.n_group > 1 else None,
                moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts or None,
            )  # fmt: skip
        moe = dict(
            num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_pre_softmax=not cfg.norm_topk_prob,
            # router logits in the activations' dtype, as transformers computes them (softmax in fp32 after)
            moe_router_load_balancing_type="none", **{"moe_router_score_function": "softmax", **group},
            # all-to-all: data-parallel ranks hold packed micro-batches of different lengths, which the all-gather
            # dispatcher (equal shapes on every rank) cannot take
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
            moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)],
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )  # fmt: skip
    return TransformerConfig(
        **moe,
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=_ACTIVATIONS[cfg.hidden_act], add_bias_linear=cfg.o_bias,
        add_qkv_bias=cfg.qkv_bias, qk_layernorm=cfg.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        # Initialisation also sets the TP attributes of each parameter (`tensor_model_parallel`, which grad-norm
        # and checkpointing read): without it megatron takes every TP shard for a replica. The values are then
        # overwritten with the checkpoint's.
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        # the fused kernels are CUDA-only; off, the same math runs in torch
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
    )  # fmt: skip


def build_gpt(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32) -> GPTModel:
    """A randomly initialised `GPTModel` (this rank's TP shard; on the current GPU, else the CPU) for `cfg`; fill it
    with `load_hf_weights`."""
    tcfg = transformer_config(cfg, dtype=dtype)
    spec = get_gpt_layer_local_spec(num_experts=tcfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=tcfg.qk_layernorm, normalization="RMSNorm")  # fmt: skip
    if cfg.num_experts:  # dense and MoE layers mixed (`moe_layer_freq`): one spec per layer
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return GPTModel(
        config=tcfg, transformer_layer_spec=spec, vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta), rotary_percent=cfg.partial_rotary_factor,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        parallel_output=False,
    )  # fmt: skip


def load_hf_weights(model: GPTModel, cfg: ModelConfig, path: str | Path) -> None:
    """Fill this rank's shards from the HF checkpoint at `path` (read whole on every rank; checked against the
    model's shapes, naming the tensor)."""
    hf = dict(iter_hf_tensors(load_pretrained(path, dtype=torch.float32, device="cpu")))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    ep, ep_rank = _expert_layout()
    params = dict(model.named_parameters())
    tensors = {**dict(model.named_buffers()), **params}  # GLM's router bias is a buffer
    filled = set()
    for rule in mcore_rules(cfg):
        if rule.expert is not None and rule.owner(cfg.num_experts, ep) != ep_rank:
            continue  # another expert-parallel rank's expert
        name = rule.mcore_name(cfg.num_experts, ep)
        shard = to_mcore(rule, hf, cfg, rank, tp)
        if name not in tensors:
            raise KeyError(f"megatron model has no {name} (from {', '.join(rule.hf)})")
        target = tensors[name]
        if target.shape != shard.shape:
            raise ValueError(f"{name}: megatron shard {tuple(target.shape)} vs mapped {tuple(shard.shape)} "
                             f"from {', '.join(rule.hf)}")  # fmt: skip
        with torch.no_grad():
            target.copy_(shard)
        filled.add(name)
    unfilled = set(params) - filled
    if unfilled:
        raise KeyError(f"megatron parameters with no HF source: {sorted(unfilled)}")


def wrap_ddp(model: GPTModel, *, distributed_optimizer: bool = False) -> DistributedDataParallel:
    """megatron's data-parallel wrapper: gradients accumulate in fp32 buffers (`param.main_grad`) and are reduced
    over the data-parallel group by `finalize_grads`."""
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)


def finalize_grads(model: DistributedDataParallel) -> None:
    """After the last backward of a step: data-parallel reduction, and the sums over TP ranks that replicated
    parameters computed in pieces (QK layernorms see only their rank's heads); megatron's own `finalize_model_grads`."""
    finalize_model_grads([model])


def _meta_model(cfg: ModelConfig) -> CausalLM:
    """Our model for `cfg` on the meta device: HF names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(cfg)


def _router(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE router of a decoder layer, None for a dense layer."""
    return getattr(layer.mlp, "router", None)


def _expert_layout() -> tuple[int, int]:
    """(expert-parallel size, this rank's index in it)."""
    return parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()


def full_hf_state(model: GPTModel, cfg: ModelConfig, *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) in `iter_hf_tensors` order, gathered over the TP group (a collective: every TP rank
    iterates to the end). Every rank yields the same tensors. `grads`: the parameters' gradients instead (HF-named,
    to compare with another backend's)."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep, _ = _expert_layout()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    def local(name: str) -> torch.Tensor:
        if name not in params:  # a frozen buffer (GLM's router bias): no gradient, zeros in its place
            return torch.zeros_like(buffers[name]) if grads else buffers[name].detach()
        p = params[name]
        g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad  # under wrap_ddp: main_grad
        if grads and g is None:
            raise RuntimeError(f"{name} has no gradient: run backward first")
        return (g if grads else p).detach().contiguous()

    def gather(rule: Rule) -> list[torch.Tensor]:
        mine = local(rule.mcore_name(cfg.num_experts, ep))
        if rule.expert is not None:  # whole on its owner: every EP rank sends the same local index, keep the owner's
            # TODO(scale): one collective per expert tensor; gather a layer's experts at once for real models.
            if ep == 1:
                return [mine]
            parts = [torch.empty_like(mine) for _ in range(ep)]
            torch.distributed.all_gather(parts, mine, group=parallel_state.get_expert_model_parallel_group())
            return [parts[rule.owner(cfg.num_experts, ep)]]
        if tp == 1:
            return [mine]
        parts = [torch.empty_like(mine) for _ in range(tp)]
        torch.distributed.all_gather(parts, mine, group=group)
        return parts

    yield from iter_full_hf(cfg, gather)


def packed_logits(model: GPTModel, mb: PackedMicroBatch, vocab_size: int) -> torch.Tensor:
    """Logits [1, T, vocab] of a packed micro-batch: one row, block-diagonal causal mask (True = masked, megatron's
    convention), the vocabulary padding cut off."""
    t = mb.num_tokens
    seq = mb.seq_ids.to(mb.input_ids.device)
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(t, t, dtype=torch.bool, device=seq.device).tril()
    positions = torch.arange(t, device=mb.input_ids.device)[None]
    logits = model(mb.input_ids, positions, attention_mask=~allowed[None, None])
    return logits[..., :vocab_size]


class _Replay(RouterReplay):
    """R3 in one megatron MoE layer, through megatron's router-replay hook: where a token has a recorded expert
    choice (`record` [T, k]; rows of -1: none) it replaces megatron's top-k and the gate weights are recomputed
    from the current router scores at those ids (megatron's replay path: the softmax over the k gathered logits);
    tokens without a record keep the live choice. With `compare`, the live choice is kept everywhere and only the
    agreement is counted. `stats`: (recorded, agreeing, tokens), as our model's `replay_stats`."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # held by its router, not megatron's global list
        self.num_experts = num_experts
        self.record: torch.Tensor | None = None
        self.compare = False
        self.stats: torch.Tensor | None = None

    def get_replay_topk(  # megatron's signature
        self, scores: torch.Tensor, topk: int, num_groups: int | None = None, group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        probs, live = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.record is None:
            return probs, live
        ids, stats = merge_replay(self.record, live, self.num_experts, self.compare)
        self.stats = stats if self.stats is None else self.stats + stats
        return (probs, live) if ids is live else (scores.gather(1, ids), ids)


class MegatronTrainer(PackedTrainer):
    """One rank of the megatron-core trainer. Construct on every rank after `init_trainer_world`; all methods are
    collectives (see `miles_hpc.train.protocol.Trainer`). Ranks r*TP .. r*TP+TP-1 form tensor-parallel group r,
    which is data-parallel rank r."""

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
        for name in ("pipeline_parallel", "context_parallel"):
            if getattr(megatron_cfg, name) != 1:
                raise NotImplementedError(f"megatron.{name}={getattr(megatron_cfg, name)}: only 1 is supported so far")
        if train_cfg.activation_checkpointing or train_cfg.compile:
            raise NotImplementedError("train.activation_checkpointing / train.compile: not with the megatron backend "
                                      "yet")  # fmt: skip
        if not torch.distributed.is_initialized():
            raise RuntimeError("MegatronTrainer needs the trainer process group: call dist.init_trainer_world first")
        self.train_cfg, self.algo_cfg, self.loss_fn = train_cfg, algo_cfg, loss_fn
        self.device = torch.device(device)
        self._rank, self._world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        init_model_parallel(megatron_cfg.tensor_parallel, megatron_cfg.expert_parallel, seed=seed)
        self._dp_rank = parallel_state.get_data_parallel_rank()
        self._dp_world = parallel_state.get_data_parallel_world_size()
        self._dp_group = parallel_state.get_data_parallel_group()
        self._gathers_logprobs = parallel_state.get_tensor_model_parallel_rank() == 0
        # every rank's (TP rank, EP rank): what each holds, for the p2p sync's shard map
        coords = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank())
        self._coords: list[tuple[int, int]] = [coords] * self._world
        if self._world > 1:
            torch.distributed.all_gather_object(self._coords, coords)
        self._step, self._last_lr, self._r3 = 0, train_cfg.lr, None
        torch.manual_seed(seed)
        self.config = read_config(model_path)
        bf16 = train_cfg.mixed_precision and self.device.type == "cuda"
        model = build_gpt(self.config, dtype=torch.bfloat16 if bf16 else torch.float32)
        load_hf_weights(model, self.config, model_path)
        # R3: every MoE layer's router consults its replay (megatron's hook), in layer order = the records' order
        self._replays = [_Replay(self.config.num_experts) for layer in model.decoder.layers if _router(layer)]
        for layer, replay in zip([layer for layer in model.decoder.layers if _router(layer)], self._replays):
            _router(layer).router_replay = replay
        self.model = wrap_ddp(model.to(self.device), distributed_optimizer=megatron_cfg.distributed_optimizer)
        self.model.train()
        self._lr_at = lr_lambda(train_cfg, total_steps)
        if self.device.type == "cuda":
            opt = OptimizerConfig(
                optimizer="adam", lr=train_cfg.lr, weight_decay=train_cfg.weight_decay,
                adam_beta1=train_cfg.adam_betas[0], adam_beta2=train_cfg.adam_betas[1], adam_eps=train_cfg.adam_eps,
                clip_grad=train_cfg.grad_clip, bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
                use_distributed_optimizer=megatron_cfg.distributed_optimizer,
            )  # fmt: skip
            self.optimizer: Any = get_megatron_optimizer(opt, [self.model])
        else:
            # megatron's optimizers are CUDA-only (CUDA tensor type checks, CUDA scalars): on the CPU (tests) the
            # same AdamW as the FSDP backend over this rank's shards, fed megatron's reduced gradients.
            if megatron_cfg.distributed_optimizer:
                raise ValueError("megatron.distributed_optimizer needs CUDA (megatron's optimizer is CUDA-only); "
                                 "set megatron.distributed_optimizer=false on the CPU")  # fmt: skip
            self.optimizer = build_optimizer(train_cfg, self.model.module.named_parameters(), self.device)

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self.train_cfg.lr * self._lr_at(self._step)

    def _forward(
        self, mb: PackedMicroBatch, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        for j, replay in enumerate(self._replays):
            replay.record = None if mb.routing is None else mb.routing[0, :, j, :]
            replay.compare = not self.algo_cfg.routing_replay
        logits = packed_logits(self.model, mb, self.config.vocab_size)
        if mb.routing is not None and self._replays:
            stats = torch.stack([r.stats for r in self._replays if r.stats is not None]).sum(0)
            for replay in self._replays:
                replay.stats = None
            self._r3 = stats if self._r3 is None else self._r3 + stats
        return token_logprobs(logits, mb, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def _clip_and_step(self) -> torch.Tensor:
        finalize_grads(self.model)
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
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._step += 1
        return torch.as_tensor(float(norm) if norm is not None else 0.0)

    def _clip_cpu(self) -> float:
        """The CPU optimizer's half of megatron's step: gradients from the fp32 buffers, the global norm with
        replicated (non-TP) parameters counted once, clipping by `train.grad_clip`."""
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        sq, sq_experts = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        grads = []
        for p in self.model.module.parameters():
            p.grad = p.main_grad
            grads.append(p.grad)
            if getattr(p, "allreduce", True):  # dense: TP shards count everywhere, TP replicas on TP rank 0
                if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
                    sq += p.grad.double().pow(2).sum()
            elif tp_rank == 0:  # an expert: whole (expert TP 1), distinct on each expert-parallel rank
                sq_experts += p.grad.double().pow(2).sum()
        torch.distributed.all_reduce(sq_experts, group=parallel_state.get_expert_model_parallel_group())
        sq += sq_experts
        torch.distributed.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        norm = float(sq.sqrt())
        clip = self.train_cfg.grad_clip
        if clip > 0 and norm > clip:
            torch._foreach_mul_(grads, clip / (norm + 1e-6))
        return norm

    # ------------------------------------------------------------------ weights out
    def state_for_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in `iter_hf_tensors` order, gathered over the TP group one megatron tensor at a
        time; every rank yields the same tensors (data-parallel replicas hold the same weights)."""
        yield from full_hf_state(self.model.module, self.config)

    def shard_map(self) -> ShardMap:
        """What every rank holds of each HF tensor (its TP rows/columns, its experts) and this rank's data, for the
        p2p sync (no collective: the ranks' coordinates were gathered at construction)."""
        cfg = self.config
        tp, ep = parallel_state.get_tensor_model_parallel_world_size(), _expert_layout()[0]
        tp_rank, ep_rank = self._coords[self._rank]
        shapes = {n: tuple(t.shape) for n, t in iter_hf_tensors(_meta_model(cfg))}
        params = {**dict(self.model.module.named_buffers()), **dict(self.model.module.named_parameters())}
        layout: dict[str, list[Box]] = {n: [] for n in shapes}
        local: dict[str, torch.Tensor] = {}
        for rule in mcore_rules(cfg):
            for t_rank, e_rank in self._coords:
                for name, box in mcore_boxes(rule, shapes, cfg, t_rank, tp, e_rank, ep).items():
                    layout[name].append(box)
            if rule.expert is None or rule.owner(cfg.num_experts, ep) == ep_rank:
                mine = params[rule.mcore_name(cfg.num_experts, ep)].detach()
                local.update((n, t) for n, t in local_hf_parts(rule, mine, cfg, tp_rank, tp).items()
                             if not layout[n][self._rank].empty)  # fmt: skip
        return ShardMap(shapes, {n: tuple(b) for n, b in layout.items()}, local)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """megatron's `dist_checkpointing` of the model and optimizer (each rank writes its shards; the optimizer
        in the fully reshardable layout, meant for resuming on another data-parallel size), plus our step, RNG and
        the loop's state (`train/checkpoint.py`). CUDA only: megatron's checkpoint writers are. `load` does not
        work yet (see there)."""
        self._need_cuda("save")

        def write_state(tmp: Path) -> None:
            (tmp / "mcore").mkdir(exist_ok=True)  # every rank: no rank waits on a directory another makes
            dist_checkpointing.save(self._sharded_state(), str(tmp / "mcore"))
            if self._rank == 0:
                layout = {"step": self._step, "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
                          "data_parallel": self._dp_world}  # fmt: skip
                (tmp / "megatron.json").write_text(json.dumps(layout) + "\n")

        return ckpt.write_checkpoint(path, step=self._step, extra=extra or {}, backend="megatron",
                                     write_state=write_state)  # fmt: skip

    def load(self, path: str | Path) -> dict[str, Any]:
        # Measured on an H200 (megatron-core 0.19.2, torch Adam: no Apex/TE): `save` writes the checkpoint, but
        # building the optimizer's loading state dict fails on a fresh trainer (megatron reads Adam's `step`,
        # which torch creates at the first step; after a zero-gradient step first, the fully_reshardable load
        # then fails on that `step` key). Until that is solved, refuse clearly instead of failing inside megatron.
        raise NotImplementedError(
            f"{path}: resuming the megatron backend from its checkpoint does not work yet (megatron-core's optimizer "
            "state restore without Apex/Transformer Engine; docs/megatron.md). Start afresh with resume=false (the "
            "saved weights stay under mcore/, in megatron's dist_checkpointing format)"
        )

    def _sharded_state(self) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()
        optim_sd = self.optimizer.sharded_state_dict(
            model_sd, is_loading=False, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
        )
        return {"model": model_sd, "optimizer": optim_sd}

    def _need_cuda(self, verb: str) -> None:
        if self.device.type != "cuda":
            raise NotImplementedError(f"megatron {verb}: megatron's dist_checkpointing writers are CUDA-only; "
                                      "megatron runs on GPUs (the CPU path exists for tests)")  # fmt: skip
