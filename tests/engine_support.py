"""Helpers shared by the engine-core tests (no tests here)."""

from __future__ import annotations

from pathlib import Path

import torch

from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, GenerateResult
from miles_hpc.models import ModelConfig, build_model, save_pretrained
from miles_hpc.models.presets import init_model, preset_config


def make_ckpt(out: Path, arch: str, seed: int, std: float = 0.2) -> Path:
    """A tiny random checkpoint with a sharper init than the preset (std 0.2, untied head), so greedy text depends
    on the whole context instead of repeating the last token."""
    init_model(arch, "tiny", out, seed=seed)  # tokenizer + generation_config.json
    hf = preset_config(arch, "tiny")
    hf.update(initializer_range=std, tie_word_embeddings=False)
    torch.manual_seed(seed)
    save_pretrained(build_model(ModelConfig.from_hf_dict(hf)), out)
    return out


def run(engine: Engine, *reqs: GenerateRequest) -> dict[str, GenerateResult]:
    """Submit `reqs` and step the engine (no background thread) until idle; results by rid."""
    results: dict[str, GenerateResult] = {}
    for r in reqs:
        engine.submit(r, lambda res: results.__setitem__(res.rid, res))
    while engine.step():
        pass
    return results
