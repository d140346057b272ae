"""``miles-hpc`` entry point (docs/design.md section 8, a contract). Thin: parse, build the config, call into packages.

User errors (bad config, bad file, missing model) print one line naming the file/key and exit 2 (usage/config)
or 1 (data); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_hpc import __version__
from miles_hpc.config import ConfigError
from miles_hpc.faults import enable_stack_dumps


def _cmd_run(args: argparse.Namespace) -> int:
    from miles_hpc.config import load_config
    from miles_hpc.launch.controller import preflight
    from miles_hpc.launch.run_dir import claimed_run_dir, prepare_run_dir, resolve_model
    from miles_hpc.launch.smoke import model_smoke_check

    cfg = load_config(args.config, args.overrides)
    gpus = preflight(cfg)  # nothing written or started for a run that cannot run here
    with claimed_run_dir(Path(cfg.run_dir)):  # before anything is written there: refused if another run holds it
        paths = prepare_run_dir(cfg)
        print(f"[miles-hpc] run {cfg.name}: resolved config -> {paths.config}")
        model_dir = resolve_model(cfg, paths)
        print(f"[miles-hpc] starting model: {model_dir}")
        print(f"[miles-hpc] {model_smoke_check(model_dir, cfg.model.dtype)}")
        return _run_reported(cfg, gpus, paths.root / "logs")


def _run_reported(cfg: Any, gpus: Any, logs: Path) -> int:
    """`run_local`, its summary printed; a failure as one message (launch/failure.py), never a bare traceback."""
    from miles_hpc.launch.controller import run_local
    from miles_hpc.launch.failure import report_failure
    from miles_hpc.rollout.plugins import PluginError

    try:
        summary = run_local(cfg, gpus)
    except (ConfigError, FileNotFoundError, FileExistsError, PluginError):
        raise  # main() prints these (exit 2)
    except BaseException as e:  # noqa: BLE001 (every failure becomes one message and an exit code)
        return report_failure(e, logs)
    _print_summary(summary, cfg.steps)
    return int(summary.get("exit_code", 0))


def _print_summary(summary: dict[str, Any], steps: int | None = None) -> None:
    if summary.get("stopped"):
        print(
            f"[miles-hpc] stopped by {summary['stopped']} after {summary['steps']} steps (checkpoint saved): "
            "run the same command again to resume"
        )
    first, last = summary["reward_first"], summary["reward_last"]
    if first is not None:
        print(
            f"[miles-hpc] done: {summary['steps']} steps, mean reward {first:.3f} (first steps) -> {last:.3f} "
            "(last steps)"
        )
    else:
        print(f"[miles-hpc] nothing to do: the run is already at steps={steps} (raise steps= to continue)")
    for key in ("trajectories", "tensorboard", "metrics", "checkpoints"):
        print(f"[miles-hpc] {key:12s} {summary[key]}")


def _cmd_worker(args: argparse.Namespace) -> int:
    from miles_hpc.cluster.lease import parent_pid_from_env, watch_parent
    from miles_hpc.config import load_config
    from miles_hpc.launch import workers
    from miles_hpc.launch.run_dir import RunPaths

    watch_parent(parent_pid_from_env())  # started by `miles-hpc run`: end with it, even after its SIGKILL
    cfg = load_config(args.config, args.overrides)
    if args.role == "rollout":
        return workers.run_rollout_worker(cfg, args.het_group)
    if args.role == "shutdown":
        workers.request_shutdown(RunPaths(Path(cfg.run_dir)), "the batch script's training step ended")
        return 0
    if args.role == "preempt":
        workers.request_preempt(RunPaths(Path(cfg.run_dir)), "signal from the batch script (walltime, preemption)")
        return 0
    from miles_hpc.launch.failure import report_failure
    from miles_hpc.train.dist import leave

    try:
        summary = workers.run_scheduled_train_worker(cfg, args.het_group)
    except (ConfigError, FileNotFoundError, FileExistsError):
        raise
    except BaseException as e:  # noqa: BLE001 (one message per rank, then out: never a hang at exit)
        rank = os.environ.get("RANK", "?")
        leave(report_failure(e, Path(cfg.run_dir) / "logs", role=f"trainer-rank-{rank}"))
    if summary is not None:
        _print_summary(summary)
    leave(int((summary or {}).get("exit_code", 0)))  # all saved and torn down: skip exit destructors (see leave)


def _cmd_submit(args: argparse.Namespace) -> int:
    import subprocess

    from miles_hpc.atomic import write_text_atomic
    from miles_hpc.cluster.slurm import render_sbatch
    from miles_hpc.config import load_config

    cfg = load_config(args.config, args.overrides)
    checked = True
    if not args.no_preflight:
        from miles_hpc.launch.preflight import preflight, report

        checked = report(preflight(cfg, components=args.launcher == "sbatch"), sys.stderr)
        if not checked and not args.dry_run:
            return 2
    if args.launcher == "submitit":  # one allocation runs the whole `miles-hpc run` (no hetjob)
        from miles_hpc.launch.submitit_jobs import describe, submit_runs

        if args.dry_run:
            print(describe(cfg, args.config, [list(args.overrides)]))
            return 0 if checked else 2
        job = submit_runs(cfg, args.config, [list(args.overrides)], Path(cfg.run_dir) / "submitit")[0]
        print(f"submitted job {job.job_id} (submitit); run dir {cfg.run_dir}; logs {cfg.run_dir}/submitit")
        return 0
    script = render_sbatch(cfg, args.config, args.overrides)  # paths as given: the job starts in this directory
    if args.dry_run:
        print(script, end="")
        return 0 if checked else 2
    path = Path(cfg.run_dir) / "job.sbatch"
    (Path(cfg.run_dir) / "logs").mkdir(parents=True, exist_ok=True)  # where --output points
    write_text_atomic(path, script)
    proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"error: sbatch {path} failed ({proc.returncode}): {proc.stderr.strip()}", file=sys.stderr)
        return 1
    job = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job}; run dir {cfg.run_dir}; script {path}; log {cfg.run_dir}/logs/slurm-{job}.out")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    import json
    import subprocess

    from miles_hpc.cluster.sweep import expand_grid, render_array, write_plan
    from miles_hpc.config import load_config

    cfg = load_config(args.config, args.overrides)
    points = expand_grid(args.grid)
    failed = 0
    for point in points:  # every point must make a valid config, and pass preflight, before anything is submitted
        swept = [f"{k}={v}" for k, v in point.items()]
        point_cfg = load_config(args.config, [*args.overrides, *swept])
        if not args.no_preflight:
            from miles_hpc.launch.preflight import preflight, report

            # An array task runs `miles-hpc run` in one allocation (sweep-task): no components to check.
            print(f"[miles-hpc] preflight of point {' '.join(swept)}", file=sys.stderr)
            failed += not report(preflight(point_cfg, components=False), sys.stderr)
    if failed:
        print(f"error: {failed} of {len(points)} sweep points failed preflight; nothing submitted", file=sys.stderr)
        return 2
    root = Path(cfg.run_dir)
    shared = [o for o in args.overrides if not o.startswith("run_dir=")]  # each point gets its own run_dir
    plan = write_plan(root, str(Path(args.config).resolve()), shared, points)
    if args.launcher == "submitit":
        from miles_hpc.launch.submitit_jobs import describe, submit_runs

        tasks = json.loads(plan.read_text())["tasks"]
        if args.dry_run:
            print(describe(cfg, args.config, [t["overrides"] for t in tasks]))
            return 0
        jobs = submit_runs(cfg, args.config, [t["overrides"] for t in tasks], root / "submitit")
        print(
            f"submitted {len(jobs)} array tasks (submitit, job {jobs[0].job_id.split('_')[0]}); plan {plan}; "
            f"report: miles-hpc sweep-report {root}"
        )
        return 0
    script = render_array(cfg, plan.resolve(), len(points), max_parallel=args.max_parallel)
    (root / "sweep.sbatch").write_text(script)
    if args.dry_run:
        print(script, end="")
        return 0
    proc = subprocess.run(
        ["sbatch", "--parsable", str(root / "sweep.sbatch")], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        print(f"error: sbatch {root / 'sweep.sbatch'} failed: {proc.stderr.strip()}", file=sys.stderr)
        return 1
    print(
        f"submitted array job {proc.stdout.strip().split(';')[0]} with {len(points)} tasks; plan {plan}; "
        f"report: miles-hpc sweep-report {root}"
    )
    return 0


def _cmd_sweep_task(args: argparse.Namespace) -> int:
    import json

    from miles_hpc.config import load_config

    plan = json.loads(Path(args.plan).read_text())
    task = plan["tasks"][args.index]
    cfg = load_config(plan["config"], task["overrides"])
    print(f"[miles-hpc] sweep task {args.index}: {task['point']} -> {task['run_dir']}", flush=True)
    return _run_reported(cfg, None, Path(cfg.run_dir) / "logs")


def _cmd_sweep_report(args: argparse.Namespace) -> int:
    import json

    from miles_hpc.cluster.sweep import report

    rows = report(Path(args.root), last=args.last)
    if args.json:
        print(json.dumps(rows))
        return 0
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(str(r.get(k, "")) for k in keys))
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from miles_hpc.config import load_config
    from miles_hpc.launch.workers import prepare

    cfg = load_config(args.config, args.overrides)
    if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0"):  # a requeued attempt passed it before
        from miles_hpc.launch.preflight import preflight, report

        # --batch: the batch script's own call, whose job is the config's slurm: components (their GPUs, a run dir
        # every node sees); without it (mpirun.sh, torchrun.sh, by hand) the launcher sizes the processes.
        if not report(preflight(cfg, components=args.batch), sys.stderr):
            return 2
    paths = prepare(cfg)
    print(paths.config)
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from miles_hpc.models.presets import init_model

    out = init_model(args.arch, args.size, args.out_dir, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} checkpoint + tokenizer to {out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    """Exit 0: readable and nothing wrong seen; 1: a bad file, a non-finite reward, or (``--verify``) any problem."""
    from miles_hpc.data import TrajectoryFileError, format_summary, summarize
    from miles_hpc.data.schema import find_shards
    from miles_hpc.data.verify import verify_shards

    try:
        if args.verify:
            problems = verify_shards(args.path)
            shards = find_shards(args.path)[0]
        else:
            summary = summarize(args.path)
    except TrajectoryFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.verify:
        for p in problems:
            print(p)
        damaged = len({p.path for p in problems} & set(shards))
        verdict = f"{len(problems)} problem(s) in {damaged} of {len(shards)} shard(s)" if problems else "no problems"
        if any(p.path.name == "metrics.jsonl" for p in problems):
            verdict += " and trained samples missing from the shards"
        print(
            f"verified {len(shards)} shard(s) under {args.path}: {verdict}", file=sys.stderr if problems else sys.stdout
        )
        return 1 if problems else 0
    print(format_summary(summary))
    if summary["reward_nonfinite"]:
        print(
            f"error: {summary['reward_nonfinite']} sample(s) with a non-finite reward (damaged data; "
            f"`miles-hpc inspect --verify {args.path}` names them)",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from miles_hpc.launch.export import export_checkpoint

    try:
        out = export_checkpoint(args.run_dir, args.out or Path(args.run_dir) / "export", step=args.step)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[miles-hpc] exported {out} (HF format: config.json, safetensors, tokenizer)")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from miles_hpc.engine.launch import EngineLaunch

    launch = EngineLaunch.from_namespace(args)
    if not (Path(launch.model_dir) / "config.json").is_file():
        print(f"error: {launch.model_dir} is not an HF checkpoint directory (no config.json)", file=sys.stderr)
        return 2
    from miles_hpc.engine.server import configs_of, serve

    try:
        engine_cfg, server_cfg = configs_of(launch)
    except ValueError as e:  # a flag's value the engine refuses (EngineConfig / ServerConfig name the field)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve(launch.model_dir, engine_cfg, server_cfg)


def _add_serve_parser(sub: Any) -> None:
    # No engine import here beyond the flags (engine/launch.py imports no torch): `miles-hpc --help` stays fast.
    from miles_hpc.engine.launch import EngineLaunch

    srv = sub.add_parser("serve", help="the embedded engine as an SGLang-compatible HTTP server")
    EngineLaunch.add_arguments(srv)
    srv.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and its flags. Long: one block per subcommand, read top to bottom as the CLI's table of
    contents (each block's handler is the ``_cmd_*`` function it names)."""
    from miles_hpc.models.presets import ARCHS, HYBRID_ARCHS, MODULE_ARCHS, SIZES, WRAPPED_ARCHS

    p = argparse.ArgumentParser(prog="miles-hpc", description="RL post-training on HPC batch schedulers.")
    p.add_argument("--version", action="version", version=f"miles-hpc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run on this machine (embedded engine + FSDP2 by default)")
    run.add_argument("config", help="YAML config file")
    run.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    run.set_defaults(func=_cmd_run)

    sbm = sub.add_parser("submit", help="render the run's Slurm batch script (hetjob or split) and sbatch it")
    sbm.add_argument("config", help="YAML config file (its slurm: section sizes the job)")
    sbm.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    sbm.add_argument(
        "--dry-run",
        action="store_true",
        help="print the script (submitit: the job's parameters) instead of submitting; exit 2 if preflight fails",
    )
    sbm.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the checks against this machine (to render a template elsewhere than on the cluster)",
    )
    sbm.add_argument(
        "--launcher",
        choices=["sbatch", "submitit"],
        default="sbatch",
        help="sbatch: the rendered hetjob/split script; submitit: one allocation runs `miles-hpc run`",
    )
    sbm.set_defaults(func=_cmd_submit)

    swp = sub.add_parser("sweep", help="submit a grid of runs as one Slurm array job (one task per point)")
    swp.add_argument(
        "--grid",
        action="append",
        required=True,
        metavar="key=v1,v2",
        help="a swept key and its values; repeat for more keys (their product is the grid)",
    )
    swp.add_argument("--max-parallel", type=int, help="tasks running at once (--array=...%%N)")
    swp.add_argument(
        "--dry-run",
        action="store_true",
        help="write ROOT/sweep.json and print the script (submitit: the jobs, as JSON) without submitting",
    )
    swp.add_argument("--launcher", choices=["sbatch", "submitit"], default="sbatch", help="how the array is submitted")
    swp.add_argument("--no-preflight", action="store_true", help="skip the checks of every point (as submit's)")
    swp.add_argument("config", help="YAML config file; its run_dir becomes the sweep's root")
    swp.add_argument("overrides", nargs="*", metavar="key.sub=value", help="overrides shared by every point")
    swp.set_defaults(func=_cmd_sweep)
    swt = sub.add_parser("sweep-task", help="run one point of a sweep (what an array task runs)")
    swt.add_argument("plan", help="ROOT/sweep.json")
    swt.add_argument("index", type=int, help="the point ($SLURM_ARRAY_TASK_ID)")
    swt.set_defaults(func=_cmd_sweep_task)
    swr = sub.add_parser("sweep-report", help="final metrics of every point of a sweep")
    swr.add_argument("root", help="the sweep's root (holds sweep.json)")
    swr.add_argument("--last", type=int, default=10, help="steps averaged into reward_last")
    swr.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    swr.set_defaults(func=_cmd_sweep_report)

    prep = sub.add_parser("prepare", help="create the run directory, starting model and keys (before any worker)")
    prep.add_argument(
        "--batch",
        action="store_true",
        help="the batch script's call: also check the job's components (slurm: nodes and GPUs, a shared run dir)",
    )
    prep.add_argument("config", help="YAML config file")
    prep.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    prep.set_defaults(func=_cmd_prepare)

    worker = sub.add_parser("worker", help="one worker process of a run (what srun, mpirun or `run` starts)")
    worker.add_argument(
        "--role",
        required=True,
        choices=["train", "rollout", "shutdown", "preempt"],
        help="train: a trainer rank (rank 0 is the controller); rollout: one engine per task; "
        "shutdown: tell the run's rollout workers to stop; preempt: tell the controller to "
        "checkpoint after its current step and exit",
    )
    worker.add_argument("--het-group", type=int, help="the Slurm het-job component this step runs in")
    worker.add_argument("config", help="the run's config (RUN/config.yaml)")
    worker.add_argument("overrides", nargs="*", metavar="key.sub=value")
    worker.set_defaults(func=_cmd_worker)

    init = sub.add_parser("init-model", help="write a random-init HF-format checkpoint with a local tokenizer")
    init.add_argument("--arch", required=True, choices=ARCHS + HYBRID_ARCHS + WRAPPED_ARCHS + MODULE_ARCHS)
    init.add_argument("--size", default="tiny", choices=SIZES)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("out_dir")
    init.set_defaults(func=_cmd_init_model)

    insp = sub.add_parser("inspect", help="summarise HDF5 trajectory shards (a file, a directory or a run dir)")
    insp.add_argument("path")
    insp.add_argument(
        "--verify",
        action="store_true",
        help="check every value of every shard (hashes, offsets, finite values, "
        "samples stored twice); print each problem and exit 1 on any",
    )
    insp.set_defaults(func=_cmd_inspect)
    exp = sub.add_parser("export", help="a run's trained weights (latest checkpoint) as an HF-format checkpoint")
    exp.add_argument("run_dir")
    exp.add_argument("out", nargs="?", help="output directory (default: RUN_DIR/export)")
    exp.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    exp.set_defaults(func=_cmd_export)
    _add_serve_parser(sub)
    from miles_hpc.cli_plan import add_plan_parser

    add_plan_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) prints every thread's Python stack to stderr first:
    # without it a worker that dies that way leaves only its exit status. SIGQUIT prints them too (a hang's where).
    enable_stack_dumps()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        from miles_hpc.rollout.plugins import PluginError

        if not isinstance(e, PluginError):
            raise
        print(f"config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
