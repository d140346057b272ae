"""``miles-hpc`` entry point (DESIGN section 8, a contract). Thin: parse, build the config, call into packages.

User errors (bad config, bad file, missing model) print one line naming the file/key and exit 2 (usage/config)
or 1 (data); tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from miles_hpc import __version__
from miles_hpc.config import ConfigError


def _cmd_run(args: argparse.Namespace) -> int:
    from miles_hpc.config import load_config
    from miles_hpc.loop.run_dir import prepare_run_dir, resolve_model

    cfg = load_config(args.config, args.overrides)
    paths = prepare_run_dir(cfg)
    print(f"[miles-hpc] run {cfg.name}: resolved config -> {paths.config}")
    model_dir = resolve_model(cfg, paths)
    print(f"[miles-hpc] starting model: {model_dir}")
    from miles_hpc.loop.smoke import model_smoke_check

    print(f"[miles-hpc] {model_smoke_check(model_dir, cfg.model.dtype)}")
    # The rollout (engine), training (FSDP2) and weight-sync stages are not built yet: say so plainly.
    print("[miles-hpc] stages built so far: config, model, tokenizer, trajectory store; the RL loop is not built yet")
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from miles_hpc.models.presets import init_model

    out = init_model(args.arch, args.size, args.out_dir, seed=args.seed)
    print(f"wrote {args.arch}/{args.size} checkpoint + tokenizer to {out}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from miles_hpc.data import TrajectoryFileError, format_summary, summarize

    try:
        summary = summarize(args.path)
    except TrajectoryFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from miles_hpc.models.presets import ARCHS, SIZES

    p = argparse.ArgumentParser(prog="miles-hpc", description="RL post-training on HPC batch schedulers.")
    p.add_argument("--version", action="version", version=f"miles-hpc {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run on this machine (embedded engine + FSDP2 by default)")
    run.add_argument("config", help="YAML config file")
    run.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    run.set_defaults(func=_cmd_run)

    init = sub.add_parser("init-model", help="write a random-init HF-format checkpoint with a local tokenizer")
    init.add_argument("--arch", required=True, choices=ARCHS)
    init.add_argument("--size", default="tiny", choices=SIZES)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("out_dir")
    init.set_defaults(func=_cmd_init_model)

    insp = sub.add_parser("inspect", help="summarise HDF5 trajectory shards (a file, a directory or a run dir)")
    insp.add_argument("path")
    insp.set_defaults(func=_cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
