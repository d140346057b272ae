"""What the fault campaign's tests share: a real `miles-hpc run` as a child process, waiting on its progress, and the
exact sample accounting every scenario ends with (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from miles_hpc.data.prompts import PromptIterator
from miles_hpc.data.reader import TrajectoryReader
from miles_hpc.data.tasks import make_task

REPO = Path(__file__).resolve().parents[2]
PROMPTS, SAMPLES = 2, 2  # per step: 4 samples a step keeps every scenario's run to seconds
SMALL = [
    f"rollout.prompts_per_step={PROMPTS}",
    f"rollout.samples_per_prompt={SAMPLES}",
    "rollout.max_new_tokens=4",
    "train.sft_warmup_steps=0",
    "store.max_shard_bytes=4096",  # several shards per run: rolls happen between checkpoints too
]


def argv(run_dir: Path, *overrides: str, config: str = "configs/tiny_cpu.yaml") -> list[str]:
    return [sys.executable, "-m", "miles_hpc.cli", "run", str(REPO / config), f"run_dir={run_dir}", *SMALL, *overrides]


def run(
    run_dir: Path, *overrides: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """A whole run to its end (whatever its exit code)."""
    return subprocess.run(
        argv(run_dir, *overrides),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def start(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A run in the background, its output in RUN.out (read with :func:`output`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = open(run_dir.parent / f"{run_dir.name}.out", "a")
    return subprocess.Popen(
        argv(run_dir, *overrides),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def output(run_dir: Path) -> str:
    path = run_dir.parent / f"{run_dir.name}.out"
    return path.read_text() if path.exists() else ""


def finish(proc: subprocess.Popen[str], run_dir: Path, timeout: float) -> int:
    """The run's exit code once it ends; past ``timeout``, every process of the run prints its threads' stacks
    (SIGQUIT: `miles_hpc.faults.enable_stack_dumps`), is killed, and the test fails with the output's tail and the
    stacks where each process waited: a hang in CI says where it hung."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        files = [run_dir.parent / f"{run_dir.name}.out", *sorted((run_dir / "logs").glob("*.log"))]
        before, tail = {f: f.stat().st_size for f in files}, output(run_dir)[-3000:]
        pids = run_processes(run_dir)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGQUIT)
        time.sleep(3)
        proc.kill()
        for pid in run_processes(run_dir):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        dumps = []
        for f, size in before.items():
            with open(f, errors="replace") as fh:
                fh.seek(size)
                dumps.append(f"--- {f.name}, after SIGQUIT:\n{fh.read()[:6000]}")
        raise AssertionError(
            f"the run did not end within {timeout:.0f} s; its processes {pids} dumped their stacks\n"
            f"--- the run's output (tail):\n{tail}\n" + "\n".join(dumps)
        ) from None


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass  # a line torn by a kill
    return out


def wait_for(what: str, check, timeout: float = 120.0, proc: subprocess.Popen[str] | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def engine_pids(run_dir: Path) -> dict[int, int]:
    """Engine index -> pid, from the rendezvous records the engines write when they listen."""
    out = {}
    for f in (run_dir / "rendezvous").glob("engine-*.json"):
        try:
            rec = json.loads(f.read_text())
            out[int(f.stem.split("-")[1])] = int(rec["pid"])
        except (ValueError, KeyError, OSError):
            pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def run_processes(run_dir: Path) -> list[int]:
    """PIDs of live processes whose command line names this run directory (engines, trainer ranks, the run)."""
    out = []
    key = str(run_dir)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if key in cmd and alive(int(d.name)):
            out.append(int(d.name))
    return out


def no_orphans(run_dir: Path, timeout: float = 15.0) -> None:
    """Nothing of the run is left running (engines are found by the run dir in their flags)."""
    deadline = time.monotonic() + timeout
    while run_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = run_processes(run_dir)
    if left:
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        raise AssertionError(f"processes of {run_dir} outlived the run: {left}")


@dataclass(frozen=True)
class Stored:
    train_step: np.ndarray
    prompt_id: np.ndarray
    group_id: np.ndarray
    token_hash: list[str]
    shards: list[Path]


def stored(run_dir: Path) -> Stored:
    """Every sample of the run's complete shards (quarantine/ excluded)."""
    shards = sorted((run_dir / "trajectories").glob("*.h5"))
    steps, pids, gids, hashes = [], [], [], []
    for shard in shards:
        for s in TrajectoryReader(shard):
            steps.append(s.train_step)
            pids.append(s.prompt_id)
            gids.append(s.group_id)
            hashes.append(s.token_hash)
    return Stored(np.array(steps), np.array(pids), np.array(gids), hashes, shards)


def expected_prompts(steps: int, seed: int = 0) -> list[list[int]]:
    """The prompt ids each step draws, as the run's seeded iterator draws them (no dynamic sampling)."""
    it = PromptIterator(make_task("arith", n=4096, seed=seed), batch_size=PROMPTS, seed=seed, shuffle=True)
    return [[r.prompt_id for r in it.next_batch()] for _ in range(steps)]


def assert_exactly_once(run_dir: Path, steps: int, *, skipped: Sequence[int] = (), in_order: bool = True) -> Stored:
    """The accounting every scenario ends with: each of ``steps`` steps stored exactly its drawn prompts' samples
    once, no group in two places, metrics.jsonl has each step once. ``in_order=False`` (fully async: groups are
    trained as they finish): each prompt in exactly one group instead of step by step in draw order."""
    got = stored(run_dir)
    counts = Counter(got.train_step.tolist())
    assert sorted(counts) == list(range(steps)), f"stored steps {sorted(counts)}, expected 0..{steps - 1}"
    per_step = PROMPTS * SAMPLES
    wrong = {s: n for s, n in counts.items() if n != per_step and s not in skipped}
    assert not wrong, f"steps stored with the wrong number of samples (expected {per_step}): {wrong}"
    drawn = expected_prompts(steps)
    if not in_order:
        per_prompt = Counter(zip(got.prompt_id.tolist(), got.group_id.tolist()))
        prompts = Counter(p for p, _ in per_prompt)
        assert all(n == 1 for n in prompts.values()), f"prompts trained in more than one group: {prompts}"
        drawn = []
    for step in range(len(drawn)):
        if step in skipped:
            continue
        ids = sorted(got.prompt_id[got.train_step == step].tolist())
        assert ids == sorted(p for p in drawn[step] for _ in range(SAMPLES)), f"step {step} trained prompts {ids}"
    by_group = Counter(got.group_id.tolist())
    assert all(n == SAMPLES for n in by_group.values()), f"groups stored more or less than once: {by_group}"
    logged = steps_logged(run_dir)
    assert logged == list(range(steps)), f"metrics.jsonl steps {logged}"
    from miles_hpc.data.completeness import missing_samples

    assert missing_samples(run_dir) == [], "metrics.jsonl's rollout/samples disagree with the shards"
    return got
