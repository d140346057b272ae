"""Does the configured trainer fit the training nodes? (stage: launch; `miles-hpc prepare`, docs/planning.md,
"Megatron layouts"). Megatron: the layout planner's figures (`planner/layouts.py`) for the run's model, layout,
memory options and micro-batch, against `slurm.gpu_memory_gb` and `slurm.host_memory_gb`. FSDP: `miles-hpc plan`'s
(`planner/estimate.py`): fully sharded states plus the activations of the largest micro-batch, `fsdp_batch`."""

from __future__ import annotations

from pathlib import Path

from miles_hpc.config import RunConfig
from miles_hpc.config.loader import ConfigError
from miles_hpc.planner.estimate import TrainBatch
from miles_hpc.planner.layouts import Batch, Candidate, Layout, MemoryOptions, Node, evaluate, search

__all__ = ["check_train_layout", "configured", "fsdp_batch"]


def configured(cfg: RunConfig) -> tuple[Layout, MemoryOptions, Batch]:
    """The run's megatron layout, memory options and micro-batch as the planner takes them."""
    m, t = cfg.megatron, cfg.train
    split = m.tensor_parallel * m.pipeline_parallel * m.context_parallel
    layout = Layout(
        tp=m.tensor_parallel,
        pp=m.pipeline_parallel,
        ep=m.expert_parallel,
        cp=m.context_parallel,
        dp=max(t.world_size // split, 1),
        vpp=m.virtual_pipeline,
    )
    opts = MemoryOptions(
        distributed_optimizer=m.distributed_optimizer,
        offload_fraction=m.optimizer_offload_fraction,
        precision_aware=m.precision_aware_optimizer,
        main_grads_bf16=m.main_grads_dtype == "bf16",
        recompute=m.recompute_granularity if t.activation_checkpointing else "none",
        mixed_precision=t.mixed_precision and t.device == "cuda",
    )
    return layout, opts, Batch(seq_len=t.max_tokens_per_microbatch, micro_batch=1)


def fsdp_batch(cfg: RunConfig) -> TrainBatch:
    """The FSDP trainer's largest micro-batch: one sequence of the longer of `train.max_tokens_per_microbatch` and a
    whole trajectory's generated tokens (`rollout.max_new_tokens`, times `rollout.max_turns` for an agent), since a
    trajectory longer than the budget is a micro-batch of its own (its prompt is not counted)."""
    r = cfg.rollout
    longest = r.max_new_tokens * (r.max_turns if r.agent else 1)
    return TrainBatch(
        seq_len=max(cfg.train.max_tokens_per_microbatch, longest),
        micro_batch=1,
        activation_checkpointing=cfg.train.activation_checkpointing,
    )


def check_fsdp_fit(cfg: RunConfig) -> str:
    """A line saying what was checked; raises ConfigError naming the keys when the FSDP trainer's states and its
    largest micro-batch's activations exceed `slurm.gpu_memory_gb`."""
    from miles_hpc.planner.accounting import ModelSpecError
    from miles_hpc.planner.estimate import Cluster, estimate

    if cfg.train.device != "cuda" or not cfg.slurm.gpu_memory_gb:
        return "train memory: not checked (a CPU trainer, or no slurm.gpu_memory_gb)"
    model = _model_config(cfg)
    if model is None:
        return f"train memory: not checked ({cfg.model.path}/config.json is not readable here)"
    batch, gpus = fsdp_batch(cfg), cfg.slurm.gpu_memory_gb
    cluster = Cluster(train_gpus=cfg.train.world_size, engines=1, engine_tp=1, gpu_mem_gb=gpus)
    try:
        mem = estimate(model, cluster, batch=batch)["memory"]
    except ModelSpecError as e:  # a config the planner cannot read (a missing field): said, not guessed
        return f"train memory: not checked ({e})"
    what = (
        f"{mem['train_total_per_gpu_gb']:.1f} GB per GPU: {mem['train_per_gpu_gb']:.1f} GB of states over "
        f"train.world_size={cfg.train.world_size} + {mem['train_activations_gb']:.1f} GB of activations of one "
        f"{batch.seq_len:,}-token micro-batch (train.activation_checkpointing={cfg.train.activation_checkpointing})"
    )
    if mem["train_fits"]:
        return f"train memory (FSDP): {what}, of {gpus:g}"
    need = mem["train_min_gpus"]
    more = f"train.world_size >= {need}" if need else "activation checkpointing or shorter sequences"
    raise ConfigError(
        f"the FSDP trainer does not fit slurm.gpu_memory_gb={gpus:g}: {what}; {more}, "
        "train.activation_checkpointing=true, or a smaller train.max_tokens_per_microbatch / rollout.max_new_tokens "
        "(miles-hpc plan CONFIG)"
    )


def _model_config(cfg: RunConfig) -> dict | None:
    import json

    if cfg.model.path is None:
        from miles_hpc.models.presets import preset_config

        return preset_config(cfg.model.init_arch, cfg.model.init_size)
    path = Path(cfg.model.path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_train_layout(cfg: RunConfig) -> str:
    """A line saying what was checked; raises ConfigError naming the keys when the megatron layout does not fit the
    training nodes (with the planner's best layout for the same GPUs). Nothing is checked for the FSDP backend, a
    CPU run, without `slurm.gpu_memory_gb`, or while the model's config.json is not readable here."""
    if cfg.train.backend != "megatron" or cfg.train.device != "cuda":
        return "train layout: not checked (FSDP or CPU trainer)"
    s = cfg.slurm
    if not s.gpu_memory_gb:
        return "train layout: not checked (set slurm.gpu_memory_gb and slurm.host_memory_gb to check it)"
    model = _model_config(cfg)
    if model is None:
        return f"train layout: not checked ({cfg.model.path}/config.json is not readable here)"
    gpus_per_node = s.gpus_per_node or max(cfg.train.world_size // s.train_nodes, 1)
    node = Node(
        name="slurm",
        gpus=gpus_per_node,
        gpu_mem_gb=s.gpu_memory_gb,
        host_mem_gb=s.host_memory_gb or float("inf"),
        source="slurm.gpu_memory_gb, slurm.host_memory_gb",
    )
    layout, opts, batch = configured(cfg)
    got = evaluate(model, layout, opts, batch, node)
    if got.fits:
        assert got.memory is not None
        return (
            f"train layout: {layout} fits: {got.memory.gpu / 1e9:.1f} GB per GPU of {s.gpu_memory_gb:g}, "
            f"{got.memory.optimizer_host * node.gpus / 1e9:.1f} GB of host memory per node"
        )
    raise ConfigError(_refusal(cfg, got, search(model, cfg.train.world_size, node, batch)))


def _refusal(cfg: RunConfig, got: Candidate, found: list[Candidate]) -> str:
    m = cfg.megatron
    keys = (
        f"megatron.tensor_parallel={m.tensor_parallel}, pipeline_parallel={m.pipeline_parallel}, "
        f"expert_parallel={m.expert_parallel}, optimizer_offload_fraction={m.optimizer_offload_fraction}, "
        f"precision_aware_optimizer={m.precision_aware_optimizer}, main_grads_dtype={m.main_grads_dtype}, "
        f"recompute_granularity={m.recompute_granularity}, "
        f"train.activation_checkpointing={cfg.train.activation_checkpointing}"
    )
    msg = f"the megatron layout does not fit the training nodes ({keys}): {'; '.join(got.problems)}"
    msg += f" (slurm.gpu_memory_gb={cfg.slurm.gpu_memory_gb:g}, slurm.host_memory_gb={cfg.slurm.host_memory_gb:g})"
    best = found[0] if found else None
    if best is not None and best.fits:
        o = best.options
        msg += (
            f"; the planner's best layout for {cfg.train.world_size} GPUs: {best.layout}, "
            f"optimizer_offload_fraction={o.offload_fraction}, precision_aware_optimizer={o.precision_aware}, "
            f"main_grads_dtype={'bf16' if o.main_grads_bf16 else 'fp32'}, "
            + (
                f"activation_checkpointing=true, recompute_granularity={o.recompute}"
                if o.recompute != "none"
                else "activation_checkpointing=false"
            )
            + " (miles-hpc plan CONFIG --layouts)"
        )
    else:
        msg += f"; no layout of {cfg.train.world_size} GPUs fits (miles-hpc plan CONFIG --layouts says by how much)"
    return msg
