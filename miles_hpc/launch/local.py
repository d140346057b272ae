"""Processes of a run on one machine (stage: cluster; docs/design.md section 3, "On one machine").

`miles-hpc run` starts the same workers Slurm would, as local subprocesses: one engine server per engine
(`miles-hpc serve`, which writes `RUN/rendezvous/engine-<i>.json` when it listens) and trainer ranks 1..W-1
(`miles-hpc worker --role train`); the calling process is trainer rank 0, the controller.

Invariants: every process is started and stopped by handle (never by name: nodes may be shared); API keys are
generated per run into `RUN/keys/` with mode 0600 and passed as files, never on a command line; `stop()` is
idempotent and always runs (context manager), so no engine outlives the run; every child is told this process's
PID (``MILES_PARENT_PID``) and exits when this process dies, even by SIGKILL (cluster/lease.py). An engine that
dies is started again by `restart_engine` with the same flags (launch/supervisor.py decides when).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_hpc.cluster.lease import PARENT_PID_ENV
from miles_hpc.config import ConfigError, RunConfig
from miles_hpc.engine.launch import DEFAULT_PAGE_SIZE, EngineLaunch
from miles_hpc.sync.factory import strategy_class

SHARED_KV_FRACTION = 0.25  # an engine's default KV share of free GPU memory when a trainer rank uses its GPU too
ALONE_KV_FRACTION = 0.85


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """Which GPU each trainer rank and each engine of `miles-hpc run` uses (empty: that side is on the CPU)."""

    trainer: tuple[int, ...]
    engines: tuple[int, ...]

    def shares_trainer_gpu(self, engine: int) -> bool:
        return bool(self.engines) and self.engines[engine] in self.trainer


def gpu_plan(cfg: RunConfig, num_gpus: int) -> GpuPlan:
    """Trainer rank r on GPU r; engines on the GPUs after the trainer's, wrapping around when there are fewer (one
    GPU: every engine shares GPU 0 with the trainer). Raises ConfigError for what cannot run on `num_gpus` GPUs,
    or what the weight sync cannot reach (checked before any process starts)."""
    t, r = cfg.train, cfg.rollout
    if t.device == "cuda" and t.world_size > num_gpus:
        raise ConfigError(
            f"train.device: cuda puts each of train.world_size={t.world_size} ranks on its own GPU; "
            f"this machine has {num_gpus}"
        )
    if r.device == "cuda" and num_gpus == 0:
        raise ConfigError("rollout.device: cuda, but this machine has no GPU torch can use")
    trainer = tuple(range(t.world_size)) if t.device == "cuda" else ()
    first, tp = len(trainer), r.engine_tp
    if r.device == "cuda" and tp > num_gpus:
        raise ConfigError(f"rollout.engine_tp: {tp} GPUs per engine, this machine has {num_gpus}")
    # Engine i's first GPU (its TP ranks take the next engine_tp - 1): whole blocks of engine_tp GPUs after the
    # trainer's, then from GPU 0 again (sharing the trainer's), in turn.
    starts = [*range(first, num_gpus - tp + 1, tp), *range(0, num_gpus - tp + 1, tp)]
    on_gpus = r.device == "cuda" and not r.engine_urls  # attached engines run elsewhere
    engines = tuple(starts[i % len(starts)] for i in range(r.num_engines)) if on_gpus else ()
    plan = GpuPlan(trainer, engines)
    strategy_class(cfg).check_placement(cfg, plan.trainer, plan.engines)
    return plan


def engine_launch(
    cfg: RunConfig, model_dir: Path, keys: Path, rendezvous: Path, index: int, **placement: Any
) -> EngineLaunch:
    """Engine ``index`` of a run (`miles-hpc run` and `miles-hpc worker --role rollout`): keys as files, a free
    port, its rendezvous record, its own seed; ``placement``: host, device, KV share."""
    return EngineLaunch(
        model_dir=str(model_dir),
        port=0,
        rendezvous=str(rendezvous),
        seed=cfg.seed + index,
        api_key_file=str(keys / "api_key"),
        admin_api_key_file=str(keys / "admin_api_key"),
        dtype=cfg.model.dtype,
        weight_update_timeout=cfg.sync.timeout_s,
        batch_invariant=cfg.zero_kl,
        enable_return_indexer_topk=cfg.algo.indexer_replay,  # engines record only what a run replays
        tp_size=cfg.rollout.engine_tp,
        page_size=cfg.rollout.page_size or DEFAULT_PAGE_SIZE,
        **placement,
    )


def attached_engines(cfg: RunConfig) -> tuple[list[str], str, str]:
    """`rollout.engine_urls` (engines this run did not start) once each answers `/health` within
    `rollout.engine_timeout_s`, with the keys of `rollout.engine_api_key_file` / `engine_admin_api_key_file` ("":
    none); an engine that does not answer is named."""
    import urllib.request

    r = cfg.rollout
    keys = [Path(f).read_text().strip() if f else "" for f in (r.engine_api_key_file, r.engine_admin_api_key_file)]
    deadline = time.monotonic() + r.engine_timeout_s
    for url in r.engine_urls:
        while True:
            req = urllib.request.Request(url.rstrip("/") + "/health")
            try:
                with urllib.request.urlopen(req, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"rollout.engine_urls: {url} did not answer /health within {r.engine_timeout_s:.0f} s ({e})"
                    ) from None
            time.sleep(1.0)
    return [u.rstrip("/") for u in r.engine_urls], keys[0], keys[1]


def local_processes(cfg: RunConfig) -> int:
    """How many processes of the run compute on this machine: this one (trainer rank 0), the other trainer ranks,
    every rank of every engine it starts, and a local OPD teacher engine."""
    r, teacher = cfg.rollout, cfg.algo.opd_teacher
    engines = 0 if r.engine_urls else r.num_engines * r.engine_tp
    return cfg.train.world_size + engines + int(teacher is not None and not teacher.startswith(("http://", "https://")))


def threads_per_process(cfg: RunConfig, cpus: int) -> int:
    """Intra-op CPU threads for each local process: the machine's CPUs shared out, at least 1 (torchrun's rule for
    several ranks on one host: without it every process takes all CPUs, and on 2 cores a demo's 4 processes ran 8
    threads that spent a third of the time in the kernel)."""
    return max(1, cpus // local_processes(cfg))


_LOWEST_PICKED = 10000  # below: ports services are configured on


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (outgoing connections, bind to port 0)."""
    try:
        low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port free on this host now, for a listener started a moment later (a process group's store).
    Picked at random below the kernel's ephemeral range, so no outgoing connection of any process takes it in the
    meantime, as one could take a port the kernel chose (seen with two test runs side by side: "Address already in
    use"); the kernel's own pick where that leaves fewer than 1,000 ports."""
    low, _ = _ephemeral_range()
    if low - _LOWEST_PICKED >= 1000:
        for _ in range(64):
            port = _LOWEST_PICKED + secrets.randbelow(low - _LOWEST_PICKED)  # not `random`: tests seed it
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_key(path: Path) -> str:
    """A fresh random key in a 0600 file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


class LocalCluster:
    """Engine servers and extra trainer ranks of one run, as subprocesses of this one."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, model_dir: Path, config_path: Path, gpus: GpuPlan | None = None
    ) -> None:
        self.cfg = cfg
        self.gpus = gpus or GpuPlan((), ())
        self.run_dir = run_dir
        self.model_dir = model_dir
        self.config_path = config_path
        self.rendezvous = run_dir / "rendezvous"
        self.logs = run_dir / "logs"
        self.child_env: dict[str, str] = {}
        self.threads: int | None = None  # CPU threads of each process; None: the user set OMP_NUM_THREADS
        if "OMP_NUM_THREADS" not in os.environ:  # the user's setting wins, here and in every child
            self.threads = threads_per_process(cfg, len(os.sched_getaffinity(0)))
            self.child_env["OMP_NUM_THREADS"] = str(self.threads)
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.engines: dict[int, subprocess.Popen[bytes]] = {}  # the current process of each engine
        self._engine_argv: dict[int, list[str]] = {}
        self.api_key = ""
        self.admin_key = ""

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{name}.log", "ab")
        env = {**os.environ, **self.child_env, **(env or {}), PARENT_PID_ENV: str(os.getpid())}
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()  # the child holds its own descriptor
        self.procs.append((name, proc))
        return proc

    def start_engines(self, timeout_s: float = 300.0) -> list[str]:
        """Start `rollout.num_engines` servers; return their URLs once every one is listening. With
        `rollout.engine_urls` none is started: those engines (and their keys) are the run's once they answer."""
        self.rendezvous.mkdir(parents=True, exist_ok=True)
        if self.cfg.rollout.engine_urls:
            urls, self.api_key, self.admin_key = attached_engines(self.cfg)
            return urls
        keys = self.run_dir / "keys"
        self.api_key = write_key(keys / "api_key")
        self.admin_key = write_key(keys / "admin_api_key")
        n = self.cfg.rollout.num_engines
        for i in range(n):
            (self.rendezvous / f"engine-{i}.json").unlink(missing_ok=True)
            placement: dict[str, Any] = {}
            if self.gpus.engines:
                share = self.cfg.rollout.kv_cache_fraction or (
                    SHARED_KV_FRACTION if self.gpus.shares_trainer_gpu(i) else ALONE_KV_FRACTION
                )
                placement = {"device": f"cuda:{self.gpus.engines[i]}", "kv_cache_fraction": share}
            argv = engine_launch(
                self.cfg, self.model_dir, keys, self.rendezvous / f"engine-{i}.json", i, **placement
            ).argv()
            self._engine_argv[i] = argv
            self.engines[i] = self._spawn(f"engine-{i}", argv)
        return self._wait_engines(n, timeout_s)

    def engine_exit(self, i: int) -> int | None:
        """Engine ``i``'s exit code, or None while it runs."""
        return self.engines[i].poll()

    def restart_engine(self, i: int) -> None:
        """Start engine ``i`` again with its flags (a new port: its rendezvous record names the new URL once it
        listens). The old process must have exited."""
        if self.engines[i].poll() is None:
            raise RuntimeError(f"engine {i} is still running (pid {self.engines[i].pid})")
        (self.rendezvous / f"engine-{i}.json").unlink(missing_ok=True)
        self.procs = [(n, p) for n, p in self.procs if p is not self.engines[i]]
        self.engines[i] = self._spawn(f"engine-{i}", self._engine_argv[i])

    def engine_log(self, i: int) -> Path:
        return self.logs / f"engine-{i}.log"

    def trainer_exits(self) -> list[tuple[str, int]]:
        """Trainer ranks > 0 that have exited: (name, exit code)."""
        return [(n, p.returncode) for n, p in self.procs if n.startswith("trainer-") and p.poll() is not None]

    def start_teacher(self, model_dir: Path, timeout_s: float = 300.0) -> str:
        """The on-policy-distillation teacher: one more engine serving `model_dir` (never sent weight updates);
        returns its URL once it listens. Call after `start_engines` (it shares their keys)."""
        rdv = self.rendezvous / "teacher.json"
        rdv.unlink(missing_ok=True)
        keys = self.run_dir / "keys"
        # never sent weight updates; full precision of its own checkpoint, no zero-KL kernels
        argv = EngineLaunch(
            model_dir=str(model_dir),
            port=0,
            rendezvous=str(rdv),
            seed=self.cfg.seed,
            api_key_file=str(keys / "api_key"),
            admin_api_key_file=str(keys / "admin_api_key"),
        ).argv()
        proc = self._spawn("teacher", argv)
        deadline = time.monotonic() + timeout_s
        while not rdv.is_file():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the OPD teacher engine ({model_dir}) exited with code {proc.returncode}; see "
                    f"{self.logs / 'teacher.log'}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OPD teacher engine ({model_dir}) did not listen within {timeout_s:.0f} s")
            time.sleep(0.1)
        return str(json.loads(rdv.read_text())["url"])

    def _wait_engines(self, n: int, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        urls: dict[int, str] = {}
        while len(urls) < n:
            for i in range(n):
                f = self.rendezvous / f"engine-{i}.json"
                if i not in urls and f.is_file():
                    urls[i] = json.loads(f.read_text())["url"]
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {proc.returncode} before it was ready; "
                        f"see {self.logs / (name + '.log')}"
                    )
            if len(urls) < n and time.monotonic() > deadline:
                missing = ", ".join(f"engine {i} (localhost)" for i in range(n) if i not in urls)
                raise TimeoutError(f"engines not ready after {timeout_s:.0f} s: {missing}; see {self.logs}")
            time.sleep(0.1)
        return [urls[i] for i in range(n)]

    def start_trainer_ranks(self, master_port: int) -> None:
        """Trainer ranks 1..W-1 (rank 0 is this process): `miles-hpc worker --role train RUN/config.yaml`."""
        world = self.cfg.train.world_size
        for rank in range(1, world):
            env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
            }
            argv = [sys.executable, "-m", "miles_hpc.cli", "worker", "--role", "train", str(self.config_path)]
            self._spawn(f"trainer-{rank}", argv, env)

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; see {self.logs / (name + '.log')}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process we started, then SIGKILL what is left after `grace_s`; a KeyboardInterrupt during
        the grace period (a second Ctrl-C) kills what is left at once, then propagates."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            for _, proc in self.procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        except KeyboardInterrupt:
            for _, proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
            for _, proc in self.procs:
                proc.wait()
            raise
        finally:
            self.procs.clear()
