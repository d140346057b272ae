"""`miles-hpc run` on the families of issue 30 (Kimi-K2.5's multimodal checkpoint, DeepSeek-V4, Inkling): the
engines serve the text model, the FSDP trainer trains it, weights sync, R3 replays the routed MoE layers, and
`miles-hpc export` writes the checkpoint back whole (a wrapper's tower included); the reward rises on the demo."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_loop_e2e import REPO, metrics, run

pytestmark = pytest.mark.process


def test_kimi_k25_runs_with_r3_and_exports_its_tower(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = run(run_dir, "model.init_arch=kimi_k25", "steps=3", "train.sft_warmup_steps=0", "algo.routing_replay=true")
    assert "done: 3 steps" in out
    rows = metrics(run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2, 3] and all(r["sync/verified_tensors"] > 0 for r in rows)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4
    assert all(r["r3/topk_agreement"] == 1.0 and r["r3/coverage"] > 0.9 for r in rows)
    argv = [sys.executable, "-m", "miles_hpc.cli", "export", str(run_dir), str(tmp_path / "export")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {}
    for where in ("run/model", "export"):
        with safe_open(str(tmp_path / where / "model.safetensors"), "pt") as f:
            names[where] = set(f.keys())
    assert names["export"] == names["run/model"] and any(n.startswith("vision_tower.") for n in names["export"])
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "kimi_k25"


def test_inkling_release_runs_and_exports_its_towers(tmp_path: Path) -> None:
    """Inkling's multimodal release (a tiny one, written by transformers): its text model trains with R3, and the
    export is the release again, towers and all (tests/test_models_inkling_release.py checks the bits)."""
    from test_models_inkling_release import make_release

    from miles_hpc.models.tokenizer import write_tokenizer

    _, path = make_release(tmp_path, vocab_size=512, unpadded_vocab_size=500)
    write_tokenizer(path, model_max_length=256)  # the demo's byte-level tokenizer, as init-model writes it
    run_dir = tmp_path / "run"
    steps = ("steps=2", "train.sft_warmup_steps=0", "algo.routing_replay=true")
    out = run(run_dir, f"model.path={path}", *steps)
    assert "done: 2 steps" in out
    rows = metrics(run_dir)
    assert all(r["r3/coverage"] > 0.9 and r["response_len_mean"] > 0 for r in rows)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4
    argv = [sys.executable, "-m", "miles_hpc.cli", "export", str(run_dir), str(tmp_path / "export")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (
        safe_open(str(path / "model.safetensors"), "pt") as f,
        safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as g,
    ):
        assert set(f.keys()) == set(g.keys())
        assert all(torch.equal(f.get_tensor(n), g.get_tensor(n)) for n in f.keys() if not n.startswith("model.llm."))
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "inkling_mm_model"


@pytest.mark.parametrize("arch", ["deepseek_v4", "inkling_text"])
def test_a_new_family_runs_with_r3(arch: str, tmp_path: Path) -> None:
    """The engines keep each sequence's state for these families (engine/family_states.py); the trainer's log-probs
    of the engines' tokens are the engines' (< 1e-4) and R3 replays every recorded route."""
    run_dir = tmp_path / "run"
    out = run(run_dir, f"model.init_arch={arch}", "steps=2", "train.sft_warmup_steps=0", "algo.routing_replay=true")
    assert "done: 2 steps" in out
    rows = metrics(run_dir)
    assert [r["weight_version"] for r in rows] == [1, 2] and all(r["sync/verified_tensors"] > 0 for r in rows)
    assert all(r["r3/coverage"] > 0.9 and r["r3/topk_agreement"] == 1.0 for r in rows)
    assert all(r["response_len_mean"] > 0 for r in rows)  # the engines generated (a failed step is an error)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4


@pytest.mark.parametrize(("arch", "adapted"), [("kimi_k25", 8), ("deepseek_v4", 35), ("inkling_text", 22)])
def test_lora_runs_on_the_new_families(arch: str, adapted: int, tmp_path: Path) -> None:
    """sync.strategy=lora: only the adapters travel. Kimi-K2.5's tiny text model: 2 layers x (its MLA projections
    that are targets: o_proj) + layer 0's dense MLP (3) + layer 1's shared expert (3) = 8 linears. DeepSeek-V4's
    own targets (models/lora.py FAMILY_TARGETS): 5 layers x (4 attention + 3 shared-expert projections) = 35,
    none in its compressors or indexers. Inkling: 4 layers x (q, k, v, o) + 2 dense MLPs x 3 = 22."""
    run_dir = tmp_path / "run"
    run(run_dir, f"model.init_arch={arch}", "sync.strategy=lora", "lora.rank=4", "train.sft_warmup_steps=0", "steps=2")
    rows = metrics(run_dir)
    assert [r["sync/verified_tensors"] for r in rows] == [2 * adapted] * 2  # an A and a B each
    assert all(r["response_len_mean"] > 0 and r["rollout/failed_frac"] == 0.0 for r in rows)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4


def test_what_the_new_families_refuse(tmp_path: Path) -> None:
    """Each refusal names its key: SGLang, engine TP, megatron, zero-KL (config/checks.py `module_family`)."""
    from test_preflight import check

    from miles_hpc.config import load_config
    from miles_hpc.config.loader import ConfigError
    from miles_hpc.models import ModelConfig, load_pretrained
    from miles_hpc.models.presets import init_model, preset_config
    from miles_hpc.planner.estimate import Cluster, estimate, param_counts
    from miles_hpc.planner.mcore_layout import mcore_rules

    for arch in ("deepseek_v4", "inkling_text"):
        for overrides, key in (
            (["rollout.backend=sglang"], "rollout.backend"),
            (["rollout.engine_tp=2"], "rollout.engine_tp"),
            (["train.backend=megatron", "megatron.distributed_optimizer=false"], "train.backend"),
            (["zero_kl=true"], "zero_kl"),
        ):
            with pytest.raises(ConfigError, match=key):
                load_config(REPO / "configs" / "tiny_cpu.yaml", [f"model.init_arch={arch}", *overrides])
        with pytest.raises(NotImplementedError, match="megatron-core 0.16 has no"):
            mcore_rules(ModelConfig.from_hf_dict(preset_config(arch, "tiny")))
        # The planner counts their weights (the meta-device model), their activations (measured on the meta device)
        # and their engine's decode state (tests/test_plan_families.py checks the figures); preflight sends a
        # checkpoint of theirs where its preset would go.
        mem = estimate(preset_config(arch, "tiny"), Cluster(train_gpus=1, engines=1, engine_tp=1, gpu_mem_gb=80))[
            "memory"
        ]
        assert mem["train_fits"] and mem["train_activations_gb"] > 0
        assert mem["rollout_kv_bytes_per_token"] > 0 and mem["rollout_state_bytes_per_seq"] > 0
        path = init_model(arch, "tiny", tmp_path / arch)
        assert param_counts(preset_config(arch, "tiny"))[0] == sum(
            p.numel() for p in load_pretrained(path).parameters()
        )
        problems = check([f"model.path={path}", "rollout.engine_tp=2"]).problems
        assert [p.key for p in problems] == ["rollout.engine_tp"], problems


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "steps"), [("kimi_k25", 150), ("inkling_text", 300), ("deepseek_v4", 80)])
def test_a_new_family_learns_the_demo_task(arch: str, steps: int, tmp_path: Path) -> None:
    """The README's demo with the family's tiny preset: the mean reward of the last 10 steps beats the first 10's
    by 0.05 or more. Measured on the 2-core dev machine (2026-12-06): Kimi-K2.5 0.073 -> 0.231 in 150 steps
    (1 min 17 s), Inkling 0.061 -> 0.214 in 300 steps (5 min 25 s; 0.061 -> 0.100 after 150), DeepSeek-V4 0.106 ->
    0.253 in 150 steps (6 min 47 s; steps 71-80 already 0.28, so CI runs 80: 4 min 50 s)."""
    run_dir = tmp_path / "demo"
    run(run_dir, f"model.init_arch={arch}", f"steps={steps}", small=False)
    rewards = [r["reward_mean"] for r in metrics(run_dir)]
    first, last = statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:])
    assert last - first >= 0.05, (first, last)
