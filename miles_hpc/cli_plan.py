"""``miles-hpc plan`` (docs/planning.md): memory and weight-sync estimates, megatron layouts, and the sync model
against Miles' published update times. The CLI's other commands are in miles_hpc/cli.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from miles_hpc.config import ConfigError


def _plan_inputs(args: argparse.Namespace) -> tuple[dict[str, Any], str, str, dict[str, int]]:
    """(model config, its source, a name, cluster numbers from a run config) for ``plan``."""
    from miles_hpc.config import load_config
    from miles_hpc.models.presets import preset_config
    from miles_hpc.planner.estimate import load_model_config

    if not str(args.config).endswith((".yaml", ".yml")):  # a model: name in configs/models, config.json or dir
        if args.model:
            raise ConfigError(f"--model {args.model}: only applies when CONFIG is a run config (YAML)")
        cfg, source = load_model_config(args.config)
        return cfg, source, Path(source).stem if Path(source).stem != "config" else Path(source).parent.name, {}
    run = load_config(args.config)
    r = run.rollout
    cluster = {"train_gpus": run.train.world_size, "engines": r.num_engines, "engine_tp": r.engine_tp}
    cluster["engine_ep"] = r.engine_ep
    if model := args.model or run.model.path:
        cfg, source = load_model_config(model)
    else:
        cfg = preset_config(run.model.init_arch, run.model.init_size)
        source = f"{args.config}: model.init_arch={run.model.init_arch}, model.init_size={run.model.init_size}"
    return cfg, source, run.name, cluster


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from miles_hpc.planner.estimate import Cluster, ModelSpecError, check_spec, estimate, format_table
    from miles_hpc.planner.transfer import PlanError

    flags = {
        "train_gpus": args.train_gpus,
        "engines": args.engines,
        "engine_tp": args.engine_tp,
        "engine_ep": args.engine_ep,
        "link_gbits": args.link_gbps,
        "gpu_mem_gb": args.gpu_mem_gb,
        "delta_ratio": args.delta_ratio,
        "rollout_bytes": {"bf16": 2, "fp8": 1}.get(args.rollout_dtype),
        "train_tp": args.train_tp,
        "train_pp": args.train_pp,
        "train_cp": args.train_cp,
        "train_ep": args.train_ep,
        "gpus_per_node": args.gpus_per_node,
        "bucket_gb": args.bucket_gb,
        "engine_dp_attention": args.engine_dp_attention or None,
    }
    if args.published:
        return _plan_published(args)
    if args.config is None:
        print("error: plan: a CONFIG (run config, model config or name) is needed, or --published", file=sys.stderr)
        return 2
    if args.layouts:
        return _plan_layouts(args)
    try:
        cfg, source, name, numbers = _plan_inputs(args)
        check_spec(cfg, source)
        cluster: dict[str, Any] = {**numbers, **{k: v for k, v in flags.items() if v is not None}}
        batch = None
        if str(args.config).endswith((".yaml", ".yml")):  # the run's own largest micro-batch
            from miles_hpc.config import load_config
            from miles_hpc.launch.layout_check import fsdp_batch

            batch = fsdp_batch(load_config(args.config))
        report = estimate(cfg, Cluster(**cluster), name=name, source=source, batch=batch)
    except ModelSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PlanError as e:  # the model does not split over the engine layout asked for
        print(
            f"error: {source}: {e} (engine_tp={cluster['engine_tp']}, engine_ep={cluster['engine_ep']})",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _plan_published(args: argparse.Namespace) -> int:
    """`plan --published`: the calibrated sync model against Miles' published update times (docs/planning.md)."""
    import json

    from miles_hpc.planner import published, sync_time

    recs = published.rows()
    for r in recs:
        print(json.dumps(r))
    if not args.json:
        print(published.format_rows(recs))
        print("constants: " + ", ".join(f"{k} {v:g}" for k, v in sync_time.constants().items()))
        print(f"fitted: MLA_LOAD_S on {published.LOAD_FIT} broadcast, REPLICA_GBPS on {published.REPLICA_FIT} p2p")
        print(f"source: {published.SOURCE}")
    return 0


def _plan_layouts(args: argparse.Namespace) -> int:
    """`plan --layouts`: every megatron layout of the trainer GPUs on `--node`, best first (docs/planning.md)."""
    import dataclasses
    import json

    from miles_hpc.planner.estimate import ModelSpecError, check_spec
    from miles_hpc.planner.layouts import NODES, Batch, assumptions, search

    if args.node not in NODES:
        print(f"error: --node {args.node}: one of {', '.join(NODES)}", file=sys.stderr)
        return 2
    node = NODES[args.node]
    over = {"gpus": args.gpus_per_node, "gpu_mem_gb": args.gpu_mem_gb, "host_mem_gb": args.host_mem_gb}
    try:
        cfg, source, name, cluster = _plan_inputs(args)
        check_spec(cfg, source)
        node = dataclasses.replace(node, **{k: v for k, v in over.items() if v is not None})
        gpus = args.train_gpus or cluster.get("train_gpus") or 32
        batch = Batch(seq_len=args.seq_len or 4096)
        found = search(cfg, gpus, node, batch, limits=not args.unbuilt, max_cp=args.max_cp)
    except ModelSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [c.summary(node) for c in found]
    if args.json:
        print(json.dumps({"model": name, "gpus": gpus, "node": dataclasses.asdict(node), "layouts": rows}))
        return 0
    print(
        f"{name}: {gpus} training GPUs on {node.name} nodes ({node.gpus} x {node.gpu_mem_gb:g} GB, "
        f"{node.host_mem_gb:g} GB host); micro-batch {batch.seq_len} tokens"
    )
    fits = [r for r in rows if r["fits"]]
    unbuilt = " (counting what the trainer does not build yet: --unbuilt)" if args.unbuilt else ""
    print(f"{len(fits)} of {len(rows)} layouts fit{unbuilt}" + ("" if fits else "; the closest:"))
    for r in (fits or rows)[: args.top]:
        print(f"  {r['layout']}: " + _layout_line(r))
    failing = [r for r in rows if not r["fits"]]
    if fits and failing:
        print("the others fail, e.g.:")
        for r in failing[: args.top]:
            print(f"  {r['layout']}: {'; '.join(r['problems'])}")
    for line in assumptions(node, batch):
        print(f"- {line}")
    return 0


def _layout_line(r: dict[str, Any]) -> str:
    if "gpu_gb" not in r:
        return "; ".join(r["problems"])
    opts = [f"offload {r['offload_fraction']:g}" if r["offload_fraction"] else "no offload"]
    opts += ["precision-aware"] if r["precision_aware"] else []
    opts += ["bf16 grads"] if r["main_grads_bf16"] else []
    opts += [f"{r['recompute']} recompute"] if r["recompute"] != "none" else []
    line = (
        f"{', '.join(opts)}: {r['gpu_gb']:.1f} GB/GPU (weights {r['weights_gb']:.1f}, grads {r['grads_gb']:.1f}, "
        f"optimizer {r['optimizer_gpu_gb']:.1f}, activations {r['activations_gb']:.1f}; stage {r['stage']}), "
        f"host {r['host_per_node_gb']:.1f} GB/node"
    )
    return line + (f" -- {'; '.join(r['problems'])}" if r["problems"] else "")


def add_plan_parser(sub: Any) -> None:
    """The `plan` subcommand on ``sub`` (argparse subparsers)."""
    pl = sub.add_parser("plan", help="memory and weight-sync time estimates for a cluster and model (docs/planning.md)")
    pl.add_argument(
        "config",
        nargs="?",
        help="run config YAML, a model config JSON / checkpoint dir, or a name in configs/models (kimi_k2, glm52)",
    )
    pl.add_argument("--model", help="with a run config: plan this model (path or name) instead of model.path")
    pl.add_argument("--train-gpus", type=int, help="trainer ranks (default: train.world_size, or 32)")
    pl.add_argument("--engines", type=int, help="rollout engines (default: rollout.num_engines, or 4)")
    pl.add_argument(
        "--engine-tp",
        type=int,
        help="GPUs (tensor-parallel ranks) per engine (default: rollout.engine_tp of a run config, 8 for a model)",
    )
    pl.add_argument("--engine-ep", type=int, help="expert-parallel size inside an engine; divides --engine-tp")
    pl.add_argument("--link-gbps", type=float, help="NIC line rate per GPU in Gb/s (default 200 = 25 GB/s)")
    pl.add_argument("--rollout-dtype", choices=["bf16", "fp8"], help="engine weight dtype (default bf16)")
    pl.add_argument("--gpu-mem-gb", type=float, help="GPU memory in GB for the fit checks (default 141, H200)")
    pl.add_argument("--delta-ratio", type=float, help="delta bytes / full bytes (default 0.0112, measured)")
    pl.add_argument("--train-tp", type=int, help="trainer tensor-parallel size, for the sync model (default 1)")
    pl.add_argument("--train-pp", type=int, help="trainer pipeline stages, for the sync model (default 1)")
    pl.add_argument("--train-cp", type=int, help="trainer context-parallel size, for the sync model (default 1)")
    pl.add_argument("--train-ep", type=int, help="trainer expert-parallel size, for the sync model (default 1)")
    pl.add_argument("--bucket-gb", type=float, help="GB gathered per weight-sync bucket (default 1)")
    pl.add_argument(
        "--engine-dp-attention",
        action="store_true",
        help="engines run SGLang DP attention (every engine rank holds the non-expert weights)",
    )
    pl.add_argument(
        "--published",
        action="store_true",
        help="the calibrated sync model against Miles' published update times: one JSON line per case, and a table",
    )
    pl.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    pl.add_argument(
        "--layouts",
        action="store_true",
        help="megatron training layouts: the best that fits --node (with its memory options) and why others fail",
    )
    pl.add_argument("--node", default="h200", help="with --layouts: node kind (h200, b300, gb300, mi300x)")
    pl.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8; with --layouts: the node's)")
    pl.add_argument("--host-mem-gb", type=float, help="with --layouts: override the node's host memory (GB)")
    pl.add_argument(
        "--seq-len", type=int, help="with --layouts: tokens per micro-batch (train.max_tokens_per_microbatch)"
    )
    pl.add_argument(
        "--max-cp",
        type=int,
        default=1,
        help="with --layouts: also try context parallelism up to this size (1, 2, 4, 8)",
    )
    pl.add_argument("--top", type=int, default=5, help="with --layouts: how many layouts to print")
    pl.add_argument(
        "--unbuilt",
        action="store_true",
        help="with --layouts: also layouts and options the megatron trainer does not build yet (what they would buy)",
    )
    pl.set_defaults(func=_cmd_plan)
