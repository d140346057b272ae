"""Summaries of trajectory shards for ``miles-hpc inspect PATH`` (stage: data; docs/design.md sections 7 and 8).

:func:`summarize` reads the flat datasets directly (no Sample objects), so it is cheap on large runs; it validates
every shard with the same checks as the reader, reads every chunk once (so a chunk failing its fletcher32 checksum
fails it) and raises :class:`TrajectoryFileError` for bad input. Values are not checked one by one (no hashes):
that is :mod:`miles_hpc.data.verify` (``inspect --verify``).
Invariants of the returned dict (JSON-serialisable; keys are stable for scripts and tests):

- token counts split ``tokens = prompt_tokens + response_tokens``; ``loss_tokens`` counts loss_mask == 1.
- ``reward_std`` is the population standard deviation (ddof=0); mean/std are over the finite rewards only, None
  when there are none. ``reward_nonfinite`` counts the others: the writer never stores one, so any is damage
  (``miles-hpc inspect`` warns and exits 1; ``--verify`` names the samples, :mod:`miles_hpc.data.verify`).
- ``status_counts`` lists every status name, zeros included, in enum order.
- ``policy_version_min/max`` range over generated tokens only (version >= 0); None when there are none.
- ``routing.coverage`` = samples with routing / samples (0.0 with no samples); ``indexer`` the same for indexer
  records (``samples_with_indexer``, ``coverage``, ``rows``, ``shapes`` [layers, index_topk], ``dtypes``,
  ``max_context``), zero / empty / None over shards without an ``/indexer`` group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np

from miles_hpc.data.sample import SampleStatus
from miles_hpc.data.schema import TrajectoryFileError, find_shards, iter_rows, open_shard

__all__ = ["format_summary", "summarize"]


class _Records:
    """Per-row records of one kind (routing or indexer) across shards: the samples that have them, rows, (layers,
    k) shapes, dtypes, and the writer's bound attribute (num_experts / max_context; -1 = unknown)."""

    def __init__(self, name: str, bound: str) -> None:
        self.name, self.bound = name, bound
        self.samples = self.rows = 0
        self.shapes: set[tuple[int, int]] = set()
        self.dtypes: set[str] = set()
        self.bounds: set[int] = set()

    def add(self, group: h5py.Group, data: str) -> None:
        ds = group[data]
        self.samples += int(np.count_nonzero(np.diff(group["offsets"][()])))
        self.rows += ds.shape[0]
        if ds.shape[0]:
            self.shapes.add((int(ds.shape[1]), int(ds.shape[2])))
        self.dtypes.add(str(ds.dtype))
        self.bounds.add(int(group.attrs.get(self.bound, -1)))

    def summary(self, n: int) -> dict[str, Any]:
        known = sorted(k for k in self.bounds if k >= 0)
        return {
            f"samples_with_{self.name}": self.samples,
            "coverage": self.samples / n if n else 0.0,
            "rows": self.rows,
            # [layers, k]; more than one entry means shards from writers that disagree.
            "shapes": [list(t) for t in sorted(self.shapes)],
            # Only shards that hold records say which dtype the writer chose for them.
            "dtypes": sorted(self.dtypes) if self.samples else [],
            self.bound: known[0] if len(known) == 1 else (known or None),
        }


def summarize(path: str | Path) -> dict[str, Any]:
    """Summarise one shard, a directory of shards, or a run directory (its ``trajectories/``)."""
    shards, partials = find_shards(path)
    rewards: list[np.ndarray] = []
    statuses = np.zeros(len(SampleStatus), dtype=np.int64)
    prompt = response = loss = 0
    vmin: int | None = None
    vmax: int | None = None
    routing, indexer = _Records("routing", "num_experts"), _Records("indexer", "max_context")
    models: set[str] = set()
    run_ids: set[str] = set()
    for shard in shards:
        f, n = open_shard(shard)
        try:
            with f:
                s = f["samples"]
                offsets = s["token_offsets"][()]
                prompt_len = s["prompt_len"][()].astype(np.int64)
                prompt += int(prompt_len.sum())
                response += int(offsets[-1] - prompt_len.sum())
                loss += int(np.count_nonzero(s["loss_mask"][()]))
                rewards.append(s["reward"][()].astype(np.float64))
                status = s["status"][()]
                if n and int(status.max()) >= len(SampleStatus):
                    raise TrajectoryFileError(shard, f"samples/status holds unknown value {int(status.max())}")
                statuses += np.bincount(status, minlength=len(SampleStatus))
                versions = s["policy_version"][()]
                generated = versions[versions >= 0]
                if generated.size:
                    lo, hi = int(generated.min()), int(generated.max())
                    vmin = lo if vmin is None else min(vmin, lo)
                    vmax = hi if vmax is None else max(vmax, hi)
                routing.add(f["routing"], "experts")
                if "indexer" in f:  # optional: older shards, and shards without records, have none
                    indexer.add(f["indexer"], "topk")
                models.add(str(f.attrs["model"]))
                run_ids.add(str(f.attrs["run_id"]))
                _read_the_rest(f)
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise TrajectoryFileError(shard, f"cannot summarise ({type(e).__name__}: {e})") from e
    reward = np.concatenate(rewards) if rewards else np.zeros(0)
    n_samples = int(reward.size)
    finite = reward[np.isfinite(reward)]
    return {
        "path": str(path),
        "shards": len(shards),
        "partial_shards": len(partials),
        "shard_paths": [str(p) for p in shards],
        "partial_paths": [str(p) for p in partials],
        "models": sorted(models),
        "run_ids": sorted(run_ids),
        "samples": n_samples,
        "prompt_tokens": prompt,
        "response_tokens": response,
        "loss_tokens": loss,
        "reward_mean": float(finite.mean()) if finite.size else None,
        "reward_std": float(finite.std()) if finite.size else None,
        "reward_nonfinite": n_samples - int(finite.size),
        "status_counts": {st.name: int(statuses[st.value]) for st in SampleStatus},
        "policy_version_min": vmin,
        "policy_version_max": vmax,
        "routing": routing.summary(n_samples),
        "indexer": indexer.summary(n_samples),
    }


def _read_the_rest(f: h5py.File) -> None:
    """Read the datasets the summary does not use, so that a chunk failing its checksum (bytes changed on disk)
    fails ``inspect`` too, not only ``inspect --verify``."""
    for name in ("tokens", "rollout_logprobs", "token_offsets", "group_id", "train_step", "prompt_id", "token_hash"):
        if name in f["samples"]:
            f["samples"][name][()]
    if f["routing/experts"].size:
        f["routing/experts"][()]
    if "indexer" in f:
        for _ in iter_rows(f["indexer/topk"]):  # in bounded blocks: indexer records are big
            pass


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable text for a :func:`summarize` result (what ``miles-hpc inspect`` prints)."""
    s = summary
    r = s["routing"]
    n = s["samples"]

    def per_sample(tokens: int) -> str:
        return f"{tokens:,}" + (f"  ({tokens / n:.1f}/sample)" if n else "")

    status = ", ".join(f"{k.lower()} {v}" for k, v in s["status_counts"].items())
    if s["reward_mean"] is None:
        reward = "-"
    else:
        reward = f"mean {s['reward_mean']:.4f}  std {s['reward_std']:.4f}"
    if s["reward_nonfinite"]:
        reward += f"  (WARNING: {s['reward_nonfinite']} not finite, left out: damaged, see inspect --verify)"
    if s["policy_version_min"] is None:
        versions = "-"
    else:
        versions = f"{s['policy_version_min']} .. {s['policy_version_max']}"
    if r["samples_with_routing"]:
        shapes = ", ".join(f"{layers} layers x top-{k}" for layers, k in r["shapes"])
        experts = r["num_experts"] if r["num_experts"] is not None else "unknown"
        routing = (
            f"{r['samples_with_routing']}/{n} samples ({r['coverage']:.1%}), {r['rows']:,} rows, {shapes}, "
            f"dtype {'/'.join(r['dtypes'])}, experts {experts}"
        )
    else:
        routing = "none"
    x = s["indexer"]
    if x["samples_with_indexer"]:
        shapes = ", ".join(f"{layers} layers x top-{k}" for layers, k in x["shapes"])
        context = x["max_context"] if x["max_context"] is not None else "unknown"
        indexer = (
            f"{x['samples_with_indexer']}/{n} samples ({x['coverage']:.1%}), {x['rows']:,} rows, {shapes}, "
            f"dtype {'/'.join(x['dtypes'])}, max context {context}"
        )
    else:
        indexer = "none"
    partial = f"  ({s['partial_shards']} partial, not read: {', '.join(Path(p).name for p in s['partial_paths'])})"
    lines = [
        f"trajectories: {s['path']}",
        f"  shards           {s['shards']}" + (partial if s["partial_shards"] else ""),
        f"  model / run      {', '.join(s['models']) or '-'} / {', '.join(s['run_ids']) or '-'}",
        f"  samples          {n:,}",
        f"  prompt tokens    {per_sample(s['prompt_tokens'])}",
        f"  response tokens  {per_sample(s['response_tokens'])}",
        f"  loss tokens      {per_sample(s['loss_tokens'])}",
        f"  reward           {reward}",
        f"  status           {status}",
        f"  policy versions  {versions}",
        f"  routing          {routing}",
        f"  indexer          {indexer}",
    ]
    return "\n".join(lines)
