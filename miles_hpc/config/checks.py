"""Cross-section checks of a run's config (stage: config): what one section's value rules out in another, each
refusal naming the key (`loader.require`). `RunConfig.__post_init__` calls them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_hpc.config.loader import require as _require

if TYPE_CHECKING:
    from miles_hpc.config.run import RunConfig

DSA_ARCHS = ("glm_moe_dsa", "deepseek_v32")  # DeepSeek sparse attention (an indexer per layer or per full layer)
HYBRID_ARCHS = ("qwen3_next", "qwen3_5_moe_text", "nemotron_h")  # recurrent layers, state per sequence (issue 29)
MODULE_ARCHS = ("deepseek_v4", "inkling_text")  # families.FAMILY_MODULES families: their own layers (issue 30)


def hybrid(cfg: RunConfig, model: str | None = None) -> None:
    """What a hybrid model (model.init_arch, or the `model` a checkpoint's config names) runs on so far: our engines
    at TP 1, the FSDP trainer (docs/models.md)."""
    model = model or f"model.init_arch={cfg.model.init_arch}"
    why = f"{model} (a hybrid: recurrent Gated DeltaNet or Mamba-2 layers) runs"
    _require(cfg.rollout.backend == "embedded", "rollout.backend", f"{why} on our engines (not in SGLang's list)")
    _require(cfg.rollout.engine_tp == 1, "rollout.engine_tp", f"{why} on engines of tp size 1 so far")
    _require(cfg.train.backend == "fsdp", "train.backend", f"{why} with the FSDP trainer (megatron maps no such layer)")
    _require(not cfg.zero_kl, "zero_kl", f"{why} without zero-KL mode (no batch-invariant scan)")


def module_family(cfg: RunConfig, model: str | None = None) -> None:
    """What DeepSeek-V4 and Inkling run on so far: our engines at TP 1 (each sequence's own decode state,
    engine/family_states.py), the FSDP trainer (docs/models.md)."""
    model = model or f"model.init_arch={cfg.model.init_arch}"
    why = f"{model} runs"
    _require(cfg.rollout.backend == "embedded", "rollout.backend", f"{why} on our engines (not in SGLang's list)")
    _require(cfg.rollout.engine_tp == 1, "rollout.engine_tp", f"{why} on engines of tp size 1 so far")
    _require(cfg.train.backend == "fsdp", "train.backend", f"{why} with the FSDP trainer (megatron has no such layers)")
    _require(not cfg.zero_kl, "zero_kl", f"{why} without zero-KL mode (no batch-invariant kernels for its layers)")


def embedded_engines(cfg: RunConfig) -> None:
    """What our embedded engines (engine/tp.py) do not do yet, by key: span nodes, expert parallelism, and with TP
    > 1 the LoRA sync and zero-KL mode."""
    r = cfg.rollout
    _require(r.engine_nodes == 1, "rollout.engine_nodes", "embedded engines run on one node (SGLang's span nodes)")
    _require(r.engine_ep == 1, "rollout.engine_ep", "embedded engines have no expert parallelism (SGLang's do)")
    if r.engine_tp == 1:
        return
    tp = f"rollout.engine_tp={r.engine_tp} (embedded engines)"
    _require(
        cfg.sync.strategy != "lora",
        "sync.strategy",
        f"lora into {tp} is not built yet (tensor-parallel engines serve no adapters; broadcast, p2p, delta and "
        "colocated sync full weights into them)",
    )
    _require(not cfg.zero_kl, "zero_kl", f"zero-KL mode runs on engines of tp size 1, not {tp}")


def indexer_replay(cfg: RunConfig) -> None:
    """Only our engine records indexer selections and only FSDP replays them (a model.path is checked where its
    config is read: launch/run_dir.py)."""
    arch = cfg.model.init_arch
    for ok, why in (
        (cfg.model.path or arch in DSA_ARCHS, f"needs a DSA model ({'/'.join(DSA_ARCHS)}), not {arch}"),
        (cfg.rollout.backend == "embedded", "needs rollout.backend=embedded (return_indexer_topk is ours)"),
        (cfg.train.backend == "fsdp", "needs train.backend=fsdp (megatron does not replay the records)"),
        (cfg.rollout.agent is None, "with multi-turn agents is not supported yet (no indexer rows per turn)"),
        (cfg.mode == "sync", "runs in mode sync so far, as R3 (the fully async loop asks for no records)"),
    ):
        _require(bool(ok), "algo.indexer_replay", why)


def zero_kl(cfg: RunConfig) -> None:
    """Zero-KL mode needs both sides to run the same batch-invariant kernels on the same numbers."""
    why = "zero_kl needs the same batch-invariant kernels on both sides"
    _require(not cfg.lora.enabled, "lora.rank", f"{why}: LoRA adapters (hooks) are not batch-invariant")
    _require(cfg.train.backend == "fsdp", "train.backend", f"{why}: only train.backend=fsdp has them")
    _require(
        cfg.rollout.backend == "embedded",
        "rollout.backend",
        f"{why}: only rollout.backend=embedded has them (SGLang's kernels are its own)",
    )
    _require(
        cfg.rollout.device == cfg.train.device,
        "rollout.device",
        f"{why} on one kind of device: rollout.device={cfg.rollout.device}, train.device={cfg.train.device}",
    )
    _require(not cfg.train.compile, "train.compile", f"{why}: compiled (fused) layers change the bits")
    _require(
        cfg.model.path is not None or cfg.model.init_arch not in DSA_ARCHS,
        "model.init_arch",
        f"{why}: the DSA indexer's scoring and top-k ({cfg.model.init_arch}) have no batch-invariant kernels",
    )
    mixed = cfg.train.device == "cuda" and cfg.train.mixed_precision
    compute = "bfloat16" if mixed else "float32"
    _require(
        cfg.model.dtype == compute,
        "model.dtype",
        f"{why} in one dtype: the engines compute in model.dtype={cfg.model.dtype}, the trainer in "
        f"{compute} (train.device={cfg.train.device}, "
        f"train.mixed_precision={cfg.train.mixed_precision})",
    )
