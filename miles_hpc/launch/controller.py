"""Start-up and tear-down around the loop (stage: loop): what `miles-hpc run` and `miles-hpc worker` do.

`run_local`: this process becomes trainer rank 0 (the controller); engines and trainer ranks 1..W-1 are local
subprocesses (`launch/local.py`). Whatever happens, they are stopped by handle when the run ends.
Trainer ranks 1..W-1 of `run_local`, and every worker under a scheduler (srun, mpirun, torchrun), are
`miles-hpc worker` processes (launch/workers.py): rank 0 runs `controller`, the others `follow_controller`.
"""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.launch.local import GpuPlan, LocalCluster, free_port, gpu_plan
from miles_hpc.launch.run_dir import RunPaths, prepare_run_dir, resolve_model

if TYPE_CHECKING:  # imported where used, as the functions below do: importing this module stays cheap
    from miles_hpc.data.prompts import PromptIterator
    from miles_hpc.data.store import TrajectoryWriter
    from miles_hpc.launch.trainer_ranks import RankedTrainer


def build_trainer(cfg: RunConfig, model_dir: Path) -> Any:
    total_steps = cfg.steps * cfg.train.updates_per_step
    if cfg.train.backend == "megatron":
        if cfg.train.device != "cuda":
            raise ValueError(
                "train.backend=megatron runs on GPUs (megatron-core's forward, optimizer and checkpoints "
                "are CUDA-only): set train.device=cuda, or use train.backend=fsdp on the CPU"
            )
        from miles_hpc.train.megatron import MegatronTrainer

        return MegatronTrainer(
            str(model_dir),
            cfg.train,
            cfg.algo,
            cfg.megatron,
            device=cfg.train.device,
            seed=cfg.seed,
            total_steps=total_steps,
        )
    from miles_hpc.train.fsdp import FSDPTrainer

    return FSDPTrainer(
        str(model_dir),
        cfg.train,
        cfg.algo,
        device=cfg.train.device,
        seed=cfg.seed,
        total_steps=total_steps,
        lora=cfg.lora,
        zero_kl=cfg.zero_kl,
    )


def preflight(cfg: RunConfig) -> GpuPlan:
    """What `miles-hpc run` checks before it writes or starts anything: the reward plug-in imports, the weight sync
    is one a local run can drive, and trainer, engines and sync fit this machine's GPUs. Raises naming the key."""
    from miles_hpc.rollout.plugins import load_object
    from miles_hpc.sync.factory import check_strategy

    load_object(cfg.reward.fn, kind="reward function")
    if cfg.rollout.agent:
        load_object(cfg.rollout.agent, kind="agent function")
    teacher = cfg.algo.opd_teacher
    if teacher is not None and not teacher.startswith(("http://", "https://")):
        if not (Path(teacher) / "config.json").is_file():
            raise ConfigError(
                f"algo.opd_teacher: {teacher} is neither an HF checkpoint directory (no config.json) "
                "nor a server URL (http://...)"
            )
    check_strategy(cfg)
    return gpu_plan(cfg, _gpu_count() if "cuda" in (cfg.train.device, cfg.rollout.device) else 0)


def run_local(cfg: RunConfig, gpus: GpuPlan | None = None) -> dict[str, Any]:
    """The whole run on this machine; returns a summary (reward at start and end, where the outputs are)."""
    gpus = gpus or preflight(cfg)
    paths = prepare_run_dir(cfg)
    model_dir = resolve_model(cfg, paths)
    master_port = free_port()
    # This process is trainer rank 0; its world is passed explicitly (the process environment stays untouched).
    world_env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(cfg.train.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
    }
    with LocalCluster(cfg, paths.root, model_dir, paths.config, gpus) as cluster:
        urls = cluster.start_engines()
        teacher = cfg.algo.opd_teacher
        if teacher is not None and not teacher.startswith(("http://", "https://")):
            teacher = cluster.start_teacher(Path(teacher))  # preflight checked it is a checkpoint
        cluster.start_trainer_ranks(master_port)
        return controller(
            cfg, paths, model_dir, urls, cluster.api_key, cluster.admin_key, world_env, teacher_url=teacher
        )


def follow_controller(cfg: RunConfig, model_dir: Path, world_env: dict[str, str] | None) -> None:
    """Trainer rank > 0: build the same trainer and run the controller's commands until it says shutdown.
    ``world_env``: torchrun-style variables (None: this process's environment)."""
    from miles_hpc.launch.trainer_ranks import follow
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    init_trainer_world(world_from_env(world_env, device=cfg.train.device))
    try:
        follow(build_trainer(cfg, model_dir))
    finally:
        teardown()


def _prompts(cfg: RunConfig) -> PromptIterator:
    from miles_hpc.data.prompts import PromptIterator, load_prompts
    from miles_hpc.data.tasks import make_task

    d = cfg.data
    records = (
        load_prompts(d.prompts, prompt_key=d.prompt_key, label_key=d.label_key)
        if d.prompts
        else make_task(d.task, n=4096, seed=cfg.seed)
    )
    return PromptIterator(records, batch_size=cfg.rollout.prompts_per_step, seed=cfg.seed, shuffle=d.shuffle)


def _resume(cfg: RunConfig, paths: RunPaths, trainer: RankedTrainer, prompts: PromptIterator) -> dict[str, Any] | None:
    """Load the latest checkpoint into the trainer ranks and the prompt order (``cfg.resume`` says whether one must,
    may or must not exist); returns its extra state, or None on a fresh start."""
    from miles_hpc.train.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(paths.root)
    if cfg.resume is True and ckpt is None:
        raise FileNotFoundError(f"resume=true but {paths.checkpoints} holds no checkpoint")
    if cfg.resume is False and ckpt is not None:
        # Starting over here would mix two runs' metrics, trajectories and checkpoints in one directory.
        raise FileExistsError(f"resume=false but {ckpt} exists: choose another run_dir or remove it")
    if ckpt is None:
        return None
    extra = trainer.load(ckpt)
    prompts.load_state_dict(extra["prompts"])
    print(f"[miles-hpc] resumed from {ckpt} at step {int(extra['next_step'])}")
    return extra


def _store(cfg: RunConfig, paths: RunPaths, model_dir: Path, start_step: int) -> TrajectoryWriter | None:
    from miles_hpc.data.store import TrajectoryWriter
    from miles_hpc.models import read_config

    if not cfg.store.enabled:
        return None
    experts = read_config(model_dir).num_experts or None  # routing ids in the smallest dtype that holds them
    return TrajectoryWriter(
        paths.trajectories,
        prefix=f"traj-s{start_step:06d}",
        model=str(model_dir),
        run_id=cfg.name,
        max_shard_bytes=cfg.store.max_shard_bytes,
        compression=cfg.store.compression,
        num_experts=experts,
    )


def _summary(rewards: list[float], paths: RunPaths) -> dict[str, Any]:
    k = max(1, min(10, len(rewards) // 2))
    return {
        "steps": len(rewards),
        "reward_first": statistics.fmean(rewards[:k]) if rewards else None,
        "reward_last": statistics.fmean(rewards[-k:]) if rewards else None,
        "trajectories": str(paths.trajectories),
        "tensorboard": str(paths.tensorboard),
        "metrics": str(paths.metrics),
        "checkpoints": str(paths.checkpoints),
    }


def controller(
    cfg: RunConfig,
    paths: RunPaths,
    model_dir: Path,
    urls: list[str],
    api_key: str,
    admin_key: str,
    world_env: dict[str, str],
    teacher_url: str | None = None,
) -> dict[str, Any]:
    """Trainer rank 0: resume or start, run the loop over the engines at ``urls``, checkpoint the last step, release
    the other ranks; returns the run's summary (rewards at start and end, where its outputs are)."""
    from transformers import AutoTokenizer

    from miles_hpc.launch.trainer_ranks import RankedTrainer
    from miles_hpc.metrics import MetricsLogger
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    init_trainer_world(world_from_env(world_env, device=cfg.train.device))
    trainer = RankedTrainer(build_trainer(cfg, model_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = _prompts(cfg)
        extra = _resume(cfg, paths, trainer, prompts)
        start_step = 0 if extra is None else int(extra["next_step"])
        store = _store(cfg, paths, model_dir, start_step)
        metrics = MetricsLogger(paths.root, total_steps=cfg.steps)
        try:
            rewards = asyncio.run(
                _run_async(
                    cfg,
                    trainer,
                    urls,
                    api_key,
                    admin_key,
                    prompts,
                    tokenizer,
                    store,
                    metrics,
                    paths,
                    start_step,
                    extra,
                    teacher_url,
                )
            )
        finally:
            metrics.close()
            if store is not None:
                store.close()
        done = start_step + len(rewards)  # fewer than cfg.steps when a stop was requested (preemption)
        if done > start_step and not (paths.checkpoints / f"step_{done}").exists():
            trainer.save(
                paths.checkpoints / f"step_{done}",
                {"next_step": done, "weight_version": done, "prompts": prompts.state_dict()},
            )
        # Release the other ranks only on success: after a failure they may sit in a collective that a shutdown
        # broadcast would wait on forever; LocalCluster (or srun's --kill-on-bad-exit) stops them instead.
        trainer.shutdown()
        return _summary(rewards, paths)
    finally:
        teardown()


async def _run_async(
    cfg: RunConfig,
    trainer: Any,
    urls: list[str],
    api_key: str,
    admin_key: str,
    prompts: Any,
    tokenizer: Any,
    store: Any,
    metrics: Any,
    paths: RunPaths,
    start_step: int,
    resumed: dict[str, Any] | None,
    teacher_url: str | None = None,
) -> list[float]:
    from miles_hpc.data.prompts import render_prompt
    from miles_hpc.loop import fully_async
    from miles_hpc.loop.sync import LoopContext, run
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.plugins import load_object
    from miles_hpc.rollout.router import Router
    from miles_hpc.sync.factory import build_sync, strategy_class
    from miles_hpc.sync.publish import Publisher
    from miles_hpc.sync.wire.pg import Backend

    clients = [EngineClient(u, api_key=api_key, admin_api_key=admin_key) for u in urls]
    backend: Backend = "nccl" if cfg.train.device == cfg.rollout.device == "cuda" else "gloo"
    sync = build_sync(cfg, paths.root, "127.0.0.1", free_port, backend=backend, trainer=trainer)
    # e.g. LoRA sync: the engines serve the trained adapter by name, so every generation names it
    lora_path = strategy_class(cfg).engine_needs(cfg).adapter_name
    router = Router(
        clients, owns_clients=True, on_readmit=lambda i, c: publisher.readmit_check(i, c), lora_path=lora_path
    )
    publisher = Publisher(sync, router, pause_mode=cfg.sync.pause_mode)
    d = cfg.data
    ctx = LoopContext(
        cfg=cfg,
        trainer=trainer,
        router=router,
        publisher=publisher,
        prompts=prompts,
        records=prompts.records,
        render=lambda rec: render_prompt(
            rec, tokenizer, apply_chat_template=d.apply_chat_template, system_prompt=d.system_prompt
        ),
        tokenizer=tokenizer,
        reward_fn=load_object(cfg.reward.fn, kind="reward function"),
        store=store,
        agent=load_object(cfg.rollout.agent, kind="agent function") if cfg.rollout.agent else None,
        teacher=_teacher_client(cfg, teacher_url, api_key),
        metrics=metrics,
        checkpoints=paths.checkpoints,
        resumed=resumed,
        stop_requested=lambda: (paths.rendezvous / "preempt").exists(),  # `miles-hpc worker --role preempt`
    )
    async with router:
        try:
            return await (fully_async.run if cfg.mode == "fully_async" else run)(ctx, start_step)
        finally:
            await sync.close()
            if ctx.teacher is not None:
                await ctx.teacher.close()


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _teacher_client(cfg: RunConfig, url: str | None, api_key: str) -> Any:
    from miles_hpc.rollout.client import EngineClient

    if cfg.algo.opd_teacher is None:
        return None
    url = url or (cfg.algo.opd_teacher if cfg.algo.opd_teacher.startswith(("http://", "https://")) else None)
    if url is None:
        raise ValueError(
            f"algo.opd_teacher: {cfg.algo.opd_teacher} is a checkpoint, which only `miles-hpc run` "
            "serves; under a scheduler give the URL of a running teacher server"
        )
    return EngineClient(url, api_key=api_key)
