"""The run's config tree: frozen, slotted, keyword-only dataclasses rooted at :class:`RunConfig`, each section small
and validated in ``__post_init__``; field help is ``metadata=_help(...)``. Loading is :mod:`.loader`'s, typed here.

``dump_config(load_config(p))`` loads back to an equal config (round trip), so ``RUN/config.yaml`` reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from miles_hpc.config import checks, loader
from miles_hpc.config.checks import DSA_ARCHS
from miles_hpc.config.loader import meta as _help
from miles_hpc.config.loader import require as _require
from miles_hpc.config.megatron import MegatronConfig

Arch = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "glm_moe_dsa", "deepseek_v32",
               "qwen3_next", "qwen3_5_moe_text", "nemotron_h", "kimi_k25",
               "deepseek_v4", "inkling_text"]  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Which model the run starts from."""

    path: str | None = field(default=None, metadata=_help("HF-format checkpoint dir; None = create one with init_*"))
    init_arch: Arch = field(default="qwen3", metadata=_help("architecture of the random-init model when path is None"))
    init_size: Literal["tiny", "small"] = field(default="tiny", metadata=_help("size preset for init-model"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=_help("compute dtype"))


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Prompt dataset."""

    prompts: str | None = field(default=None, metadata=_help("JSONL/Parquet prompt file; None = built-in task"))
    prompt_key: str = field(default="prompt", metadata=_help("column holding the prompt"))
    label_key: str = field(default="label", metadata=_help("column holding the reference answer"))
    shuffle: bool = field(default=True, metadata=_help("shuffle prompts each epoch (seeded)"))
    task: str = field(default="arith", metadata=_help("built-in synthetic task when prompts is None"))
    apply_chat_template: bool = field(default=True, metadata=_help("render prompts with the tokenizer's template"))
    system_prompt: str | None = field(default=None, metadata=_help("system message put before each prompt"))

    def __post_init__(self) -> None:
        _require(bool(self.prompt_key), "prompt_key", "must be a non-empty string")


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardConfig:
    """How a finished sample is scored."""

    fn: str = field(default="miles_hpc.rollout.rewards:exact_match", metadata=_help("dotted path module:function"))
    overlong_buffer: int = field(default=0, metadata=_help("DAPO overlong penalty ramp length in tokens (0 = off)"))
    overlong_penalty: float = field(default=1.0, metadata=_help("penalty at max_new_tokens, ramped over the buffer"))
    train_on_failed: bool = field(
        default=False,
        metadata=_help(
            "a sample whose reward function raised or returned no finite float is stored (status failed) but left "
            "out of the loss and of its group's advantages; true: trained on with reward 0"
        ),
    )
    max_failed_frac: float = field(
        default=0.5,
        metadata=_help(
            "a step in which more than this fraction of samples failed their reward stops the run (1 = never)"
        ),
    )

    def __post_init__(self) -> None:
        _require(":" in self.fn or "." in self.fn, "fn", f"must be a dotted path like pkg.mod:func, got {self.fn!r}")
        _require(self.overlong_buffer >= 0, "overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")
        _require(
            0.0 <= self.max_failed_frac <= 1.0, "max_failed_frac", f"must be in [0, 1], got {self.max_failed_frac}"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgoConfig:
    """The RL algorithm: advantages, policy loss, regularisers, off-policy correction."""

    advantage: Literal["grpo", "dr_grpo", "reinforce_pp"] = field(default="grpo", metadata=_help("estimator"))
    std_normalize: bool = field(default=True, metadata=_help("GRPO: divide by the group std"))
    policy_loss: Literal["ppo_clip", "gspo"] = field(default="ppo_clip", metadata=_help("token or sequence ratio"))
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = field(
        default="token_mean", metadata=_help("how token losses become one number")
    )
    clip_low: float = field(default=0.2, metadata=_help("PPO ratio clip below 1"))
    clip_high: float = field(default=0.2, metadata=_help("PPO ratio clip above 1 (DAPO clip-higher: 0.28)"))
    dual_clip: float | None = field(default=None, metadata=_help("dual-clip bound c > 1 for negative advantages"))
    kl_coef: float = field(default=0.0, metadata=_help("KL penalty to the reference model (0 = off)"))
    kl_type: Literal["k1", "k2", "k3"] = field(default="k3", metadata=_help("KL estimator"))
    entropy_coef: float = field(default=0.0, metadata=_help("entropy bonus"))
    tis_cap: float | None = field(default=None, metadata=_help("truncated IS (train/rollout) cap; None = off"))
    mis_low: float | None = field(default=None, metadata=_help("mask tokens with IS ratio below (icepop)"))
    mis_high: float | None = field(default=None, metadata=_help("mask tokens with IS ratio above (icepop)"))
    opd_teacher: str | None = field(
        default=None,
        metadata=_help(
            "on-policy distillation: teacher HF checkpoint dir (miles-hpc run serves it on an extra "
            "engine) or URL of an SGLang-compatible server; None: off"
        ),
    )
    opd_coef: float = field(default=1.0, metadata=_help("OPD: advantage -= coef * (logp_student - logp_teacher)"))
    opd_only: bool = field(default=False, metadata=_help("OPD: the teacher term alone (no task-reward advantage)"))
    routing_replay: bool = field(
        default=False,
        metadata=_help(
            "R3, MoE models: engines return the experts each token was routed to and training replays "
            "them (gate weights from the current router); metrics r3/coverage, r3/topk_agreement"
        ),
    )
    indexer_replay: bool = field(
        default=False,
        metadata=_help(
            "DSA models (glm_moe_dsa, deepseek_v32): engines record the keys each token's query selected per indexer "
            "layer, training attends to those (embedded engine, fsdp, mode sync); metrics dsa/replay_coverage, "
            "dsa/topk_agreement"
        ),
    )
    dynamic_sampling: bool = field(default=False, metadata=_help("DAPO: drop zero-variance groups, refill"))
    max_sampling_rounds: int = field(default=4, metadata=_help("dynamic sampling: generate at most this often"))

    def __post_init__(self) -> None:
        _require(0.0 <= self.clip_low < 1.0, "clip_low", f"must be in [0, 1), got {self.clip_low}")
        _require(self.clip_high >= 0.0, "clip_high", f"must be >= 0, got {self.clip_high}")
        _require(self.dual_clip is None or self.dual_clip > 1.0, "dual_clip", "must be > 1 (or null)")
        _require(self.kl_coef >= 0.0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _require(self.tis_cap is None or self.tis_cap > 0.0, "tis_cap", "must be > 0 (or null)")
        _require(self.max_sampling_rounds >= 1, "max_sampling_rounds", "must be >= 1")
        _require(self.opd_coef >= 0.0, "opd_coef", f"must be >= 0, got {self.opd_coef}")
        _require(self.opd_teacher is not None or not self.opd_only, "opd_only", "needs algo.opd_teacher")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Generation settings for the rollout stage."""

    backend: Literal["embedded", "sglang"] = field(default="embedded", metadata=_help("engine kind"))
    num_engines: int = field(default=1, metadata=_help("engine servers"))
    prompts_per_step: int = field(default=8, metadata=_help("prompts per train step"))
    samples_per_prompt: int = field(default=4, metadata=_help("group size n"))
    max_new_tokens: int = field(default=64, metadata=_help("response length cap per sample"))
    temperature: float = field(default=1.0, metadata=_help("sampling temperature (0 = greedy)"))
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling mass"))
    top_k: int = field(default=-1, metadata=_help("-1 disables top-k"))
    engine_timeout_s: float = field(
        default=600.0, metadata=_help("how long the controller waits for the engines to listen (names the missing)")
    )
    engine_tp: int = field(
        default=1,
        metadata=_help(
            "tensor-parallel ranks per engine (SGLang's and our serve's --tp-size; GPUs per engine on GPUs); "
            "one rollout task each"
        ),
    )
    engine_nodes: int = field(
        default=1, metadata=_help("nodes one engine spans (SGLang --nnodes; engine_tp / engine_nodes GPUs on each)")
    )
    engine_ep: int = field(default=1, metadata=_help("expert-parallel size inside an engine (SGLang --ep-size)"))
    page_size: int | None = field(
        default=None,
        metadata=_help(
            "KV-cache page in tokens of every engine this run starts (SGLang's and our serve's --page-size); prefix "
            "reuse is in whole pages, so a multi-turn conversation recomputes the rest of its last page each turn; "
            "null: each engine's default (SGLang 1, the embedded engine 16)"
        ),
    )
    engine_urls: tuple[str, ...] = field(
        default=(),
        metadata=_help(
            "engines already running (SGLang or `miles-hpc serve`, a shared pool or another job): the run starts "
            "none and uses these (num_engines must equal their number; TP sizes are read from the servers)"
        ),
    )
    engine_api_key_file: str | None = field(
        default=None, metadata=_help("with engine_urls: file holding those engines' --api-key (null: none)")
    )
    engine_admin_api_key_file: str | None = field(
        default=None, metadata=_help("with engine_urls: file holding their --admin-api-key (null: none)")
    )
    engine_restarts: int = field(
        default=3,
        metadata=_help("times a dead engine is started again (each with a longer backoff) before it stays out"),
    )
    engine_down_timeout_s: float = field(
        default=300.0,
        metadata=_help("with no engine serving, how long the run waits for one to come back before it fails"),
    )
    agent: str | None = field(
        default=None,
        metadata=_help(
            "multi-turn agent `module:function` (async (ctx, record) -> Sample; its environment gives the "
            "reward), e.g. miles_hpc.rollout.agents:terminal_agent; None: one generation per sample"
        ),
    )
    max_turns: int = field(default=4, metadata=_help("agent: assistant turns per sample at most"))
    max_tool_output_chars: int = field(default=400, metadata=_help("agent: tool output is cut at this length"))
    device: Literal["cpu", "cuda"] = field(
        default="cpu", metadata=_help("miles-hpc run: embedded engines on the CPU, or one GPU each after the trainer's")
    )
    kv_cache_fraction: float | None = field(
        default=None,
        metadata=_help(
            "engine on a GPU: share of its free memory for the KV cache (None: 0.85 alone on the GPU, "
            "0.25 when it shares the GPU with a trainer rank)"
        ),
    )
    sglang_python: str = field(
        default="python", metadata=_help("backend sglang: the interpreter of SGLang's own venv (never the main one)")
    )
    sglang_args: tuple[str, ...] = field(
        default=(), metadata=_help("backend sglang: more launch_server flags (not those the launcher sets)")
    )

    def __post_init__(self) -> None:
        _require(self.num_engines >= 1, "num_engines", f"must be >= 1, got {self.num_engines}")
        _require(self.page_size is None or self.page_size >= 1, "page_size", f"must be >= 1, got {self.page_size}")
        for key in ("engine_tp", "engine_nodes", "engine_ep"):
            _require(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        _require(self.engine_tp % self.engine_nodes == 0, "engine_nodes", f"must divide engine_tp={self.engine_tp}")
        _require(self.engine_tp % self.engine_ep == 0, "engine_ep", f"must divide engine_tp={self.engine_tp}")
        _require(
            not self.engine_urls or len(self.engine_urls) == self.num_engines,
            "num_engines",
            f"must equal the number of engine_urls ({len(self.engine_urls)}), got {self.num_engines}",
        )
        bad = [u for u in self.engine_urls if not u.startswith(("http://", "https://"))]
        _require(not bad, "engine_urls", f"each must be an http(s):// URL, got {bad[:1]}")
        _require(self.engine_restarts >= 0, "engine_restarts", f"must be >= 0, got {self.engine_restarts}")
        _require(self.engine_down_timeout_s > 0, "engine_down_timeout_s", "must be > 0")
        _require(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        _require(self.max_tool_output_chars >= 1, "max_tool_output_chars", "must be >= 1")
        _require(
            self.kv_cache_fraction is None or 0.0 < self.kv_cache_fraction <= 1.0,
            "kv_cache_fraction",
            f"must be in (0, 1] (or null), got {self.kv_cache_fraction}",
        )
        _require(self.prompts_per_step >= 1, "prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        _require(self.samples_per_prompt >= 1, "samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
        _require(self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 or >= 1, got {self.top_k}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Trainer settings."""

    backend: Literal["fsdp", "megatron"] = field(default="fsdp", metadata=_help("training backend"))
    world_size: int = field(default=1, metadata=_help("trainer ranks"))
    device: Literal["cpu", "cuda"] = field(
        default="cpu", metadata=_help("trainer ranks on the CPU (gloo) or one GPU each, cuda:LOCAL_RANK (NCCL)")
    )
    lr: float = field(default=1e-5, metadata=_help("peak learning rate (AdamW)"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    warmup_steps: int = field(default=0, metadata=_help("linear warm-up steps"))
    grad_clip: float = field(default=1.0, metadata=_help("max global grad norm (0 = off)"))
    max_tokens_per_microbatch: int = field(default=4096, metadata=_help("token budget of a packed micro-batch"))
    lr_schedule: Literal["constant", "cosine"] = field(default="constant", metadata=_help("after warm-up"))
    min_lr_ratio: float = field(default=0.1, metadata=_help("cosine floor as a fraction of lr"))
    adam_betas: tuple[float, float] = field(default=(0.9, 0.999), metadata=_help("AdamW betas"))
    adam_eps: float = field(default=1e-8, metadata=_help("AdamW eps"))
    updates_per_step: int = field(default=1, metadata=_help("optimizer steps (mini-batches) per rollout batch"))
    activation_checkpointing: bool = field(default=False, metadata=_help("recompute layer activations in backward"))
    mixed_precision: bool = field(default=True, metadata=_help("bf16 compute with fp32 master weights (GPU only)"))
    compile: bool = field(
        default=False,
        metadata=_help("torch.compile each decoder layer, attention kept eager (GPU only; compiles at start)"),
    )
    checkpoint_interval: int = field(
        default=0, metadata=_help("save RUN/checkpoints/step_N every N steps (0 = end only)")
    )
    sft_warmup_steps: int = field(default=0, metadata=_help("supervised steps on prompt labels before RL"))
    collective_timeout_s: float = field(
        default=1800.0,
        metadata=_help(
            "a collective of the trainer ranks that waits this long fails the run (a hang, a lost rank); "
            "ranks idle during rollout are kept alive by a heartbeat, so long rollouts are not collectives"
        ),
    )
    sft_warmup_shuffle_labels: bool = field(
        default=False, metadata=_help("warm up on other prompts' labels: teach the answer format, not the answers")
    )
    mtp_loss_coef: float = field(
        default=0.0,
        metadata=_help(
            "train the multi-token-prediction layers (num_nextn_predict_layers of the MLA families) with this weight "
            "on their cross-entropy over the response tokens, per loss token; 0 = left as loaded (still saved and "
            "synced); train.backend=fsdp"
        ),
    )
    indexer_loss_coef: float = field(
        default=0.0,
        metadata=_help(
            "DSA models (glm_moe_dsa, deepseek_v32): train the lightning indexer with this weight on the KL "
            "divergence from the main attention's distribution to its scores, per token and layer with an indexer "
            "(DeepSeek-V3.2's indexer loss; its inputs are detached, so only the indexer learns from it); 0 = the "
            "indexer stays as loaded (megatron: pipeline_parallel 1)"
        ),
    )
    indexer_loss: Literal["sparse", "dense"] = field(
        default="sparse",
        metadata=_help("indexer loss over each query's selected keys (sparse) or over all its causal keys (dense)"),
    )

    def __post_init__(self) -> None:
        _require(self.updates_per_step >= 1, "updates_per_step", "must be >= 1")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        _require(self.checkpoint_interval >= 0, "checkpoint_interval", "must be >= 0")
        _require(self.sft_warmup_steps >= 0, "sft_warmup_steps", "must be >= 0")
        _require(self.collective_timeout_s > 0, "collective_timeout_s", "must be > 0")
        _require(self.world_size >= 1, "world_size", f"must be >= 1, got {self.world_size}")
        _require(self.lr > 0.0, "lr", f"must be > 0, got {self.lr}")
        _require(self.mtp_loss_coef >= 0.0, "mtp_loss_coef", f"must be >= 0, got {self.mtp_loss_coef}")
        _require(
            self.mtp_loss_coef == 0.0 or self.backend == "fsdp",
            "mtp_loss_coef",
            "the multi-token-prediction loss is trained by train.backend=fsdp only",
        )
        _require(self.indexer_loss_coef >= 0.0, "indexer_loss_coef", f"must be >= 0, got {self.indexer_loss_coef}")
        _require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(self.grad_clip >= 0.0, "grad_clip", f"must be >= 0, got {self.grad_clip}")
        _require(self.max_tokens_per_microbatch >= 1, "max_tokens_per_microbatch", "must be >= 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncConfig:
    """Weight update from trainer to rollout engines."""

    strategy: Literal["broadcast", "p2p", "delta", "lora", "colocated"] = field(
        default="broadcast", metadata=_help("weight update strategy")
    )
    bucket_bytes: int = field(default=512 << 20, metadata=_help("bytes per broadcast bucket"))
    pause_mode: Literal["abort", "retract", "in_place"] = field(
        default="retract", metadata=_help("what generation does during a weight update")
    )
    timeout_s: float = field(
        default=300.0, metadata=_help("an engine that has not taken its part of an update by then is dropped")
    )
    transport: Literal["torch", "mpi"] = field(
        default="torch",
        metadata=_help(
            "broadcast/p2p over torch.distributed (gloo/NCCL/RCCL) or over MPI (mpi4py; the vendor MPI "
            "is often the tuned RDMA path): every process must then run under an MPI launcher"
        ),
    )
    delta_device: Literal["cpu", "trainer"] = field(
        default="cpu",
        metadata=_help(
            "strategy delta: where the last published copy lives and the codec runs: host memory, or "
            "the trainer's device (GPU coding, ~300x faster, for one rollout-dtype copy of the model in "
            "trainer rank 0's GPU memory)"
        ),
    )
    master_address: str | None = field(
        default=None,
        metadata=_help(
            "address of trainer rank 0 that engines join weight-update groups at (null: the address this host "
            "reaches the first engine from; loopback when every engine is local). Set it to pick a NIC"
        ),
    )
    mpi_gpu_aware: Literal["auto", "on", "off"] = field(
        default="auto",
        metadata=_help(
            "transport mpi: hand CUDA buffers to MPI (on), stage through pinned host memory (off), or "
            "detect from the MPI library (auto)"
        ),
    )

    def __post_init__(self) -> None:
        _require(
            self.transport == "torch" or self.strategy in ("broadcast", "p2p"),
            "transport",
            f"mpi moves broadcast and p2p updates; strategy {self.strategy!r} does not use a process group",
        )
        _require(self.bucket_bytes >= 1 << 10, "bucket_bytes", f"must be >= 1024, got {self.bucket_bytes}")
        _require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FullyAsyncConfig:
    """`mode: fully_async` (loop/fully_async.py): rollout never waits for training."""

    max_inflight: int = field(default=32, metadata=_help("samples generating at once across the engines"))
    buffer_groups: int = field(default=16, metadata=_help("finished groups held for the trainer (then backpressure)"))
    max_staleness: int = field(default=2, metadata=_help("groups whose oldest token is more versions behind are stale"))
    stale_policy: Literal["drop", "recycle"] = field(
        default="recycle", metadata=_help("a stale group is dropped, or its prompt generated again")
    )
    mask_tokens_older_than: int | None = field(
        default=None, metadata=_help("loss-mask tokens more than this many versions behind (None: train on all)")
    )

    def __post_init__(self) -> None:
        _require(self.max_inflight >= 1, "max_inflight", f"must be >= 1, got {self.max_inflight}")
        _require(self.buffer_groups >= 1, "buffer_groups", f"must be >= 1, got {self.buffer_groups}")
        _require(self.max_staleness >= 0, "max_staleness", f"must be >= 0, got {self.max_staleness}")
        _require(
            self.mask_tokens_older_than is None or self.mask_tokens_older_than >= 0,
            "mask_tokens_older_than",
            "must be >= 0 (or null)",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraConfig:
    """LoRA RL (models/lora.py): train adapters only, the base weights frozen; with `sync.strategy: lora` only the
    adapters travel to the engines, which apply them per request (SGLang's /load_lora_adapter)."""

    rank: int = field(default=0, metadata=_help("adapter rank r (0 = LoRA off: full fine-tuning)"))
    alpha: float = field(default=16.0, metadata=_help("scaling = alpha / rank"))
    dropout: float = field(default=0.0, metadata=_help("dropout on the adapters' input while training"))
    target_modules: tuple[str, ...] = field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        metadata=_help(
            "linears to adapt: module names (PEFT's matching: the name or its last parts) or 're:REGEX'; on a hybrid "
            "family this default also takes its recurrent layers' input and output projections"
        ),
    )

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "rank", f"must be >= 0, got {self.rank}")
        _require(0.0 <= self.dropout < 1.0, "dropout", f"must be in [0, 1), got {self.dropout}")
        _require(bool(self.target_modules), "target_modules", "must name at least one module")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreConfig:
    """HDF5 trajectory shards under RUN/trajectories."""

    enabled: bool = field(default=True, metadata=_help("write trajectories to HDF5"))
    max_shard_bytes: int = field(default=256 << 20, metadata=_help("roll to a new shard past this size"))
    compression: Literal["none", "gzip", "lzf"] = field(default="none", metadata=_help("HDF5 dataset filter"))

    def __post_init__(self) -> None:
        _require(self.max_shard_bytes >= 1 << 10, "max_shard_bytes", f"must be >= 1024, got {self.max_shard_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SlurmConfig:
    """`miles-hpc submit`: the batch script (cluster/slurm.py). Tasks: train.world_size trainer ranks in component 0,
    rollout.num_engines engines in component 1."""

    mode: Literal["hetjob", "split"] = field(
        default="hetjob", metadata=_help("hetjob: two components; split: one allocation split by node (no hetjobs)")
    )
    partition: str | None = field(default=None, metadata=_help("# EDIT: partition (None: the cluster's default)"))
    rollout_partition: str | None = field(default=None, metadata=_help("partition of the rollout component"))
    account: str | None = field(default=None, metadata=_help("# EDIT: account to charge"))
    qos: str | None = field(default=None, metadata=_help("quality of service"))
    time: str = field(default="04:00:00", metadata=_help("walltime"))
    train_nodes: int = field(default=1, metadata=_help("nodes of the training component"))
    rollout_nodes: int = field(default=1, metadata=_help("nodes of the rollout component"))
    gpus_per_node: int = field(default=0, metadata=_help("GPUs per node (0: CPU only)"))
    cpus_per_task: int = field(default=1, metadata=_help("CPUs per task"))
    mem: str | None = field(default=None, metadata=_help("memory per node, e.g. 200G (None: the default)"))
    gpu_memory_gb: float = field(
        default=0.0,
        metadata=_help("GB of memory per training GPU: `prepare` checks the megatron layout fits (0: no check)"),
    )
    host_memory_gb: float = field(
        default=0.0, metadata=_help("GB of host memory per training node, for offloaded optimizer states (0: no check)")
    )
    site: str | None = field(default=None, metadata=_help("site file sourced first (slurm/sites/*.sh: ROCm, NICs)"))
    setup: tuple[str, ...] = field(default=(), metadata=_help("# EDIT: shell lines before the run (modules, venv)"))
    signal_s: int = field(default=180, metadata=_help("USR2 this long before the walltime: checkpoint + requeue"))
    checkpoint_gbps: float = field(
        default=2.0,
        metadata=_help(
            "GB/s one training node writes to the run dir's file system: preflight's estimate of a checkpoint's "
            "time against signal_s (measure yours: docs/hpc.md)"
        ),
    )
    shared_fs_check: bool = field(
        default=True,
        metadata=_help(
            "preflight refuses a run_dir outside a shared file system (NFS, Lustre, GPFS, BeeGFS, ...) for a job "
            "of several nodes; false where a node-local path is shared after all (one-host test clusters)"
        ),
    )
    requeue: bool = field(default=True, metadata=_help("requeue on preemption or the walltime signal"))
    extra_sbatch: tuple[str, ...] = field(default=(), metadata=_help("more #SBATCH options for both components"))
    output: str | None = field(
        default=None, metadata=_help("the job's log (None: RUN/logs/slurm-%j.out; Slurm creates no directories)")
    )

    def __post_init__(self) -> None:
        _require(self.train_nodes >= 1 and self.rollout_nodes >= 1, "train_nodes", "nodes must be >= 1")
        _require(self.gpus_per_node >= 0 and self.cpus_per_task >= 1, "gpus_per_node", "must be >= 0 (cpus >= 1)")
        _require(self.signal_s >= 0, "signal_s", f"must be >= 0, got {self.signal_s}")
        _require(self.checkpoint_gbps > 0, "checkpoint_gbps", f"must be > 0, got {self.checkpoint_gbps}")
        for key in ("gpu_memory_gb", "host_memory_gb"):
            _require(getattr(self, key) >= 0, key, f"must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Root of the config tree: one run."""

    name: str = field(default="run", metadata=_help("run name, used in the run directory and job names"))
    run_dir: str = field(default="runs/run", metadata=_help("RUN directory (config.yaml, trajectories, tb, ...)"))
    seed: int = field(default=0, metadata=_help("seed of model init, data order and sampling"))
    steps: int = field(default=10, metadata=_help("train steps"))
    resume: bool | None = field(default=None, metadata=_help("resume from RUN/checkpoints; None = if one exists"))
    mode: Literal["sync", "fully_async"] = field(
        default="sync", metadata=_help("sync: generate, then train, each step; fully_async: both at once")
    )
    zero_kl: bool = field(
        default=False,
        metadata=_help(
            "batch-invariant kernels in engines and trainer: rollout and trainer log-probs equal bit for "
            "bit, train-inference KL exactly 0 (every family; much slower; docs/lora.md, Zero-KL mode)"
        ),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "must be a non-empty string")
        _require(
            self.rollout.agent is not None or self.data.task != "terminal",
            "data.task",
            "the terminal task is multi-turn: set rollout.agent (miles_hpc.rollout.agents:terminal_agent)",
        )
        if self.algo.indexer_replay:
            checks.indexer_replay(self)
        _require(
            self.mode == "sync" or self.fully_async.buffer_groups >= self.rollout.prompts_per_step,
            "fully_async.buffer_groups",
            f"must hold a step's {self.rollout.prompts_per_step} groups "
            f"(rollout.prompts_per_step), got {self.fully_async.buffer_groups}",
        )
        _require(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        _require(
            self.sync.strategy != "lora" or self.lora.enabled,
            "sync.strategy",
            "lora sends adapters only: set lora.rank > 0 (or pick a strategy that sends full weights)",
        )
        _require(
            not self.lora.enabled or self.train.backend == "fsdp",
            "lora.rank",
            "LoRA trains with train.backend=fsdp (megatron-core has no adapter layers of its own)",
        )
        _require(
            self.train.indexer_loss_coef == 0.0 or self.model.path is not None or self.model.init_arch in DSA_ARCHS,
            "train.indexer_loss_coef",
            f"the indexer loss trains a DeepSeek sparse attention indexer ({', '.join(DSA_ARCHS)}); "
            f"model.init_arch is {self.model.init_arch}",
        )
        _require(
            self.train.indexer_loss_coef == 0.0 or not self.lora.enabled,
            "train.indexer_loss_coef",
            "with LoRA the indexer is frozen with the base weights (no adapter on it): the loss would train nothing",
        )
        _require(
            self.train.backend != "megatron" or self.train.device == "cuda" or not self.megatron.distributed_optimizer,
            "megatron.distributed_optimizer",
            "megatron's distributed optimizer is CUDA-only: set megatron.distributed_optimizer=false with "
            f"train.device={self.train.device} (torch's AdamW then steps on megatron's reduced gradients)",
        )
        if self.zero_kl:
            checks.zero_kl(self)
        if self.rollout.backend == "embedded":
            checks.embedded_engines(self)
        if self.model.path is None and self.model.init_arch in checks.HYBRID_ARCHS:
            checks.hybrid(self)
        if self.model.path is None and self.model.init_arch in checks.MODULE_ARCHS:
            checks.module_family(self)


def config_from_dict(data: Any, *, source: str = "<dict>") -> RunConfig:
    """A :class:`RunConfig` from plain data (as parsed from YAML); strict."""
    return loader.build(RunConfig, data, source=source)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load YAML ``path`` (or defaults when None), apply ``key.sub=value`` overrides, validate."""
    return loader.load(RunConfig, path, overrides)


def config_reference() -> str:
    """Markdown table of every key (path, type, default, help); docs/config.md embeds it and a test keeps it current."""
    return loader.reference(RunConfig)
