"""Preflight (launch/preflight.py): each wrong config is refused with its key and a fix, all problems at once; the
flagship's own mistakes (engine TP against the rollout nodes, the SGLang interpreter, the layout) among them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles_hpc.config import load_config
from miles_hpc.launch.preflight import SGLangProbe, mount_type, preflight
from miles_hpc.models.presets import init_model

REPO = Path(__file__).resolve().parents[1]
GOOD_SGLANG = SGLangProbe("0.5.23")
SHARED = "lustre0 / lustre rw 0 0\n"


def check(overrides: list[str], probe: SGLangProbe = GOOD_SGLANG, config: str = "configs/tiny_cpu.yaml", **kw):  # type: ignore[no-untyped-def]
    cfg = load_config(REPO / config, overrides)
    return preflight(cfg, base=REPO, probe=lambda python: probe, mounts=kw.get("mounts", SHARED))


def keys(overrides: list[str], **kw: object) -> list[str]:
    return [p.key for p in check(overrides, **kw).problems]  # type: ignore[arg-type]


def test_the_shipped_cpu_configs_pass() -> None:
    for name in ("configs/tiny_cpu.yaml", "configs/tiny_agent_cpu.yaml"):
        pf = check([], config=name)
        assert pf.problems == [], [str(p) for p in pf.problems]


def test_trainer_ranks_must_fill_the_training_nodes() -> None:
    base = ["train.device=cuda", "slurm.gpus_per_node=8", "slurm.train_nodes=2"]
    assert keys([*base, "train.world_size=16"]) == []
    (p,) = check([*base, "train.world_size=12"]).problems
    assert p.key == "train.world_size" and "GPUs left idle" in p.what and "train.world_size=16" in p.fix
    assert keys([*base, "train.world_size=15"]) == ["train.world_size"]  # uneven over 2 nodes
    assert keys([*base, "train.world_size=24"]) == ["train.world_size"]  # more ranks than GPUs


def test_engine_tp_must_fill_the_rollout_nodes() -> None:
    base = ["rollout.device=cuda", "slurm.gpus_per_node=8", "slurm.rollout_nodes=4"]
    assert keys([*base, "rollout.num_engines=4", "rollout.engine_tp=8"]) == []
    # The flagship's first mistake: 32 GPUs of engines at TP 1 would need 32 engines, not 4.
    (p,) = check([*base, "rollout.num_engines=4", "rollout.engine_tp=1"]).problems
    assert p.key == "rollout.engine_tp" and "= 1 GPUs on nodes of slurm.gpus_per_node=8" in p.what
    assert keys([*base, "rollout.num_engines=3", "rollout.engine_tp=8"]) == ["rollout.num_engines"]
    # SGLang engines over two nodes each: 2 tasks of 8 GPUs per engine.
    multi = [*base, "rollout.backend=sglang", "rollout.engine_tp=16", "rollout.engine_nodes=2"]
    assert keys([*multi, "rollout.num_engines=2"]) == []
    assert keys([*multi, "rollout.num_engines=1"]) == ["rollout.num_engines"]  # 2 tasks on 4 nodes


def test_sglang_interpreter_and_family() -> None:
    base = ["rollout.backend=sglang", "rollout.sglang_python=/opt/sglang/bin/python"]
    assert keys(base) == []
    missing = check(base, probe=SGLangProbe(None, "/opt/sglang/bin/python does not exist")).problems
    assert [p.key for p in missing] == ["rollout.sglang_python"] and "does not exist" in missing[0].what
    old = check(base, probe=SGLangProbe("0.4.9")).problems
    assert [p.key for p in old] == ["rollout.sglang_python"] and "0.4.9" in old[0].what
    assert keys(base, probe=SGLangProbe("0.6.0")) == ["rollout.sglang_python"]
    assert keys(base, probe=SGLangProbe("0.5.24.post1")) == []


@pytest.mark.process
def test_a_real_interpreter_without_sglang_is_named() -> None:
    from miles_hpc.launch.preflight import probe_sglang

    got = probe_sglang(sys.executable)  # this venv has no sglang (it lives in its own)
    assert got.version is None and "cannot import sglang" in (got.error or "")
    assert "does not exist" in (probe_sglang("/no/such/python").error or "")


def test_checkpoint_must_exist_and_be_a_known_family(tmp_path: Path) -> None:
    (p,) = check([f"model.path={tmp_path / 'nowhere'}"]).problems
    assert p.key == "model.path" and "does not exist" in p.what
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no_such_family", "architectures": ["X"]}))
    (p,) = check([f"model.path={bad}"]).problems
    assert p.key == "model.path" and "no_such_family" in p.what


def test_megatron_layout_that_cannot_build_or_divide(tmp_path: Path) -> None:
    moe = init_model("qwen3_moe", "tiny", tmp_path / "moe")
    base = [f"model.path={moe}", "train.backend=megatron", "megatron.distributed_optimizer=false"]
    assert keys([*base, "train.world_size=2", "megatron.tensor_parallel=2"]) == []
    divide = check([*base, "train.world_size=2", "megatron.pipeline_parallel=3"]).problems
    assert [p.key for p in divide] == ["megatron.tensor_parallel"] and "does not divide" in divide[0].what
    experts = json.loads((moe / "config.json").read_text())["num_experts"]
    build = check([*base, "train.world_size=2", f"megatron.expert_parallel={experts + 1}"]).problems
    assert build and all(p.key == "megatron" for p in build) and "routed experts" in build[0].what


def test_site_file_must_exist() -> None:
    site = sorted((REPO / "slurm" / "sites").glob("*.sh"))[0].relative_to(REPO)
    assert keys([f"slurm.site={site}"]) == []
    (p,) = check(["slurm.site=slurm/sites/no_such_site.sh"]).problems
    assert p.key == "slurm.site" and "does not exist" in p.what and site.name in p.fix


def test_run_dir_must_be_shared_by_a_multi_node_job() -> None:
    local = "/dev/vda1 / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n"
    (p,) = check(["run_dir=/tmp/run"], mounts=local).problems
    assert p.key == "run_dir" and "tmpfs" in p.what
    assert keys(["run_dir=/tmp/run", "slurm.shared_fs_check=false"], mounts=local) == []
    assert keys(["run_dir=/scratch/run"], mounts=local + "beegfs /scratch beegfs rw 0 0\n") == []


def test_mount_type_takes_the_longest_prefix() -> None:
    mounts = "/dev/vda1 / ext4 rw 0 0\nfs0 /lus lustre rw 0 0\nfs1 /lus/home nfs4 rw 0 0\n"
    assert mount_type(Path("/lus/scratch/run"), mounts) == "lustre"
    assert mount_type(Path("/lus/home/me/run"), mounts) == "nfs4"
    assert mount_type(Path("/lushome"), mounts) == "ext4"


def test_all_problems_at_once() -> None:
    pf = check(
        [
            "rollout.backend=sglang",
            "rollout.device=cuda",
            "slurm.gpus_per_node=8",
            "slurm.rollout_nodes=4",
            "rollout.num_engines=4",
            "slurm.site=slurm/sites/nope.sh",
        ],
        probe=SGLangProbe(None, "python cannot import sglang (ModuleNotFoundError)"),
    )
    assert sorted(p.key for p in pf.problems) == ["rollout.engine_tp", "rollout.sglang_python", "slurm.site"]
    assert all(str(p).startswith(p.key + ": ") and "; fix: " in str(p) for p in pf.problems)


def test_the_signal_lead_covers_a_step_and_a_checkpoint(tmp_path: Path) -> None:
    """GLM-5.2's checkpoint (its config from the planner) cannot be written in the default 180 s; an earlier
    attempt's step times count too."""
    from miles_hpc.planner.estimate import load_model_config

    spec, _ = load_model_config("glm52")
    (tmp_path / "glm52").mkdir()
    (tmp_path / "glm52" / "config.json").write_text(json.dumps(spec))
    base = [f"model.path={tmp_path / 'glm52'}", "slurm.train_nodes=4", f"run_dir={tmp_path / 'run'}"]
    (p,) = check(base).problems
    assert p.key == "slurm.signal_s" and "GB per training node" in p.what and "slurm.signal_s >= " in p.fix
    need = int(p.fix.split("slurm.signal_s >= ")[1].split()[0])
    assert keys([*base, f"slurm.signal_s={need}"]) == []
    assert keys([*base, "slurm.requeue=false"]) == []  # no requeue: nothing to save before the walltime
    (tmp_path / "run").mkdir()
    step = {"time/rollout_s": 400.0, "time/train_s": 500.0, "time/sync_s": 100.0}
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps(step) + "\n")
    (p,) = check([*base, f"slurm.signal_s={need}"]).problems  # a 1,000 s step on top of the checkpoint
    assert p.key == "slurm.signal_s" and "a step (1000 s" in p.what


def test_a_launcher_that_sizes_its_own_processes_skips_the_components() -> None:
    """`prepare` without --batch (mpirun.sh, torchrun.sh, by hand): the slurm: components are not the job, so their
    GPUs and the shared run dir are not checked; the rest is."""
    local = "/dev/vda1 / ext4 rw 0 0\n"
    over = ["run_dir=/tmp/run", "train.device=cuda", "slurm.gpus_per_node=8", "slurm.site=slurm/sites/nope.sh"]
    cfg = load_config(REPO / "configs/tiny_cpu.yaml", over)
    batch = preflight(cfg, base=REPO, probe=lambda p: GOOD_SGLANG, mounts=local)
    alone = preflight(cfg, base=REPO, probe=lambda p: GOOD_SGLANG, mounts=local, components=False)
    assert sorted(p.key for p in batch.problems) == ["run_dir", "slurm.site", "train.world_size"]
    assert [p.key for p in alone.problems] == ["slurm.site"]


def _qwen35_student(tmp_path: Path) -> Path:
    """A directory holding Qwen3.5-35B-A3B's config.json (configs/models/qwen35_35b_a3b.json): what preflight reads."""
    model = tmp_path / "qwen35"
    model.mkdir()
    (model / "config.json").write_text((REPO / "configs/models/qwen35_35b_a3b.json").read_text())
    return model


def test_the_qwen35_opd_config_passes_and_its_trainer_is_sized(tmp_path: Path) -> None:
    """configs/experiments/qwen35_opd.yaml (issue 29): with the student's config.json readable it passes, and the
    planner's note says what the FSDP trainer needs; without activation checkpointing its 20K-token micro-batch does
    not fit a 141 GB GPU, and preflight says so by key."""
    opd = "configs/experiments/qwen35_opd.yaml"
    base = [f"model.path={_qwen35_student(tmp_path)}"]
    pf = check(base, config=opd)
    assert pf.problems == [], [str(p) for p in pf.problems]
    (note,) = [n for n in pf.notes if n.startswith("train memory (FSDP)")]
    assert "20,480-token micro-batch" in note and "of 141" in note
    (p,) = check([*base, "train.activation_checkpointing=false"], config=opd).problems
    assert p.key == "train.world_size" and "does not fit slurm.gpu_memory_gb=141" in p.what
    assert "train.activation_checkpointing=true" in p.what


def test_a_hybrid_checkpoint_goes_where_hybrids_run(tmp_path: Path) -> None:
    base = [f"model.path={_qwen35_student(tmp_path)}", "slurm.signal_s=7200"]  # a 35B model's checkpoint: minutes
    assert keys(base) == []
    assert keys([*base, "train.backend=megatron", "megatron.distributed_optimizer=false"]) == ["train.backend"]
    assert "rollout.backend" in keys([*base, "rollout.backend=sglang", "rollout.sglang_python=/opt/sglang/bin/python"])


def test_the_published_multimodal_checkpoint_is_planned_as_its_text_model(tmp_path: Path) -> None:
    """Qwen3.5-35B-A3B as published (`qwen3_5_moe`: the text model's config under `text_config`, a vision tower):
    preflight sizes the text model the run trains, as for the text-only config."""
    text = json.loads((REPO / "configs/models/qwen35_35b_a3b.json").read_text())
    model = tmp_path / "published"
    model.mkdir()
    wrapper = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe"}
    (model / "config.json").write_text(json.dumps({**wrapper, "text_config": text, "vision_config": {"depth": 27}}))
    pf = check([f"model.path={model}"], config="configs/experiments/qwen35_opd.yaml")
    assert pf.problems == [], [str(p) for p in pf.problems]
    notes = [n for n in pf.notes if n.startswith("train memory (FSDP)")]
    assert notes == [
        n
        for n in check([f"model.path={_qwen35_student(tmp_path)}"], config="configs/experiments/qwen35_opd.yaml").notes
        if n.startswith("train memory (FSDP)")
    ]  # noqa: E501
