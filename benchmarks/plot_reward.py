"""Reward against wall-clock time for several runs, as an SVG (no plotting library needed), plus one JSON line per
run: its final reward (mean of the last `--window` steps) and when it first reached the first run's final reward
(the reference: list the sync run first to ask "does async get there sooner?").

    python benchmarks/plot_reward.py RUN_A RUN_B --labels sync,fully_async --out docs/img/async_reward_cpu.svg

Each RUN is a run directory (its metrics.jsonl: `reward_mean` and `time/elapsed_s` per step); the curve is the
reward averaged over the last `--window` steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
W, H, PAD = 640, 380, 56


def curve(run: Path, window: int) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = []
    for i, r in enumerate(rows):
        recent = rows[max(0, i - window + 1) : i + 1]
        out.append((r["time/elapsed_s"], statistics.fmean(x["reward_mean"] for x in recent)))
    return out


def svg(curves: dict[str, list[tuple[float, float]]], title: str) -> str:
    t_max = max(t for c in curves.values() for t, _ in c)
    r_max = max(1e-9, max(r for c in curves.values() for _, r in c))
    r_max = min(1.0, round(r_max + 0.05, 1))

    def xy(t: float, r: float) -> str:
        return f"{PAD + (W - 2 * PAD) * t / t_max:.1f},{H - PAD - (H - 2 * PAD) * r / r_max:.1f}"

    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
            f'font-size="12"><rect width="{W}" height="{H}" fill="white"/>'
        ),
        f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<text x="{W / 2}" y="{H - 16}" text-anchor="middle">wall-clock seconds</text>',
        f'<text x="16" y="{H / 2}" transform="rotate(-90 16 {H / 2})" text-anchor="middle">mean reward</text>',
    ]
    for k in range(6):
        t, r = t_max * k / 5, r_max * k / 5
        x, y = xy(t, 0).split(",")[0], xy(0, r).split(",")[1]
        parts.append(f'<text x="{x}" y="{H - PAD + 16}" text-anchor="middle">{t:.0f}</text>')
        parts.append(f'<text x="{PAD - 6}" y="{float(y) + 4}" text-anchor="end">{r:.2f}</text>')
    for i, (label, c) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(xy(t, r) for t, r in c)}"/>'
        )
        parts.append(f'<text x="{PAD + 10}" y="{PAD + 16 * i}" fill="{color}">{label}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--labels", help="comma-separated, one per run (default: directory names)")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--title", default="reward vs wall-clock")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [r.name for r in args.runs]
    curves = {label: curve(run, args.window) for label, run in zip(labels, args.runs, strict=True)}
    target = next(iter(curves.values()))[-1][1]  # the reference run's final reward
    for label, c in curves.items():
        reached = next((t for t, r in c if r >= target), None)
        print(
            json.dumps(
                {
                    "bench": "reward_vs_time",
                    "run": label,
                    "steps": len(c),
                    "wall_s": round(c[-1][0], 1),
                    "final_reward": round(c[-1][1], 3),
                    "target_reward": round(target, 3),
                    "reached_target_s": None if reached is None else round(reached, 1),
                }
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg(curves, args.title))


if __name__ == "__main__":
    main()
