"""Preflight: every check of a run that can be made before GPUs are allocated (stage: launch; `miles-hpc prepare`,
which `miles-hpc submit` runs before `sbatch` and the batch script before any `srun`; docs/hpc.md, "Preflight").

Invariants.
- `preflight` runs every check and returns every problem found, each naming the config key, what is wrong and the
  fix; `prepare` prints them all and exits 2 before anything is created. A clean config returns [].
- Nothing is skipped for being offline: no check needs the network (the SGLang interpreter is run, not fetched).
- A check that cannot be made here says so in `notes` (e.g. a checkpoint on a file system this node does not see
  is a problem, not a note: every node of the job must see it).
- Pure functions of the config and the files it names, but `probe_sglang` (runs the configured interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_hpc.config import RunConfig
from miles_hpc.config.loader import ConfigError
from miles_hpc.rollout.sglang import SGLANG_ARCHS

__all__ = [
    "SGLANG_ARCHS",
    "SGLANG_MIN",
    "Preflight",
    "Problem",
    "SGLangProbe",
    "preflight",
    "probe_sglang",
    "report",
]

# The version our request schemas and launch line are checked against (scripts/test_sglang.sh, its schema tier);
# 0.6 may change both.
SGLANG_MIN = (0, 5, 23)
SGLANG_BELOW = (0, 6)
# File systems a job's nodes share (a run directory elsewhere is seen by one node only).
SHARED_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "wekafs", "pvfs2", "orangefs"})


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing that would fail after the queue: the key, what is wrong, how to fix it."""

    key: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key}: {self.what}; fix: {self.fix}"


@dataclass(slots=True)
class Preflight:
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was checked, or why something could not be

    def add(self, key: str, what: str, fix: str) -> None:
        self.problems.append(Problem(key, what, fix))


@dataclass(frozen=True, slots=True)
class SGLangProbe:
    """What the configured SGLang interpreter said: its sglang version, or why it could not say."""

    version: str | None
    error: str | None = None


def probe_sglang(python: str, timeout_s: float = 120.0) -> SGLangProbe:
    """Run `python -c "import sglang"` and read its version (the interpreter of SGLang's own venv)."""
    code = "import sglang, sys; sys.stdout.write(sglang.__version__)"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return SGLangProbe(None, f"{python} does not exist")
    except PermissionError:
        return SGLangProbe(None, f"{python} is not executable")
    except subprocess.TimeoutExpired:
        return SGLangProbe(None, f"{python} -c 'import sglang' did not finish within {timeout_s:.0f} s")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return SGLangProbe(None, f"{python} cannot import sglang ({last})")
    return SGLangProbe(proc.stdout.strip())


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _model_config(cfg: RunConfig, pf: Preflight) -> dict[str, Any] | None:
    """The run's model config.json (a preset's without model.path; a multimodal checkpoint's text model's); None
    after adding the problem."""
    if cfg.model.path is None:
        from miles_hpc.models.presets import preset_config

        return dict(preset_config(cfg.model.init_arch, cfg.model.init_size))
    path = Path(cfg.model.path) / "config.json"
    fix = "point model.path at an HF checkpoint directory that every node of the job sees"
    if not path.is_file():
        pf.add("model.path", f"{path} does not exist (seen from {os.uname().nodename})", fix)
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        pf.add("model.path", f"{path} is not readable JSON ({e})", fix)
        return None
    from miles_hpc.models import ModelConfig

    try:
        ModelConfig.from_hf_dict(raw)
    except (ValueError, KeyError, TypeError, NotImplementedError) as e:
        pf.add(
            "model.path",
            f"{path}: model_type {raw.get('model_type')!r} is not a family this project builds ({e})",
            "use a supported family (docs/models.md)",
        )
        return None
    from miles_hpc.models.families import text_model

    text = dict(text_model(raw))  # a multimodal checkpoint: its text model, which the run trains
    if raw.get("model_type") != text.get("model_type"):
        text["architectures"] = raw.get("architectures")  # SGLang serves (or not) the checkpoint's own class
    return text


def _check_train_component(cfg: RunConfig, pf: Preflight) -> None:
    t, s = cfg.train, cfg.slurm
    if t.device == "cuda" and s.gpus_per_node:
        if t.world_size % s.train_nodes:
            pf.add(
                "train.world_size",
                f"{t.world_size} trainer ranks do not spread evenly over slurm.train_nodes={s.train_nodes}",
                "make train.world_size a multiple of slurm.train_nodes (one rank per GPU)",
            )
        elif t.world_size // s.train_nodes != s.gpus_per_node:
            per = t.world_size // s.train_nodes
            pf.add(
                "train.world_size",
                f"{per} trainer ranks per node on nodes of slurm.gpus_per_node={s.gpus_per_node} GPUs (one rank per "
                f"GPU: {'more ranks than GPUs' if per > s.gpus_per_node else 'GPUs left idle'})",
                f"set train.world_size={s.train_nodes * s.gpus_per_node} or slurm.train_nodes / gpus_per_node",
            )


def _check_trainer(cfg: RunConfig, model: Mapping[str, Any], pf: Preflight) -> None:
    """The family in the configured megatron layout: it builds, the ranks divide, it fits (planner); the FSDP
    trainer's states and largest micro-batch fit (planner)."""
    t = cfg.train
    if t.backend == "fsdp":
        from miles_hpc.launch.layout_check import check_fsdp_fit

        try:
            pf.notes.append(check_fsdp_fit(cfg))
        except ConfigError as e:
            pf.add("train.world_size", str(e), "more trainer GPUs, activation checkpointing, or shorter sequences")
        return
    if t.backend != "megatron":
        return
    from miles_hpc.models.families import HYBRID_TYPES

    if model.get("model_type") in HYBRID_TYPES:  # no megatron mapping: _check_hybrid_family names train.backend
        return
    from miles_hpc.launch.layout_check import configured
    from miles_hpc.planner.accounting import ModelSpecError
    from miles_hpc.planner.layouts import layout_problems

    layout, _, _ = configured(cfg)
    m = cfg.megatron
    split = m.tensor_parallel * m.pipeline_parallel * m.context_parallel
    if t.world_size % split:
        pf.add(
            "megatron.tensor_parallel",
            f"TP {m.tensor_parallel} x PP {m.pipeline_parallel} x CP {m.context_parallel} = {split} does not divide "
            f"train.world_size={t.world_size}",
            "choose a layout whose TP x PP x CP divides the trainer ranks (`miles-hpc plan MODEL --layouts`)",
        )
        return
    try:
        problems = layout_problems(model, layout)
    except (ModelSpecError, NotImplementedError) as e:  # NotImplementedError: a family megatron does not map
        pf.add("model", f"the megatron backend cannot size this model: {e}", "use train.backend=fsdp")
        return
    for p in problems:
        pf.add(
            "megatron",
            f"the megatron backend cannot build this model in {layout}: {p}",
            "change the megatron layout (`miles-hpc plan MODEL --layouts` lists those that build and fit) or use "
            "train.backend=fsdp",
        )
    from miles_hpc.launch.layout_check import check_train_layout

    try:
        pf.notes.append(check_train_layout(cfg))
    except ConfigError as e:
        pf.add("megatron", str(e), "take the planner's layout named above, or more GPUs")


def _check_rollout_component(
    cfg: RunConfig, pf: Preflight, probe: Callable[[str], SGLangProbe], components: bool = True
) -> None:
    """Engines x TP x nodes against the rollout nodes' GPUs; SGLang's interpreter and version."""
    r, s = cfg.rollout, cfg.slurm
    if r.engine_urls:
        pf.notes.append(f"rollout: {len(r.engine_urls)} engines already running (not checked before the job)")
        return
    tasks = r.num_engines * r.engine_nodes
    if components and (s.gpus_per_node and r.device == "cuda" or r.backend == "sglang"):
        gpus_per_task = r.engine_tp // r.engine_nodes
        if tasks % s.rollout_nodes:
            pf.add(
                "rollout.num_engines",
                f"{r.num_engines} engines x {r.engine_nodes} nodes each = {tasks} rollout tasks do not spread evenly "
                f"over slurm.rollout_nodes={s.rollout_nodes}",
                "make num_engines x engine_nodes a multiple of slurm.rollout_nodes",
            )
        elif s.gpus_per_node and tasks // s.rollout_nodes * gpus_per_task != s.gpus_per_node:
            need = tasks // s.rollout_nodes * gpus_per_task
            pf.add(
                "rollout.engine_tp",
                f"{tasks // s.rollout_nodes} engine tasks per node x {gpus_per_task} GPUs each (engine_tp "
                f"{r.engine_tp} / engine_nodes {r.engine_nodes}) = {need} GPUs on nodes of slurm.gpus_per_node="
                f"{s.gpus_per_node}",
                f"set rollout.num_engines = {s.rollout_nodes * s.gpus_per_node // max(gpus_per_task, 1)} / "
                "engine_nodes, or engine_tp, or slurm.rollout_nodes, so each node's GPUs are all used once",
            )
    if r.backend != "sglang":
        return
    got = probe(r.sglang_python)
    fix = (
        "make SGLang's own venv on a file system the nodes share (docs/hpc.md, set-up) and set "
        "rollout.sglang_python to its bin/python"
    )
    if got.version is None:
        pf.add("rollout.sglang_python", got.error or "cannot import sglang", fix)
        return
    v = _version_tuple(got.version)
    if not SGLANG_MIN <= v < SGLANG_BELOW:
        pf.add(
            "rollout.sglang_python",
            f"{r.sglang_python} has sglang {got.version}; supported: >= {'.'.join(map(str, SGLANG_MIN))}, "
            f"< {'.'.join(map(str, SGLANG_BELOW))} (the release our schemas are checked against)",
            f"install sglang=={'.'.join(map(str, SGLANG_MIN))} in that venv (scripts/test_sglang.sh --install-only)",
        )
    else:
        pf.notes.append(f"rollout: {r.sglang_python} imports sglang {got.version}")


def _check_rollout_family(cfg: RunConfig, model: Mapping[str, Any], pf: Preflight) -> None:
    if cfg.rollout.backend != "sglang" or cfg.rollout.engine_urls:
        return
    from miles_hpc.models.families import WRAPPERS

    arch = (model.get("architectures") or [None])[0]
    wrapper = next((w for w in WRAPPERS.values() if arch in w.aliases), None)
    if wrapper is not None and wrapper.architecture in SGLANG_ARCHS:
        pf.add(
            "rollout.backend",
            f"{cfg.model.path}/config.json names its class {arch} (transformers' name); SGLang registers the "
            f"release's name, {wrapper.architecture}",
            f'set "architectures": ["{wrapper.architecture}"] in that config.json',
        )
    elif arch not in SGLANG_ARCHS:
        pf.add(
            "rollout.backend",
            f"SGLang ({'.'.join(map(str, SGLANG_MIN))}) does not serve {arch or model.get('model_type')}",
            "use rollout.backend=embedded for this family (docs/models.md), or add the SGLang release that serves it",
        )


def _check_hybrid_family(cfg: RunConfig, model: Mapping[str, Any], pf: Preflight) -> None:
    """A checkpoint of a hybrid family (recurrent layers), or of a family the engine recomputes (DeepSeek-V4,
    Inkling), runs where its model.init_arch preset would."""
    from miles_hpc.config import checks
    from miles_hpc.models.families import FAMILY_MODULES, HYBRID_TYPES

    model_type = model.get("model_type")
    if cfg.model.path is None or model_type not in (*HYBRID_TYPES, *FAMILY_MODULES):
        return
    check = checks.hybrid if model_type in HYBRID_TYPES else checks.module_family
    try:
        check(cfg, f"model.path={cfg.model.path} ({model_type})")
    except ConfigError as e:
        key, _, what = str(e).partition(": ")
        pf.add(key, what, "this family runs on our engines at TP 1 with the FSDP trainer (docs/models.md)")


def _check_site(cfg: RunConfig, pf: Preflight, base: Path) -> None:
    site = cfg.slurm.site
    if site is None:
        return
    path = Path(site) if Path(site).is_absolute() else base / site
    if not path.is_file():
        sites = sorted(p.name for p in (base / "slurm" / "sites").glob("*.sh")) if (base / "slurm").is_dir() else []
        pf.add(
            "slurm.site",
            f"{path} does not exist (the batch script sources it first)",
            f"name a site file ({', '.join(sites) or 'slurm/sites/*.sh'}) relative to the directory you submit from",
        )


def checkpoint_bytes(cfg: RunConfig, model: Mapping[str, Any]) -> int:
    """Bytes of one training checkpoint (every rank's): the weights and Adam's states. FSDP keeps float32
    parameters and two float32 moments (12 B per parameter); megatron with mixed precision on a GPU its bf16
    weights, the float32 master and the two moments (14 B)."""
    from miles_hpc.planner.estimate import param_counts

    total, _ = param_counts(model)
    t = cfg.train
    mixed = t.backend == "megatron" and t.mixed_precision and t.device == "cuda"
    return total * (14 if mixed else 12)


def measured_step_s(run_dir: Path, mode: str, last: int = 20) -> float | None:
    """The longest of the last steps of an earlier attempt of this run (RUN/metrics.jsonl), None without one: what
    a USR2 waits for before the checkpoint. Sync mode's step is rollout + train + sync; fully async trains while
    rollout runs."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    steps = []
    for line in path.read_text().splitlines()[-last:]:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        parts = ["time/train_s", "time/sync_s"] + (["time/rollout_s"] if mode == "sync" else [])
        steps.append(sum(float(m.get(k, 0.0)) for k in parts))
    return max(steps) if steps else None


def _check_signal(cfg: RunConfig, model: Mapping[str, Any], pf: Preflight) -> None:
    s = cfg.slurm
    if not s.requeue:
        return
    ckpt = checkpoint_bytes(cfg, model) / s.train_nodes
    ckpt_s = ckpt / (s.checkpoint_gbps * 1e9)
    step_s = measured_step_s(Path(cfg.run_dir), cfg.mode)
    need = ckpt_s + (step_s or 0.0)
    step = f"a step ({step_s:.0f} s, the longest of the run's last steps) and " if step_s is not None else ""
    pf.notes.append(f"signal: {s.signal_s} s of warning; {step}a checkpoint ~{ckpt_s:.0f} s")
    if s.signal_s < need:
        pf.add(
            "slurm.signal_s",
            f"{s.signal_s} s between USR2 and the walltime, but {step}a checkpoint ({ckpt / 1e9:,.0f} GB per "
            f"training node at slurm.checkpoint_gbps={s.checkpoint_gbps:g}: ~{ckpt_s:,.0f} s) "
            f"need{'' if step_s is not None else 's'} {need:,.0f} s: "
            "the job would be killed mid-checkpoint and its requeue would restart from the one before",
            f"set slurm.signal_s >= {int(need * 1.25) + 1} (slurm.time well above it), or measure the file "
            "system's write speed and set slurm.checkpoint_gbps",
        )


def mount_type(path: Path, mounts: str | None = None) -> str:
    """The file-system type of the mount holding `path` (the longest /proc/mounts prefix)."""
    text = mounts if mounts is not None else Path("/proc/mounts").read_text()
    best, kind = "", "unknown"
    target = str(path.resolve())
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, parts[2]
    return kind


def _check_run_dir(cfg: RunConfig, pf: Preflight, mounts: str | None) -> None:
    s = cfg.slurm
    if s.train_nodes + s.rollout_nodes < 2 or not s.shared_fs_check:
        return
    path = Path(cfg.run_dir)
    kind = mount_type(path, mounts)
    if kind in SHARED_FS or kind.startswith("fuse."):
        pf.notes.append(f"run dir: {path} is on {kind}")
        return
    pf.add(
        "run_dir",
        f"{path} is on a {kind} file system, which the job's {s.train_nodes + s.rollout_nodes} nodes do not share "
        "(trainer and engines meet there: rendezvous, keys, checkpoints)",
        "put run_dir on the cluster's shared file system (scratch, project, home), or set "
        "slurm.shared_fs_check=false if this one is shared after all",
    )


def preflight(
    cfg: RunConfig,
    *,
    base: Path | None = None,
    probe: Callable[[str], SGLangProbe] = probe_sglang,
    mounts: str | None = None,
    components: bool = True,
) -> Preflight:
    """Every check of `cfg` that needs no allocation (module docstring); `base`: where relative paths of the
    config are resolved (the directory the job starts in: the current one). `components`: the job is the batch
    script's two components (or the split allocation); False for one allocation running `miles-hpc run` (submitit),
    whose processes share one node."""
    pf = Preflight()
    if components:
        _check_train_component(cfg, pf)
    _check_rollout_component(cfg, pf, probe, components)
    model = _model_config(cfg, pf)
    if model is not None:
        _check_trainer(cfg, model, pf)
        _check_rollout_family(cfg, model, pf)
        _check_hybrid_family(cfg, model, pf)
        _check_signal(cfg, model, pf)
    _check_site(cfg, pf, base or Path.cwd())
    if components:
        _check_run_dir(cfg, pf, mounts)
    return pf


def report(pf: Preflight, out: Any) -> bool:
    """Print the notes and problems to `out` (a text stream); True when there is no problem."""
    for note in pf.notes:
        print(f"[miles-hpc] preflight: {note}", file=out)
    for problem in pf.problems:
        print(f"error: preflight: {problem}", file=out)
    if pf.problems:
        print(
            f"error: preflight: {len(pf.problems)} problem(s); nothing was submitted or started (docs/hpc.md, "
            "Preflight)",
            file=out,
        )
    return not pf.problems
