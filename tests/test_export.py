"""`miles-hpc export`: a run's DCP checkpoint as an HF checkpoint. Checked against what the run itself recorded:
the samples generated with weight version 2 must have, under the exported step_2 model, the log-probs the engine
reported for them (the engine then held exactly those weights)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles_hpc.cli import main
from miles_hpc.data import TrajectoryReader
from miles_hpc.models import load_pretrained

pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]


def test_exported_step_reproduces_the_logprobs_the_engine_reported(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "miles_hpc.cli",
        "run",
        str(REPO / "configs/tiny_cpu.yaml"),
        f"run_dir={run_dir}",
        "steps=3",
        "train.checkpoint_interval=2",
        "train.world_size=2",
        "train.sft_warmup_steps=3",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out), "--step", "2"]) == 0
    model = load_pretrained(out)
    samples = [
        s for f in sorted((run_dir / "trajectories").glob("*.h5")) for s in TrajectoryReader(f) if s.train_step == 2
    ]
    assert samples and all(set(s.policy_version[s.prompt_len :]) == {2} for s in samples)
    worst = 0.0
    for s in samples:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([s.tokens]))[0].float(), dim=-1)
        for t in range(s.prompt_len, len(s.tokens)):
            worst = max(worst, abs(lp[t - 1, s.tokens[t]].item() - s.rollout_logprobs[t]))
    assert worst < 1e-4, worst
    base = load_pretrained(run_dir / "model")
    assert not torch.equal(base.lm_head.weight, model.lm_head.weight)  # trained weights, not the base model's
    AutoModelForCausalLM.from_pretrained(str(out))  # transformers reads it, and its tokenizer
    assert AutoTokenizer.from_pretrained(str(out))("1+2=")["input_ids"]
    assert main(["export", str(tmp_path / "nope")]) == 2
