"""Start-up and tear-down around the loop (stage: loop): what `miles-hpc run` and `miles-hpc worker` do.

`run_local`: this process becomes trainer rank 0 (the controller); engines and trainer ranks 1..W-1 are local
subprocesses (`launch/local.py`). Whatever happens, they are stopped by handle when the run ends.
Trainer ranks 1..W-1 of `run_local`, and every worker under a scheduler (srun, mpirun, torchrun), are
`miles-hpc worker` processes (launch/workers.py): rank 0 runs `controller`, the others `follow_controller`.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.launch.local import GpuPlan, LocalCluster, free_port, gpu_plan
from miles_hpc.launch.run_dir import RunPaths, claimed_run_dir, prepare_run_dir, resolve_model

if TYPE_CHECKING:  # imported where used, as the functions below do: importing this module stays cheap
    from miles_hpc.data.prompts import PromptIterator
    from miles_hpc.data.store import TrajectoryWriter
    from miles_hpc.launch.signals import StopControl
    from miles_hpc.launch.supervisor import EngineSupervisor
    from miles_hpc.launch.trainer_ranks import RankedTrainer

# An engine's admin calls (pause, continue, weight-update group and transfers, checksums) answer within
# sync.timeout_s, its own receive timeout, plus this; past it the engine is taken as hung and dropped.
ADMIN_MARGIN_S = 30.0


def build_trainer(cfg: RunConfig, model_dir: Path) -> Any:
    total_steps = cfg.steps * cfg.train.updates_per_step
    if cfg.train.backend == "megatron":
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
    _check_data(cfg)
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


def _check_data(cfg: RunConfig) -> None:
    """The prompt source exists (its rows are checked as they load, naming file and line)."""
    from miles_hpc.data.tasks import task_spec

    if cfg.data.prompts is not None:
        if not Path(cfg.data.prompts).is_file():
            raise ConfigError(f"data.prompts: {cfg.data.prompts} is not a file")
        return
    try:
        task_spec(cfg.data.task)
    except ValueError as e:
        raise ConfigError(f"data.task: {e}") from None


def run_local(cfg: RunConfig, gpus: GpuPlan | None = None) -> dict[str, Any]:
    """The whole run on this machine; returns a summary (reward at start and end, where the outputs are, and
    ``stopped``: the signal or request that ended it early). Signals, dead children and failures: launch/signals.py,
    launch/supervisor.py."""
    gpus = gpus or preflight(cfg)
    with claimed_run_dir(Path(cfg.run_dir)):  # one run per directory (launch/run_dir.py)
        return _run_local(cfg, gpus)


def _run_local(cfg: RunConfig, gpus: GpuPlan) -> dict[str, Any]:
    from miles_hpc.launch.signals import StopControl
    from miles_hpc.launch.supervisor import watch_trainer_ranks

    paths = prepare_run_dir(cfg)
    model_dir = resolve_model(cfg, paths)
    if (paths.rendezvous / "preempt").exists():  # asked of an earlier run of this directory, which honoured it
        print(f"[miles-hpc] removing the stale stop request {paths.rendezvous / 'preempt'}", flush=True)
        (paths.rendezvous / "preempt").unlink()
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
        if cluster.threads is not None:  # this process is a rank too: its share of the CPUs, as its children's
            import torch

            torch.set_num_threads(cluster.threads)
        control = StopControl(paths.rendezvous, on_hard_exit=lambda: cluster.stop(grace_s=2.0)).install()
        try:
            urls = cluster.start_engines()
            teacher = cfg.algo.opd_teacher
            if teacher is not None and not teacher.startswith(("http://", "https://")):
                teacher = cluster.start_teacher(Path(teacher))  # preflight checked it is a checkpoint
            cluster.start_trainer_ranks(master_port)
            watching = watch_trainer_ranks(cluster, control)
            try:
                return controller(
                    cfg,
                    paths,
                    model_dir,
                    urls,
                    cluster.api_key,
                    cluster.admin_key,
                    world_env,
                    teacher_url=teacher,
                    control=control,
                    cluster=cluster,
                )
            except Exception as e:
                if _named_cause(e):  # the ranks that died after it died of it
                    raise
                lost = None if control.ranks_told else _lost_rank(cluster)  # told ranks exit on purpose
                raise lost or e from e
            finally:
                watching.set()  # from here on the trainer ranks exit by design
        finally:
            control.restore()


def _named_cause(e: BaseException) -> bool:
    """An error of this process that names its own cause (a damaged checkpoint file), which the other trainer ranks'
    exits follow from rather than cause."""
    from miles_hpc.train.checkpoint import CheckpointDamagedError

    return isinstance(e, CheckpointDamagedError)


def _lost_rank(cluster: LocalCluster, wait_s: float = 2.0) -> RuntimeError | None:
    """After a failure: the trainer rank whose death caused it, if one died (a broken collective's own error names
    only a socket)."""
    import time

    deadline = time.monotonic() + wait_s
    while not (exited := cluster.trainer_exits()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not exited:
        return None
    name, code = exited[0]
    return RuntimeError(f"{name.replace('-', ' rank ')} exited with code {code}; see {cluster.logs / name}.log")


def follow_controller(cfg: RunConfig, model_dir: Path, world_env: dict[str, str] | None) -> None:
    """Trainer rank > 0: build the same trainer and run the controller's commands until it says shutdown.
    ``world_env``: torchrun-style variables (None: this process's environment)."""
    from miles_hpc.launch.trainer_ranks import follow
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    init_trainer_world(world_from_env(world_env, device=cfg.train.device), timeout_s=cfg.train.collective_timeout_s)
    ok = False
    try:
        follow(build_trainer(cfg, model_dir))
        ok = True
    finally:
        teardown(ok)


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


def _warn_missing(run: Path, next_step: int) -> None:
    """A resume goes on when trained samples of the steps its checkpoint covers are gone from the shards (nothing
    can bring them back), and says so, naming the steps (data/completeness.py)."""
    from miles_hpc.data import completeness
    from miles_hpc.data.verify import SHOWN

    missing = completeness.missing_samples(run, below=next_step)
    for line in completeness.describe(missing, SHOWN):
        print(f"[miles-hpc] WARNING: trajectories: {line}; see `miles-hpc inspect --verify {run}`", flush=True)


def _store(cfg: RunConfig, paths: RunPaths, model_dir: Path, start_step: int) -> TrajectoryWriter | None:
    from miles_hpc.data.store import TrajectoryWriter
    from miles_hpc.models import read_config

    if not cfg.store.enabled:
        return None
    mc = read_config(model_dir)
    experts = mc.num_experts or None  # routing ids in the smallest dtype that holds them
    # Indexer records hold key positions < prompt + max_new_tokens <= the engines' context, which our launcher
    # leaves at the model's max_position_embeddings: int16 when that fits.
    context = mc.max_position_embeddings if cfg.algo.indexer_replay else None
    return TrajectoryWriter(
        paths.trajectories,
        prefix=f"traj-s{start_step:06d}",
        model=str(model_dir),
        run_id=cfg.name,
        max_shard_bytes=cfg.store.max_shard_bytes,
        compression=cfg.store.compression,
        num_experts=experts,
        max_context=context,
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
    control: StopControl | None = None,
    cluster: LocalCluster | None = None,
) -> dict[str, Any]:
    """Trainer rank 0: resume or start, run the loop over the engines at ``urls``, checkpoint the last step, release
    the other ranks; returns the run's summary (rewards at start and end, where its outputs are). ``control``: how
    the run is stopped (signals, the preempt marker); ``cluster``: the local processes, whose engines are restarted
    when they die. On any failure the other ranks are told (``abort``) when they can hear it, never waited for."""
    from miles_hpc.launch.signals import StopControl
    from miles_hpc.launch.trainer_ranks import RankedTrainer
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env

    control = control or StopControl(paths.rendezvous)
    timeout = cfg.train.collective_timeout_s
    init_trainer_world(world_from_env(world_env, device=cfg.train.device), timeout_s=timeout)
    ok = False
    trainer: RankedTrainer | None = None
    try:
        trainer = RankedTrainer(build_trainer(cfg, model_dir), heartbeat_s=min(60.0, timeout / 4))
        rewards, start_step, prompts = _train(
            cfg, paths, model_dir, trainer, urls, api_key, admin_key, teacher_url, control, cluster
        )
        done = start_step + len(rewards)  # fewer than cfg.steps when a stop was requested (preemption)
        if done > start_step and not (paths.checkpoints / f"step_{done}").exists():
            trainer.save(
                paths.checkpoints / f"step_{done}",
                {"next_step": done, "weight_version": done, "prompts": prompts.state_dict()},
            )
        stopped = control.why() if done < cfg.steps else None
        if stopped is not None:
            control.consume_marker()
        trainer.shutdown()
        ok = True
        return {**_summary(rewards, paths), "stopped": stopped, "exit_code": control.exit_code() if stopped else 0}
    except BaseException as e:
        if trainer is not None:
            control.ranks_told = trainer.abort(f"{type(e).__name__}: {e}")
        raise
    finally:
        teardown(ok)


def _train(
    cfg: RunConfig,
    paths: RunPaths,
    model_dir: Path,
    trainer: RankedTrainer,
    urls: list[str],
    api_key: str,
    admin_key: str,
    teacher_url: str | None,
    control: StopControl,
    cluster: LocalCluster | None,
) -> tuple[list[float], int, PromptIterator]:
    """Resume, reconcile the stored trajectories and metrics with the checkpoint, run the loop: (step rewards, the
    first step, the prompt iterator)."""
    from transformers import AutoTokenizer

    from miles_hpc.data.reconcile import reconcile_trajectories
    from miles_hpc.metrics import MetricsLogger

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = _prompts(cfg)
    extra = _resume(cfg, paths, trainer, prompts)
    start_step = 0 if extra is None else int(extra["next_step"])
    if paths.trajectories.is_dir():  # what a crash left after the checkpoint is regenerated: never stored twice
        report = reconcile_trajectories(paths.trajectories, start_step)
        print(f"[miles-hpc] trajectories: {report.describe()}", flush=True)
        _warn_missing(paths.root, start_step)
    store = _store(cfg, paths, model_dir, start_step)
    metrics = MetricsLogger(paths.root, total_steps=cfg.steps, resume_step=start_step)
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
                model_dir,
                start_step,
                extra,
                teacher_url,
                control,
                cluster,
            )
        )
    finally:
        metrics.close()
        if store is not None:
            store.close()
    return rewards, start_step, prompts


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
    model_dir: Path,
    start_step: int,
    resumed: dict[str, Any] | None,
    teacher_url: str | None,
    control: StopControl,
    cluster: LocalCluster | None,
) -> list[float]:
    """The loop's context (router, supervisor, publisher, sync) over the engines at ``urls``; the loop, run."""
    from miles_hpc.data.prompts import render_prompt
    from miles_hpc.launch.supervisor import EngineSupervisor
    from miles_hpc.loop import fully_async
    from miles_hpc.loop.sync import LoopContext, run
    from miles_hpc.rollout.client import EngineClient
    from miles_hpc.rollout.plugins import load_object
    from miles_hpc.rollout.router import Router, RouterConfig
    from miles_hpc.sync.factory import build_sync, master_address_for, strategy_class
    from miles_hpc.sync.publish import Publisher
    from miles_hpc.sync.wire.pg import Backend

    admin_timeout = cfg.sync.timeout_s + ADMIN_MARGIN_S
    clients = [EngineClient(u, api_key=api_key, admin_api_key=admin_key, admin_timeout=admin_timeout) for u in urls]
    backend: Backend = "nccl" if cfg.train.device == cfg.rollout.device == "cuda" else "gloo"
    address = master_address_for(urls, cfg.sync.master_address)  # engines on other nodes reach it there
    sync = build_sync(cfg, paths.root, address, free_port, backend=backend, trainer=trainer)
    # e.g. LoRA sync: the engines serve the trained adapter by name, so every generation names it
    lora_path = strategy_class(cfg).engine_needs(cfg).adapter_name
    r = cfg.rollout  # generations wait for a restarted engine a little longer than the supervisor (names each)
    router = Router(
        clients,
        RouterConfig(all_down_grace_s=r.engine_down_timeout_s + 30.0),
        owns_clients=True,
        on_readmit=lambda i, c: publisher.readmit_check(i, c),
        lora_path=lora_path,
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
        stop_requested=control.stop_requested,  # signals, `miles-hpc worker --role preempt`
        max_prompt_len=await _max_prompt_len(cfg, clients[0], model_dir),
    )
    async with router:
        try:
            loop_run = (fully_async.run if cfg.mode == "fully_async" else run)(ctx, start_step)
            factory = lambda url: EngineClient(  # noqa: E731
                url, api_key=api_key, admin_api_key=admin_key, admin_timeout=admin_timeout
            )
            owner = None if cfg.rollout.engine_urls else cluster  # attached engines are not ours to restart
            return await _supervised(cfg, loop_run, EngineSupervisor(router, paths.rendezvous, factory, owner=owner))
        finally:
            await sync.close()
            if ctx.teacher is not None:
                await ctx.teacher.close()


async def _supervised(
    cfg: RunConfig, loop_run: Coroutine[Any, Any, list[float]], supervisor: EngineSupervisor
) -> list[float]:
    """The loop, with the engine supervisor beside it (its limits from ``cfg.rollout``): the first to fail ends both."""
    supervisor.max_restarts = cfg.rollout.engine_restarts
    supervisor.down_timeout_s = cfg.rollout.engine_down_timeout_s
    loop = asyncio.ensure_future(loop_run)
    watch = asyncio.ensure_future(supervisor.run())
    await asyncio.wait({loop, watch}, return_when=asyncio.FIRST_COMPLETED)
    if not loop.done():  # the supervisor found the fleet gone: its error ends the run
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        watch.result()
    watch.cancel()
    await asyncio.gather(watch, return_exceptions=True)
    return loop.result()


async def _max_prompt_len(cfg: RunConfig, client: Any, model_dir: Path) -> int | None:
    """The longest prompt the engines take with ``rollout.max_new_tokens`` more (engine 0's server info, else the
    model's config)."""
    import json

    from miles_hpc.loop.rollout_step import max_prompt_len
    from miles_hpc.rollout.errors import EngineError

    try:
        info = await client.server_info()
    except EngineError:
        info = {}
    try:
        positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        positions = None
    return max_prompt_len(info, positions if isinstance(positions, int) else None, cfg.rollout.max_new_tokens)


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
