"""megatron checkpoints (`MegatronTrainer.save`/`load`: megatron's dist_checkpointing) on the CPU over gloo: a
checkpoint written at one layout resumes at another (data-parallel 2 -> 1, tensor-parallel 1 -> 2, expert-parallel
2 -> 1) with the same weights, Adam moments and step, our step (the LR schedule's position), RNG and loop state,
and the next train step equals that of the run that never stopped; a checkpoint of another model config is refused.

The runs are subprocesses (tests/mcore_ckpt_worker.py): megatron's parallel state is process-global.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_hpc.models import ModelConfig, build_model, read_config, save_pretrained
from miles_hpc.models.presets import preset_config

sys.path.insert(0, str(Path(__file__).parent))
from conftest import has_megatron, require  # noqa: E402
from test_megatron import _free_port, tiny_moe_model, untrained  # noqa: E402,F401
from test_train_fsdp import tiny_model  # noqa: E402,F401

pytestmark = pytest.mark.process

WORKER = Path(__file__).parent / "mcore_ckpt_worker.py"
METRICS = ("loss", "pg_loss", "entropy", "tokens", "loss_tokens", "lr", "clip_frac", "grad_norm")


def _run(
    mode: str,
    model_dir: Path,
    ckpt: Path,
    out: Path,
    *,
    world: int,
    tp: int = 1,
    ep: int = 1,
    device: str = "cpu",
    distributed_optimizer: bool = False,
    recompute: str = "",
    cp: int = 1,
    pp: int = 1,
    vpp: int = 1,
    offload: float = 0.0,
    mixed: bool = False,
) -> dict:
    require(has_megatron(), "megatron-core (the megatron extra)")
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "MCORE_RECOMPUTE": recompute,
        "MCORE_CP": str(cp),
        "MCORE_PP": str(pp),
        "MCORE_VPP": str(vpp),
        "MCORE_OFFLOAD": str(offload),
        "MCORE_MIXED": str(int(mixed)),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    argv = [
        sys.executable,
        str(WORKER),
        mode,
        str(model_dir),
        str(tp),
        str(ep),
        str(ckpt),
        str(out),
        device,
        str(int(distributed_optimizer)),
    ]
    procs = [
        subprocess.Popen(
            argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for r in range(world)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log.decode()[-4000:]
    return torch.load(out, weights_only=False)


def test_the_checkpoint_writers_spawned_helper_imports_no_megatron() -> None:
    """megatron's checkpoint writer starts a spawned Manager, which re-imports the worker as `__mp_main__`: that
    must not import megatron (on a GPU machine that writes no bytecode, ~20 s of the GPU resume test per import)."""
    code = (
        f"import runpy, sys; runpy.run_path({str(WORKER)!r}, run_name='__mp_main__'); "
        "assert not [m for m in sys.modules if m.startswith(('megatron', 'miles_hpc.train'))], 'imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def dense_ckpt(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Written by 2 data-parallel ranks (TP 1) after one train step; the run then took the next step."""
    tmp = tmp_path_factory.mktemp("dense_ckpt")
    return tmp / "step_1", _run("save", tiny_model, tmp / "step_1", tmp / "saved.pt", world=2)


def _assert_resumed(saved: dict, got: dict, atol: float = 1e-5, cfg: ModelConfig | None = None) -> None:
    """`cfg`: the model's config, where some tensors are not trained (`test_megatron.untrained`)."""
    before, after = saved["at_save"], got["at_save"]
    assert after["step"] == before["step"] == 2 and after["lr"] == before["lr"]  # 2 optimizer steps, warm-up lr
    assert after["adam_steps"] == before["adam_steps"] == {2.0}  # Adam's own step (bias correction)
    assert got["extra"] == saved["extra"]
    assert torch.equal(got["rng"], saved["rng"])
    assert list(after["weights"]) == list(before["weights"])
    for name, w in before["weights"].items():
        assert torch.equal(after["weights"][name], w), name
    for key, moments in (before["moments"] or {}).items():  # (the CPU path's AdamW)
        assert set(after["moments"][key]) == set(moments)
        for name, m in moments.items():
            frozen = cfg is not None and untrained(name, cfg)
            assert (m.any() or frozen) and torch.equal(after["moments"][key][name], m), (key, name)
    # the next step equals the uninterrupted run's (up to the reduction order of another layout)
    for key in METRICS:
        assert got["next"]["metrics"][key] == pytest.approx(saved["next"]["metrics"][key], rel=1e-4, abs=atol), key
    for name, w in saved["next"]["weights"].items():
        torch.testing.assert_close(
            got["next"]["weights"][name], w, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )
        if cfg is not None and untrained(name, cfg):
            assert torch.equal(w, before["weights"][name]), name
            continue
        assert not torch.equal(w, before["weights"][name]), name  # the step moved it: equality is not trivial


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2)], ids=["dp2_to_dp1", "dp2_to_tp2"])
def test_resume_on_another_layout(
    dense_ckpt: tuple[Path, dict], tiny_model: Path, tmp_path: Path, world: int, tp: int
) -> None:
    """Saved at DP 2 (TP 1), resumed at DP 1 on one rank, and at TP 2 (the layers split over two ranks):
    megatron's dist_checkpointing reshards model and optimizer state alike (both named by the model's tensors)."""
    ckpt, saved = dense_ckpt
    assert json.loads((ckpt / "megatron.json").read_text())["data_parallel"] == 2
    _assert_resumed(saved, _run("resume", tiny_model, ckpt, tmp_path / "got.pt", world=world, tp=tp))


def test_moe_resumes_with_another_expert_parallel_size(tiny_moe_model: Path, tmp_path: Path) -> None:
    """Qwen3-MoE with its 8 experts split over 2 expert-parallel ranks (4 each), resumed on one rank holding all 8:
    each expert's weights and moments come back from the checkpoint by their global expert index."""
    saved = _run("save", tiny_moe_model, tmp_path / "step_1", tmp_path / "saved.pt", world=2, ep=2)
    got = _run("resume", tiny_moe_model, tmp_path / "step_1", tmp_path / "got.pt", world=1)
    assert any(".mlp.experts.7." in name for name in got["at_save"]["moments"]["exp_avg"])
    _assert_resumed(saved, got)


def test_moe_under_tp_resumes_on_one_rank(tiny_moe_model: Path, tmp_path: Path) -> None:
    """Qwen3-MoE saved at TP 2 x EP 2 (sequence parallelism, the experts whole on both TP ranks of their EP rank;
    4 ranks) and resumed on one rank: weights, moments and the next step as the run that never stopped."""
    saved = _run("save", tiny_moe_model, tmp_path / "step_1", tmp_path / "saved.pt", world=4, tp=2, ep=2)
    assert json.loads((tmp_path / "step_1" / "megatron.json").read_text())["tensor_parallel"] == 2
    got = _run("resume", tiny_moe_model, tmp_path / "step_1", tmp_path / "got.pt", world=1)
    _assert_resumed(saved, got)


def test_dsa_resumes_with_another_expert_parallel_size(tmp_path: Path) -> None:
    """GLM-5 (DSA indexers on full layers, the MTP layer in megatron's MTP modules, all frozen) saved at EP 2 and
    resumed on one rank: the frozen tensors come back from the checkpoint too, unchanged by the next step."""
    from miles_hpc.models.presets import init_model

    model = init_model("glm_moe_dsa", "tiny", tmp_path / "model")
    saved = _run("save", model, tmp_path / "step_1", tmp_path / "saved.pt", world=2, ep=2)
    got = _run("resume", model, tmp_path / "step_1", tmp_path / "got.pt", world=1)
    assert any(".self_attn.indexer." in n for n in got["at_save"]["weights"])
    assert any(n.startswith("model.layers.4.") for n in got["at_save"]["weights"])  # the MTP layer
    _assert_resumed(saved, got, cfg=read_config(model))


def test_glm5_under_tp_with_recompute_resumes_without(tmp_path: Path) -> None:
    """GLM-5 in the flagship's CPU-testable options: MoE under TP 2 x EP 2 (sequence parallelism through MLA and the
    DSA indexer) with full recompute, 4 ranks; resumed at EP 2 without recompute (2 ranks), and on one rank with
    full recompute: weights, moments, step and the next step as the run that never stopped."""
    from miles_hpc.models.presets import init_model

    model = init_model("glm_moe_dsa", "tiny", tmp_path / "model")
    ckpt = tmp_path / "step_1"
    saved = _run("save", model, ckpt, tmp_path / "saved.pt", world=4, tp=2, ep=2, recompute="full")
    assert json.loads((ckpt / "megatron.json").read_text())["tensor_parallel"] == 2
    cfg = read_config(model)
    got = _run("resume", model, ckpt, tmp_path / "ep2.pt", world=2, ep=2)
    _assert_resumed(saved, got, cfg=cfg)
    got = _run("resume", model, ckpt, tmp_path / "one.pt", world=1, recompute="full")
    _assert_resumed(saved, got, cfg=cfg)


def test_context_parallel_resumes_on_another_layout(tiny_moe_model: Path, tmp_path: Path) -> None:
    """Qwen3-MoE saved at CP 2 x EP 2 (the CP ranks replicas of the weights and moments) and resumed on one rank,
    then that checkpoint resumed at CP 2: weights, moments, step and the next step as the runs that never stopped."""
    saved = _run("save", tiny_moe_model, tmp_path / "cp", tmp_path / "saved.pt", world=4, ep=2, cp=2)
    got = _run("resume", tiny_moe_model, tmp_path / "cp", tmp_path / "got.pt", world=1)
    _assert_resumed(saved, got)
    saved = _run("save", tiny_moe_model, tmp_path / "one", tmp_path / "saved1.pt", world=1)
    got = _run("resume", tiny_moe_model, tmp_path / "one", tmp_path / "got2.pt", world=2, cp=2)
    _assert_resumed(saved, got)


def test_virtual_pipeline_resumes_on_another_layout(tmp_path: Path) -> None:
    """DeepSeek-V3.2 (MLA, DSA indexers, an MTP layer; 6 layers) saved at PP 3 x VPP 2 (chunks of one layer, the MTP
    layer on the last stage's last chunk) and resumed on one rank, then that rank's checkpoint resumed at PP 3 x
    VPP 2: weights, moments, step and the next step as the runs that never stopped (megatron names every chunk's
    tensors globally)."""
    cfg = ModelConfig.from_hf_dict({**preset_config("deepseek_v32", "tiny"), "num_hidden_layers": 6})
    model = tmp_path / "model"
    save_pretrained(build_model(cfg), model)
    saved = _run("save", model, tmp_path / "vpp", tmp_path / "saved.pt", world=3, pp=3, vpp=2)
    assert json.loads((tmp_path / "vpp" / "megatron.json").read_text())["virtual_pipeline"] == 2
    _assert_resumed(saved, _run("resume", model, tmp_path / "vpp", tmp_path / "got.pt", world=1), cfg=cfg)
    saved = _run("save", model, tmp_path / "one", tmp_path / "saved1.pt", world=1)
    got = _run("resume", model, tmp_path / "one", tmp_path / "got1.pt", world=3, pp=3, vpp=2)
    _assert_resumed(saved, got, cfg=cfg)


def test_another_model_config_is_refused(dense_ckpt: tuple[Path, dict], tiny_model: Path, tmp_path: Path) -> None:
    """The same shapes with another RoPE base: dist_checkpointing alone would load it; `load` refuses, naming the
    checkpoint and both values."""
    ckpt, _ = dense_ckpt
    other = tmp_path / "model"
    shutil.copytree(tiny_model, other)
    config = json.loads((other / "config.json").read_text())
    theta = config["rope_theta"]
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": theta * 2}))
    got = _run("refuse", other, ckpt, tmp_path / "got.pt", world=1)
    assert got["error"] is not None, "load accepted a checkpoint of another model config"
    assert str(ckpt) in got["error"]
    assert f"rope_theta={float(theta)!r} in the checkpoint, {float(theta * 2)!r} in this run" in got["error"]


@pytest.mark.gpu
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_resume_with_megatron_optimizer_gpu(tiny_model: Path, tmp_path: Path, distributed_optimizer: bool) -> None:
    """On a GPU the optimizer is megatron's: the non-distributed one restores Adam's step itself; the distributed
    one's fully reshardable layout loads through `load`'s way around its torch-Adam `step` handling. The same
    layout (one GPU), fp32: weights, Adam's step, our step and the next train step as the run that never stopped."""
    kw = {"world": 1, "device": "cuda", "distributed_optimizer": distributed_optimizer}
    saved = _run("save", tiny_model, tmp_path / "step_1", tmp_path / "saved.pt", **kw)
    _assert_resumed(saved, _run("resume", tiny_model, tmp_path / "step_1", tmp_path / "got.pt", **kw), atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("saved_at", "resumed_at", "mixed"), [(0.5, 0.5, False), (0.5, 0.0, False), (0.0, 1.0, False), (0.5, 0.5, True)]
)
def test_offloaded_optimizer_state_resumes_offloaded_or_not_gpu(
    tiny_model: Path, tmp_path: Path, saved_at: float, resumed_at: float, mixed: bool
) -> None:
    """megatron.optimizer_offload_fraction (that share of the distributed optimizer's shard on the host,
    precision-aware): saved with half offloaded and resumed so and with none, and saved without offload resumed with
    all of it offloaded: weights, Adam's step, our step and the next train step as the run that never stopped
    (fp32; and half offloaded under bf16 mixed precision, the flagship's, where the GPU share steps float32 copies)."""
    kw = {"world": 1, "device": "cuda", "distributed_optimizer": True, "mixed": mixed}
    saved = _run("save", tiny_model, tmp_path / "ckpt", tmp_path / "saved.pt", offload=saved_at, **kw)
    got = _run("resume", tiny_model, tmp_path / "ckpt", tmp_path / "got.pt", offload=resumed_at, **kw)
    _assert_resumed(saved, got, atol=1e-3 if mixed else 1e-4)
