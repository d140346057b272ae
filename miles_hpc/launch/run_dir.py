"""The run directory (docs/design.md section 3, a contract): layout, resolved config, and the starting model.

``RUN/config.yaml`` holds the resolved config (file + overrides + defaults), so ``miles-hpc run RUN/config.yaml``
repeats the run. The other paths are created by the stages that own them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from miles_hpc.atomic import write_text_atomic
from miles_hpc.config import ConfigError, RunConfig, dump_config
from miles_hpc.config.run import DSA_ARCHS


@dataclass(frozen=True, slots=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def init_model(self) -> Path:
        """Where a random-init starting model is written when ``model.path`` is not set."""
        return self.root / "model"


log = logging.getLogger(__name__)
_HELD: dict[str, int] = {}  # run dir -> the descriptor whose POSIX lock this process holds for its lifetime


class RunDirInUseError(FileExistsError):
    """Another live process holds the run directory (module `lock_run_dir`)."""


def lock_run_dir(root: Path, *, hold: bool = True) -> None:
    """Claim ``root`` for this process: a POSIX lock on ``RUN/.lock`` (``lockf``: owned by the process, released
    by the kernel when it exits however it exits, not inherited by its children; NFS and GPFS carry it across nodes,
    Lustre where mounted with ``flock``). Two runs of one directory (a requeued job beside the attempt it replaces,
    a command run twice) would overwrite each other's rendezvous, shards and checkpoints: the second is refused
    with the holder's host and pid. ``hold=False`` only checks (claims and releases at once). A file system
    without locks is warned about and not refused. Idempotent within a process."""
    key = str(root.resolve())
    if key in _HELD:
        return
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise RunDirInUseError(
                f"run_dir {root} is in use by another run ({owner}): wait for it to end, or give another run_dir"
            ) from None
        log.warning("run_dir %s: cannot lock %s (%s): two runs of it would not be told apart", root, root / ".lock", e)
        return
    if not hold:
        os.close(fd)  # closing releases the lock
        return
    os.ftruncate(fd, 0)
    os.pwrite(
        fd, f"host {socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0
    )
    _HELD[key] = fd


def unlock_run_dir(root: Path) -> None:
    """Give up this process's claim on ``root`` (if it holds one)."""
    fd = _HELD.pop(str(root.resolve()), None)
    if fd is not None:
        os.close(fd)  # closing releases the lock


@contextlib.contextmanager
def claimed_run_dir(root: Path) -> Iterator[None]:
    """`lock_run_dir` for the block; released after it unless this process held it already."""
    ours = str(root.resolve()) not in _HELD
    lock_run_dir(root)
    try:
        yield
    finally:
        if ours:
            unlock_run_dir(root)


def prepare_run_dir(cfg: RunConfig) -> RunPaths:
    """Create RUN/ and write the resolved config."""
    paths = RunPaths(Path(cfg.run_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(paths.config, dump_config(cfg))
    return paths


def resolve_model(cfg: RunConfig, paths: RunPaths) -> Path:
    """The starting checkpoint: ``model.path``, or a random-init one created once under RUN/model. A ``model.path``
    whose model the config's features cannot serve is refused here, where its config is first read (ConfigError
    naming the key)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} has no config.json (expected an HF-format checkpoint)")
        if cfg.algo.indexer_replay:
            _check_indexer_model(path)
        return path
    target = paths.init_model
    if not (target / "config.json").is_file():
        import shutil

        from miles_hpc.models.presets import init_model

        # Build beside the target and rename, so an interrupted init never looks like a finished checkpoint.
        tmp = Path(tempfile.mkdtemp(dir=paths.root, prefix=".model-"))
        try:
            init_model(cfg.model.init_arch, cfg.model.init_size, tmp, seed=cfg.seed)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_indexer_model(path: Path) -> None:
    """algo.indexer_replay needs a DeepSeek sparse attention checkpoint (what `RunConfig` checks for init_arch)."""
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.path: cannot read {path / 'config.json'}: {e}") from None
    if model_type not in DSA_ARCHS:
        raise ConfigError(
            f"algo.indexer_replay: needs a DeepSeek sparse attention model ({', '.join(DSA_ARCHS)}); model.path "
            f"{path} is {model_type}, which has no indexer"
        )
