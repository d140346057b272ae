"""Miles' published weight-update times and the layouts behind them (stage: sync; docs/planning.md).

Source of every figure: the LMSYS blog post "Updating 1T parameters in seconds -- P2P weight transfer in Large
Scale Distributed RL" (2026-04-29, lm-sys/lm-sys.github.io ``blog/2026-04-29-p2p-update.md``), table "Implementation
Results": H100 hosts of 8 GPUs with InfiniBand, time from the engines' pause to ``continue_generation``. Engine
counts and bucket sizes are those of Miles' profiling scripts named per case (radixark/miles
``examples/p2p_weight_transfer/``). The NIC rate is not stated in either: 400 Gb/s per GPU (one HCA per GPU, as the
scripts' ``ibp0``-``ibp7`` device map shows) is our assumption.

The figures are what :func:`table` compares the model with; the model's two fitted constants are refitted here
(:func:`fit_mla_load_s`, :func:`fit_replica_gbps`) so that a test can check the values in ``sync_time``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from miles_hpc.planner import sync_time
from miles_hpc.planner.estimate import load_model_config
from miles_hpc.planner.sync_time import SyncLayout

SOURCE = "lm-sys/lm-sys.github.io blog/2026-04-29-p2p-update.md, table 'Implementation Results'"
GIB = 1024**3 / 1e9  # the scripts' buffer sizes are GiB; SyncLayout.bucket_gb is GB


@dataclass(frozen=True, slots=True)
class Case:
    """One published row: the model, the layout (trainer as the blog, engines and buckets as the script), the
    published seconds."""

    name: str
    model: str  # a name in configs/models
    layout: SyncLayout
    broadcast_s: float
    p2p_s: float
    script: str


CASES: tuple[Case, ...] = (
    Case(
        name="Qwen3-235B-A22B",
        model="qwen3_235b",
        layout=SyncLayout(
            train_gpus=64,
            train_tp=4,
            train_pp=4,
            train_cp=2,
            train_ep=16,
            engines=2,
            engine_gpus=32,
            engine_ep=32,
            engine_dp_attention=True,
            bucket_gb=1 * GIB,
        ),
        broadcast_s=10.7536,
        p2p_s=3.1620,
        script="run-qwen3-235B-A22B-16node-profile.sh (64 + 64 GPUs, 32 per engine, buffer 1 GiB)",
    ),
    Case(
        name="GLM-5",
        model="glm5",
        layout=SyncLayout(
            train_gpus=128,
            train_tp=4,
            train_pp=8,
            train_cp=2,
            train_ep=16,
            engines=2,
            engine_gpus=64,
            engine_ep=64,
            engine_dp_attention=True,
            bucket_gb=2 * GIB,
        ),
        broadcast_s=58.3015,
        p2p_s=8.4797,
        script="run-glm5-disagg-profile.sh GLM-5 (128 + 128 GPUs, 64 per engine, buffer 2 GiB)",
    ),
    Case(
        name="Kimi-K2 (fp8 rollout)",
        model="kimi_k2",
        layout=SyncLayout(
            train_gpus=256,
            train_tp=8,
            train_pp=8,
            train_cp=4,
            train_ep=32,
            engines=8,
            engine_gpus=32,
            engine_ep=32,
            engine_dp_attention=True,
            rollout_bytes=1,
            bucket_gb=2 * GIB,
        ),
        broadcast_s=53.2791,
        p2p_s=7.2273,
        script="run-kimi-k2-64node-profile.sh (256 + 256 GPUs, 32 per engine, buffer 2 GiB)",
    ),
)
LOAD_FIT = "GLM-5"  # the case MLA_LOAD_S is fitted on (broadcast)
REPLICA_FIT = "Qwen3-235B-A22B"  # the case REPLICA_GBPS is fitted on (p2p)


def _case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def _bisect(f: Any, lo: float, hi: float, target: float) -> float:
    """x in [lo, hi] with f(x) = target, f decreasing in x."""
    for _ in range(100):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) > target else (lo, mid)
    return (lo * hi) ** 0.5


def fit_mla_load_s() -> float:
    """MLA_LOAD_S at which the broadcast model gives :data:`LOAD_FIT`'s published time."""
    c = _case(LOAD_FIT)
    cfg, _ = load_model_config(c.model)
    w = sync_time.weights(cfg, c.layout.rollout_bytes)
    old = sync_time.MLA_LOAD_S

    def at(x: float) -> float:
        sync_time.MLA_LOAD_S = 1 / x  # decreasing in x, as _bisect wants
        return sync_time.broadcast(cfg, c.layout, w)["seconds"]

    try:
        return 1 / _bisect(at, 1.0, 1e9, c.broadcast_s)
    finally:
        sync_time.MLA_LOAD_S = old


def fit_replica_gbps() -> float:
    """REPLICA_GBPS at which the p2p model gives :data:`REPLICA_FIT`'s published time."""
    c = _case(REPLICA_FIT)
    cfg, _ = load_model_config(c.model)
    w = sync_time.weights(cfg, c.layout.rollout_bytes)
    old = sync_time.REPLICA_GBPS

    def at(x: float) -> float:
        sync_time.REPLICA_GBPS = x
        return sync_time.p2p(cfg, c.layout, w)["seconds"]

    try:
        return _bisect(at, 1.0, 1e6, c.p2p_s)
    finally:
        sync_time.REPLICA_GBPS = old


def rows(cases: tuple[Case, ...] = CASES) -> list[dict[str, Any]]:
    """One record per case: inputs, predicted and published seconds, their ratio, the model's terms."""
    out = []
    for c in cases:
        cfg, _ = load_model_config(c.model)
        m = sync_time.model(cfg, c.layout)
        bc, p2p = m["broadcast"], m["p2p"]
        out.append(
            {
                "case": c.name,
                "model": c.model,
                "layout": _layout(c.layout),
                "weights_gb": m["weights_gb"],
                "broadcast": {
                    "predicted_s": bc["seconds"],
                    "published_s": c.broadcast_s,
                    "ratio": bc["seconds"] / c.broadcast_s,
                    "fitted_here": c.name == LOAD_FIT,
                    "terms": bc,
                },
                "p2p": {
                    "predicted_s": p2p["seconds"],
                    "published_s": c.p2p_s,
                    "ratio": p2p["seconds"] / c.p2p_s,
                    "fitted_here": c.name == REPLICA_FIT,
                    "terms": p2p,
                },
                "source": SOURCE,
                "script": c.script,
            }
        )
    return out


def _layout(s: SyncLayout) -> dict[str, Any]:
    return {
        "train": f"TP{s.train_tp} PP{s.train_pp} CP{s.train_cp} EP{s.train_ep}, {s.train_gpus} GPUs",
        "engines": f"{s.engines} x {s.engine_gpus} GPUs, EP{s.engine_ep}"
        + (", DP attention" if s.engine_dp_attention else ""),
        "gpus_per_node": s.gpus_per_node,
        "link_gbits": s.link_gbits,
        "rollout_dtype": "fp8" if s.rollout_bytes == 1 else "bf16",
        "bucket_gb": s.bucket_gb,
    }


def with_layout(case: Case, **changes: Any) -> Case:
    """``case`` with its layout changed (what-if checks)."""
    return replace(case, layout=replace(case.layout, **changes))


def format_rows(recs: list[dict[str, Any]]) -> str:
    """The calibration table as Markdown (docs/planning.md carries its output)."""
    head = "| case | train | engines | weights GB | broadcast s: model / published (ratio) | p2p s: model / published (ratio) |"
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for r in recs:
        cells = []
        for path in ("broadcast", "p2p"):
            p = r[path]
            fit = " fitted" if p["fitted_here"] else ""
            cells.append(f"{p['predicted_s']:.2f} / {p['published_s']:.2f} ({p['ratio']:.2f}{fit})")
        lay = r["layout"]
        engines = f"{lay['engines']}, {lay['rollout_dtype']}"
        lines.append(f"| {r['case']} | {lay['train']} | {engines} | {r['weights_gb']:,.0f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)
