"""megatron-core's `GPTModel` for our HF model configs (stage: train; docs/design.md section 5): parallel state, the
`TransformerConfig` and layer spec, HF weights into each rank's shards and back, packed micro-batches, R3's replay
hook. `train/megatron.py`'s `MegatronTrainer` trains it.

Invariants:
- The model is megatron's own `GPTModel` with the local layer spec (no Transformer Engine needed); our code only
  maps configs and weights (`train/mcore_weights.py`, MLA: `train/mcore_mla.py`) and feeds it.
- Packed micro-batches (`train/logprobs.PackedMicroBatch`: sequences concatenated, no padding) run as one row with
  a block-diagonal causal mask, so no token attends across sequences. Megatron's RoPE indexes the row by absolute
  position, not by our per-sequence `position_ids`; inside a sequence only position differences enter the scores,
  so the result is the per-sequence one (a test checks it against our model).
- Logits are gathered over tensor-parallel ranks and the vocabulary padding is dropped before any softmax.
- The DSA indexers (unless `train.indexer_loss_coef` trains them) and the multi-token-prediction layers
  (`mcore_weights.is_frozen`) are held frozen, as our model gives them no gradient: loaded, saved and synced,
  never updated (MTP: never run, `mcore_mla.held_mtp_block`).
- Pipeline stages hold their layers under local indices (`train/mcore_pipeline.StageLayout`), in `vpp` model
  chunks each under virtual pipeline stages (`build_chunks`; one chunk without); loading, gathering and the p2p
  shard map translate. Functions that take a model take one chunk or the list of a rank's chunks.
- megatron-core's forward calls CUDA-only helpers (a global buffer on `torch.cuda.current_device()`, the CUDA RNG
  tracker, the MoE dispatcher's side stream): the CPU tests patch those in tests/ (never here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

try:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel.random import is_checkpointing
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "train.backend=megatron needs megatron-core: pip install 'miles-hpc[megatron]' (megatron-core 0.16 on "
        "Python 3.11, newer releases on 3.12)"
    ) from e

from miles_hpc.models import CausalLM, ModelConfig, iter_hf_tensors, load_pretrained
from miles_hpc.models.moe import merge_replay
from miles_hpc.planner.mcore_layout import layout_limits
from miles_hpc.train import mcore_fixes  # noqa: F401  (megatron-core 0.16's TE-less fixes, at import)
from miles_hpc.train.logprobs import PackedMicroBatch
from miles_hpc.train.mcore_attention import PackedCoreAttention, packed_mask, packs_attention, replace_core_attention
from miles_hpc.train.mcore_cp import context_parallel, cp_core_attention, cp_rows, row_layout
from miles_hpc.train.mcore_dsa import check_dsa_pipeline, dsa_core_attention, dsa_kwargs, share_selections
from miles_hpc.train.mcore_mla import (
    KVDownGather,
    held_mtp_block,
    local_mla_spec,
    mla_kwargs,
)
from miles_hpc.train.mcore_pipeline import StageLayout
from miles_hpc.train.mcore_sp import experts_reduce_over_tp, sequence_parallel, sp_length, sp_norms
from miles_hpc.train.mcore_weights import Rule, is_frozen, iter_full_hf, mcore_rules, padded_vocab_size, to_mcore

__all__ = [
    "R3Replay",
    "build_chunks",
    "build_gpt",
    "chunks_of",
    "expert_layout",
    "finalize_grads",
    "full_hf_state",
    "init_model_parallel",
    "load_hf_weights",
    "meta_model",
    "moe_router",
    "packed_logits",
    "pipeline_stage",
    "stage_layout",
    "transformer_config",
    "wrap_ddp",
]

Recompute = Literal["full", "selective"] | None  # megatron activation recompute (`transformer_config`)


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu}


def init_model_parallel(
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    *,
    pipeline_parallel: int = 1,
    context_parallel: int = 1,
    virtual_pipeline: int = 1,
    seed: int = 0,
) -> None:
    """megatron's parallel state over the default process group (which must exist): TP groups of
    `tensor_parallel` consecutive ranks, then `context_parallel` (CP), then data parallel, then `pipeline_parallel`
    stages (megatron's rank order tp-cp-ep-dp-pp: stage s is ranks s*W/P .. (s+1)*W/P - 1), each of
    `virtual_pipeline` model chunks (megatron's interleaved schedule); MoE experts split over
    `expert_parallel` of the TP x CP x DP ranks (expert TP 1); on GPUs also megatron's per-TP-rank CUDA RNG states
    (`seed`)."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("megatron needs the trainer process group: call dist.init_trainer_world first")
    world = torch.distributed.get_world_size()
    if world % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(
            f"megatron.tensor_parallel={tensor_parallel} x megatron.pipeline_parallel={pipeline_parallel} x "
            f"megatron.context_parallel={context_parallel} does not divide the {world} trainer ranks"
        )
    stage = world // pipeline_parallel  # TP x CP x DP: the ranks experts split over (expert TP 1)
    if stage % expert_parallel:
        raise ValueError(
            f"megatron.expert_parallel={expert_parallel} does not divide the {stage} ranks of a pipeline stage "
            f"(TP x CP x DP)"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        context_parallel_size=context_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline if virtual_pipeline > 1 else None,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
    )
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)


def transformer_config(
    cfg: ModelConfig, *, dtype: torch.dtype = torch.float32, recompute: Recompute = None
) -> TransformerConfig:
    """megatron's `TransformerConfig` for our model config (after `init_model_parallel`). Raises, naming the
    field, for what the mapping does not cover yet. Long: a field-by-field map, one entry per megatron field.
    `recompute`: megatron's activation recompute, "full" (one layer at a time: each layer keeps only its input) or
    "selective" (its `core_attn`: the attention's scores and softmax, the largest saved tensors of the unfused
    local attention, are recomputed); None: off."""
    mcore_rules(cfg)  # the family check, with its message
    if cfg.rope_scaling is not None and not cfg.is_mla:  # MLA's yarn: `mla_kwargs`
        raise NotImplementedError(f"megatron backend: rope_scaling {cfg.rope_scaling.rope_type!r} is not mapped yet")
    if cfg.hidden_act not in _ACTIVATIONS:
        raise NotImplementedError(f"megatron backend: hidden_act {cfg.hidden_act!r} is not mapped yet")
    if cfg.o_bias != cfg.mlp_bias:
        raise NotImplementedError(
            f"megatron backend: {cfg.model_type} with attention_bias={cfg.o_bias} and mlp_bias={cfg.mlp_bias}: "
            "megatron has one bias switch (add_bias_linear) for the attention output and the MLP"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    moe: dict[str, Any] = {}
    # (a deepseek_v3 config may have experts configured and only dense layers; MTP layers count: they are built)
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)):
        # megatron runs MoE under TP with sequence parallelism only: each TP rank holds T / tp tokens between the
        # attention and MLP blocks (the packed row is padded to a multiple of tp: `packed_logits`), and routes and
        # dispatches those; the experts are whole on each TP rank (expert TP 1), split by expert_parallel.
        sequence_parallel = tp > 1
        if cfg.num_experts % parallel_state.get_expert_model_parallel_world_size():
            raise ValueError(f"megatron.expert_parallel does not divide num_experts={cfg.num_experts}")
        # Qwen3-MoE routing: softmax over all experts then top-k, renormalised when norm_topk_prob; megatron's
        # top-k over the logits then softmax over the k is that renormalised form, pre-softmax the other.
        group: dict[str, Any] = {}
        if cfg.group_router:
            # GLM-4.5: sigmoid scores, top-k of scores + the (frozen) correction bias within the best groups, gate =
            # the scores at those ids, renormalised, times routed_scaling_factor; shared experts beside.
            if not cfg.norm_topk_prob:
                raise NotImplementedError(
                    "megatron backend: a sigmoid router without norm_topk_prob (megatron "
                    "always renormalises sigmoid gates)"
                )
            if cfg.n_group > 1 and cfg.num_experts_per_tok // cfg.topk_group != 2:
                raise NotImplementedError(
                    f"megatron backend: groups scored by their top {cfg.num_experts_per_tok} "
                    f"// {cfg.topk_group} experts, where the model sums its top 2"
                )
            group = dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,
                moe_router_topk_scaling_factor=cfg.routed_scaling_factor,
                moe_router_num_groups=cfg.n_group if cfg.n_group > 1 else None,
                moe_router_group_topk=cfg.topk_group if cfg.n_group > 1 else None,
                moe_shared_expert_intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts or None,
            )
        moe = dict(
            num_moe_experts=cfg.num_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_router_pre_softmax=not cfg.norm_topk_prob,
            # router logits in the activations' dtype, as transformers computes them (softmax in fp32 after)
            moe_router_load_balancing_type="none",
            **{"moe_router_score_function": "softmax", **group},
            # all-to-all: data-parallel ranks hold packed micro-batches of different lengths, which the all-gather
            # dispatcher (equal shapes on every rank) cannot take
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers)],
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            sequence_parallel=sequence_parallel,
        )
    attention = (
        {**mla_kwargs(cfg), **(dsa_kwargs(cfg) if cfg.is_dsa else {})}
        if cfg.is_mla
        else dict(
            num_query_groups=cfg.num_key_value_heads,
            kv_channels=cfg.head_dim,
            add_qkv_bias=cfg.qkv_bias,
            qk_layernorm=cfg.qk_norm,
        )
    )
    tcfg = (MLATransformerConfig if cfg.is_mla else TransformerConfig)(
        **moe,
        **attention,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[cfg.hidden_act],
        add_bias_linear=cfg.o_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        # megatron refuses CP with its DSA attention (transformer_config.py __post_init__); the DSA core attention
        # here does CP itself (`mcore_dsa`): the size is set after the checks
        context_parallel_size=1 if cfg.is_dsa else cp,
        **_pipeline_kwargs(cfg, dtype),
        **_recompute_kwargs(cfg, recompute),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Initialisation also sets the TP attributes of each parameter (`tensor_model_parallel`, which grad-norm
        # and checkpointing read): without it megatron takes every TP shard for a replica. The values are then
        # overwritten with the checkpoint's.
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=True,
        # the fused kernels are CUDA-only; off, the same math runs in torch
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )
    tcfg.context_parallel_size = cp
    return tcfg


def _recompute_kwargs(cfg: ModelConfig, recompute: Recompute) -> dict[str, Any]:
    if problems := layout_limits(cfg, recompute=recompute):
        raise NotImplementedError(problems[0])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute is not None:
        raise ValueError(f"recompute: full, selective or None, got {recompute!r}")
    return {}


def _pipeline_kwargs(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig fields for pipeline stages: their number, the dtype of the hidden states they exchange, and
    `variable_seq_lengths` (packed micro-batches differ in length: megatron sends each tensor's shape first)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return {}
    layout = stage_layout(cfg)  # checks the split
    if cfg.is_dsa:
        check_dsa_pipeline(cfg, layout)
    out = dict(pipeline_model_parallel_size=pp, pipeline_dtype=dtype, variable_seq_lengths=True)
    if layout.vpp > 1:
        out["virtual_pipeline_model_parallel_size"] = layout.vpp
    if not cfg.num_experts:  # megatron checks the (unused) dispatcher against variable lengths; MoE sets alltoall
        out["moe_token_dispatcher_type"] = "alltoall"
    return out


def stage_layout(cfg: ModelConfig) -> StageLayout:
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return StageLayout(pp, cfg.num_hidden_layers, cfg.tie_word_embeddings, vpp)


def chunks_of(model: Any) -> list[Any]:
    """A rank's model chunks: `model` itself when it is one (a GPTModel or its DDP wrapper), else the list."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrap(model: Any) -> GPTModel:
    """The GPTModel inside megatron's DDP wrapper."""
    return getattr(model, "module", model)


def pipeline_stage() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


def build_chunks(cfg: ModelConfig, **kwargs: Any) -> list[GPTModel]:
    """This rank's model chunks: one `build_gpt` per virtual pipeline stage (one without them)."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt(cfg, **kwargs)]
    return [build_gpt(cfg, vp_stage=v, **kwargs) for v in range(vpp)]


def build_gpt(
    cfg: ModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    train_indexers: bool = False,
    recompute: Recompute = None,
    vp_stage: int | None = None,
) -> GPTModel:
    """A randomly initialised `GPTModel` (this rank's TP shard; on the current GPU, else the CPU) for `cfg`; fill it
    with `load_hf_weights`. `train_indexers`: the DSA indexers get gradients (the indexer loss), else frozen.
    `recompute`: activation recompute, "full" or "selective" (`transformer_config`). `vp_stage`: the virtual
    pipeline chunk to build (`build_chunks`; None without virtual stages)."""
    tcfg = transformer_config(cfg, dtype=dtype, recompute=recompute)
    spec = get_gpt_layer_local_spec(
        num_experts=tcfg.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=tcfg.qk_layernorm,
        multi_latent_attention=cfg.is_mla,
        normalization="RMSNorm",
    )
    # dense and MoE layers mixed (`moe_layer_freq`), or DSA's full and shared layers: one spec per layer
    if tcfg.num_moe_experts or cfg.is_dsa:
        spec = get_gpt_decoder_block_spec(
            tcfg, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
        )
    if tcfg.sequence_parallel:
        spec = sp_norms(spec)
    core_attention = dsa_core_attention if cfg.is_dsa else None
    if cfg.is_mla:
        first = stage_layout(cfg).layer_index(pipeline_stage(), 0, vp_stage or 0)
        spec = local_mla_spec(spec, cfg, first, core_attention)
    spec = _core_attention(tcfg, spec, cfg.is_dsa)  # after MLA's spec: its core attention too
    tp = parallel_state.get_tensor_model_parallel_world_size()
    model = GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(cfg.vocab_size, tp),
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        rotary_percent=cfg.partial_rotary_factor,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        parallel_output=False,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )
    model.miles_packed_attention = packs_attention(tcfg, cfg.is_dsa)  # `packed_logits` passes bounds, no mask
    if tcfg.sequence_parallel:
        experts_reduce_over_tp(model)
    if cfg.is_mla and tp > 1:
        for layer in model.decoder.layers:
            hook = KVDownGather(cfg.kv_lora_rank, sequence_parallel=tcfg.sequence_parallel)
            layer.self_attention.linear_kv_down_proj.register_forward_hook(hook)
    if cfg.is_dsa:
        share_selections(model.decoder)
    if cfg.num_nextn_predict_layers and model.post_process:
        spec_for = lambda s: _spec_for(tcfg, s, cfg.is_dsa)  # noqa: E731
        model.mtp = held_mtp_block(cfg, tcfg, core_attention, spec_for, vp_stage=vp_stage)  # held, not run
        for mtp_layer in model.mtp.layers if cfg.is_dsa else []:
            share_selections(mtp_layer)
    for name, p in model.named_parameters():
        if is_frozen(name, train_indexers=train_indexers):  # the indexers and MTP layers: as in our model
            p.requires_grad_(False)
    return model


def chunk_tensors(model: Any) -> list[dict[str, torch.Tensor]]:
    """Per model chunk of `model` (`chunks_of`), its parameters and buffers by name (GLM's router bias is a buffer)."""
    out = []
    for chunk in chunks_of(model):
        m = _unwrap(chunk)
        out.append({**dict(m.named_buffers()), **dict(m.named_parameters())})
    return out


def load_hf_weights(model: Any, cfg: ModelConfig, path: str | Path) -> None:
    """Fill this rank's shards (of one chunk or the list of its chunks) from the HF checkpoint at `path` (read whole
    on every rank; checked against the model's shapes, naming the tensor)."""
    hf = dict(iter_hf_tensors(load_pretrained(path, dtype=torch.float32, device="cpu")))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    ep, ep_rank = expert_layout()
    tensors = chunk_tensors(model)
    layout, stage = stage_layout(cfg), pipeline_stage()
    filled: set[tuple[int, str]] = set()
    for rule in mcore_rules(cfg):
        if rule.expert is not None and rule.owner(cfg.num_experts, ep) != ep_rank:
            continue  # another expert-parallel rank's expert
        names = layout.copies(rule.mcore_name(cfg.num_experts, ep), stage)  # [] on another pipeline stage
        shard = to_mcore(rule, hf, cfg, rank, tp) if names else None
        for chunk, name in names:
            if name not in tensors[chunk]:
                raise KeyError(f"megatron model chunk {chunk} has no {name} (from {', '.join(rule.hf)})")
            target = tensors[chunk][name]
            if target.shape != shard.shape:
                raise ValueError(
                    f"{name}: megatron shard {tuple(target.shape)} vs mapped {tuple(shard.shape)} "
                    f"from {', '.join(rule.hf)}"
                )
            with torch.no_grad():
                target.copy_(shard)
            filled.add((chunk, name))
    params = {(c, n) for c, chunk in enumerate(chunks_of(model)) for n, _ in _unwrap(chunk).named_parameters()}
    if unfilled := params - filled:
        raise KeyError(f"megatron parameters (chunk, name) with no HF source: {sorted(unfilled)}")


def wrap_ddp(
    model: GPTModel, *, distributed_optimizer: bool = False, fp32_grads: bool = True, bucketing: bool = True
) -> DistributedDataParallel:
    """megatron's data-parallel wrapper: gradients accumulate in fp32 buffers (`param.main_grad`; in the weights'
    dtype with `fp32_grads=False`) and are reduced over the data-parallel group by `finalize_grads`. Chunks after
    the first of virtual pipeline stages reduce in one bucket (`bucketing=False`), as megatron's training does."""
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=distributed_optimizer
    )
    return DistributedDataParallel(
        config=model.config, ddp_config=ddp_cfg, module=model, disable_bucketing=not bucketing
    )


def finalize_grads(model: Any) -> None:
    """After the last backward of a step: data-parallel reduction, and the sums over TP ranks that replicated
    parameters computed in pieces (QK layernorms see only their rank's heads); megatron's own `finalize_model_grads`
    over the rank's chunks (`chunks_of`: it also sums the tied embedding's gradients of the first and last)."""
    finalize_model_grads(chunks_of(model))


def meta_model(cfg: ModelConfig) -> CausalLM:
    """Our model for `cfg` on the meta device: HF names and shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(cfg)


def moe_router(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The MoE router of a decoder layer, None for a dense layer."""
    return getattr(layer.mlp, "router", None)


def expert_layout() -> tuple[int, int]:
    """(expert-parallel size, this rank's index in it)."""
    return parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()


def full_hf_state(model: Any, cfg: ModelConfig, *, grads: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) in `iter_hf_tensors` order, gathered over the TP group and broadcast from the pipeline
    stage that holds it (a collective: every rank iterates to the end). Every rank yields the same tensors. `grads`:
    the parameters' gradients instead (HF-named, to compare with another backend's). `model`: one chunk or the
    rank's list (`chunks_of`)."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep, _ = expert_layout()
    chunks = [_unwrap(c) for c in chunks_of(model)]
    params = [dict(c.named_parameters()) for c in chunks]

    def local(name: str, chunk: int = 0) -> torch.Tensor:
        if name not in params[chunk]:  # a frozen buffer (GLM's router bias): no gradient, zeros in its place
            buffer = dict(chunks[chunk].named_buffers())[name]
            return torch.zeros_like(buffer) if grads else buffer.detach()
        p = params[chunk][name]
        if grads and not p.requires_grad:  # frozen (`is_frozen`): likewise
            return torch.zeros_like(p.detach())
        g = getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad  # under wrap_ddp: main_grad
        if grads and g is None:
            raise RuntimeError(f"{name} has no gradient: run backward first")
        return (g if grads else p).detach().contiguous()

    def gather_stage(rule: Rule, name: str, chunk: int = 0) -> list[torch.Tensor]:
        mine = local(name, chunk)
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

    layout, stage = stage_layout(cfg), pipeline_stage()
    if layout.pp == 1:
        yield from iter_full_hf(cfg, lambda rule: gather_stage(rule, rule.mcore_name(cfg.num_experts, ep)))
        return
    # Pipeline stages: the owner gathers its TP shards, then broadcasts them over the pipeline group; the other
    # stages receive into tensors of the owner's shapes and dtypes (exchanged once here).
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    device = next(chunks[0].parameters()).device
    metas: list[Any] = [None] * layout.pp
    mine = {
        (c, n): (tuple(t.shape), local(n, c).dtype) for c, ts in enumerate(chunk_tensors(chunks)) for n, t in ts.items()
    }
    torch.distributed.all_gather_object(metas, mine, group=pp_group)

    def gather(rule: Rule) -> list[torch.Tensor]:
        name = rule.mcore_name(cfg.num_experts, ep)
        (owner, chunk), local_name = layout.place_of(name), layout.local_name(name)
        if owner == stage:
            parts = gather_stage(rule, local_name, chunk)
        else:
            shape, dtype = metas[owner][chunk, local_name]
            count = 1 if rule.expert is not None or tp == 1 else tp
            parts = [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        for t in parts:
            torch.distributed.broadcast(t, src=torch.distributed.get_global_rank(pp_group, owner), group=pp_group)
        return parts

    yield from iter_full_hf(cfg, gather)


def packed_logits(model: GPTModel, mb: PackedMicroBatch, vocab_size: int) -> torch.Tensor:
    """Logits [1, T, vocab] of a packed micro-batch: one row, block-diagonal causal mask (True = masked, megatron's
    convention), the vocabulary padding cut off (before the last pipeline stage: the stage's hidden states). Under
    sequence parallelism the row is padded to `sp_length` with tokens that attend to themselves only, and cut
    back. Under context parallelism: this CP rank's rows [1, padded / CP, vocab] of the row padded to
    `mcore_cp.row_layout` (`context_parallel.cp_token_logprobs` reads them)."""
    t = mb.num_tokens
    sp = sequence_parallel(model)
    cp = row_layout(t, sp) if context_parallel() > 1 else None  # the row split over the CP ranks (`mcore_cp`)
    padded = cp.padded if cp is not None else sp_length(t, sp)
    ids, seq = mb.input_ids, mb.seq_ids.to(mb.input_ids.device)
    if padded > t:  # each pad token its own sequence (ids past every real one): no real token sees it
        pad = padded - t
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], pad)], dim=1)
        seq = torch.cat([seq, seq.max() + 1 + torch.arange(pad, device=seq.device, dtype=seq.dtype)])
    positions = torch.arange(padded, device=ids.device)[None]
    if getattr(_unwrap(model), "miles_packed_attention", False):  # the bounds, the pads one-token sequences
        mask = packed_mask(torch.cat([mb.cu_seqlens.to(torch.int64), torch.arange(t + 1, padded + 1)]))
    else:
        allowed = (seq[:, None] == seq[None, :]) & torch.ones(
            padded, padded, dtype=torch.bool, device=seq.device
        ).tril()
        mask = ~allowed[None, None]
    if cp is not None:  # this CP rank's tokens; the mask stays the whole row's
        ids, positions = cp_rows(ids[0], cp)[None], cp_rows(positions[0], cp)[None]
    logits = model(ids, positions, attention_mask=mask)
    if not _unwrap(model).post_process:
        return logits  # hidden states [T, 1, hidden] for the next pipeline stage (T padded under SP; local under CP)
    return logits[..., :vocab_size] if cp is not None else logits[:, :t, :vocab_size]


def _spec_for(tcfg: TransformerConfig, spec: Any, dsa: bool) -> Any:
    """`spec` with the decoder's substitutions for `tcfg`: sequence-parallel norms, the core attention."""
    if tcfg.sequence_parallel:
        spec = sp_norms(spec)
    return _core_attention(tcfg, spec, dsa)


def _core_attention(tcfg: TransformerConfig, spec: Any, dsa: bool) -> Any:
    """megatron's local core attention replaced: by the CP one under context parallelism, else by SDPA over the
    packed row's sequences (`mcore_attention`; `packed_logits` passes the bounds). DSA's core attention stays."""
    if tcfg.context_parallel_size > 1:
        return cp_core_attention(spec)
    return replace_core_attention(spec, PackedCoreAttention) if packs_attention(tcfg, dsa) else spec


class R3Replay(RouterReplay):
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
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, live = default_compute_topk(scores, topk, num_groups, group_topk)
        if self.record is None:
            return probs, live
        ids, stats = merge_replay(self.record, live, self.num_experts, self.compare)
        if not (is_checkpointing() and torch.is_grad_enabled()):  # backward's recompute counts nothing again
            self.stats = stats if self.stats is None else self.stats + stats
        return (probs, live) if ids is live else (scores.gather(1, ids), ids)
