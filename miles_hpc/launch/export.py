"""`miles-hpc export RUN_DIR [OUT]`: a run's trained weights as an HF-format checkpoint (stage: loop).

Checkpoints are torch DCP directories (`RUN/checkpoints/step_N`, sharded like the trainer that wrote them); users
need the trained policy as config.json + safetensors (+ tokenizer) to serve it, evaluate it, or use it as a
teacher. This builds a one-rank trainer on the CPU (gloo) on the run's base model, loads the checkpoint (DCP
re-shards to one rank), and writes the weights in the Hub layout with `save_pretrained`, next to copies of the
base model's tokenizer and generation files. The run's config (`RUN/config.yaml`) says what the trainer was; a LoRA
run's checkpoint (the adapter) is merged into the base weights (docs/lora.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from miles_hpc.config import load_config
from miles_hpc.launch.local import free_port
from miles_hpc.launch.run_dir import RunPaths

_EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def export_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> Path:
    """Write the checkpoint of `step` (default: the latest) of the run at `run_dir` to `out_dir`; returns it."""
    import torch

    from miles_hpc.models import hf_target, load_pretrained, save_pretrained
    from miles_hpc.train.checkpoint import latest_checkpoint
    from miles_hpc.train.dist import init_trainer_world, teardown, world_from_env
    from miles_hpc.train.fsdp import FSDPTrainer

    paths = RunPaths(Path(run_dir))
    if not paths.config.is_file():
        raise FileNotFoundError(f"{paths.config} does not exist: {run_dir} is not a run directory")
    cfg = load_config(paths.config)
    base = Path(cfg.model.path) if cfg.model.path else paths.init_model
    ckpt = paths.checkpoints / f"step_{step}" if step is not None else latest_checkpoint(paths.root)
    if ckpt is None or not ckpt.is_dir():
        raise FileNotFoundError(
            f"no checkpoint {'step_' + str(step) if step is not None else ''} under {paths.checkpoints}"
        )
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    init_trainer_world(world_from_env(env, device="cpu"))
    try:
        # LoRA runs: the adapter checkpoint onto the base; state_for_sync then gives the merged weights
        trainer = FSDPTrainer(str(base), cfg.train, cfg.algo, device="cpu", seed=cfg.seed, lora=cfg.lora)
        trainer.load(ckpt)
        model = load_pretrained(base, dtype=torch.float32)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in trainer.state_for_sync():
                hf_target(model, name, params).copy_(t)
    finally:
        teardown()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model.to(model.config.torch_dtype() or torch.float32), out)
    for f in _EXTRA_FILES:
        if (base / f).is_file():
            shutil.copy2(base / f, out / f)
    (out / "EXPORTED_FROM").write_text(f"{ckpt.resolve()}\n{os.uname().nodename}\n")
    return out
