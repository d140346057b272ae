"""One JSON line per run of `benchmarks/opd_demo.sh`: mean reward, response length and reverse KL to the teacher
over the first, middle and last 10 steps (read from each run's metrics.jsonl).

    python benchmarks/opd_summary.py RUN [RUN ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = {"reward": "reward_mean", "length": "response_len_mean", "reverse_kl": "opd/reverse_kl"}


def summary(run: Path, window: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward_mean" in r]  # RL steps only
    n = len(rows)
    spans = {"first": rows[:window], "middle": rows[n // 2 : n // 2 + window], "last": rows[-window:]}
    out: dict = {"run": str(run), "steps": n}
    for name, key in KEYS.items():
        if all(key in r for r in rows):
            out[name] = {s: round(statistics.fmean(r[key] for r in span), 3) for s, span in spans.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--window", type=int, default=10)
    args = p.parse_args()
    for run in args.runs:
        print(json.dumps(summary(run, args.window)))


if __name__ == "__main__":
    main()
