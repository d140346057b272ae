"""Parity with transformers 5.24 on random configs of every family (tests/random_configs.py): transformers builds
the model from the config with random weights and saves it; `load_pretrained` reads that checkpoint; the logits of
the same tokens agree. The other test_models*.py files pin chosen configs; these draw the shape and option keys,
as a checkpoint we have never seen would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from random_configs import FAMILIES, random_config
from test_models_support import max_diff, randomize_

from miles_hpc.models import load_pretrained

SEEDS = (0, 1, 2)
SEQ = 40  # beyond every drawn sliding window, compression rate, YaRN original length and DSA top-k


def _transformers_model(config: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    d = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    hf_config = AutoConfig.for_model(config["model_type"], **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", dtype=torch.float32, experts_implementation="eager"
    )
    randomize_(model)
    with torch.no_grad():  # routers off saturation: sigmoid scores that round to 1.0 tie, and a tie's pick is free
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mixer.gate.weight")):
                p.mul_(0.3)
    return model.eval()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_random_configs_match_transformers(family: str, seed: int, tmp_path: Path) -> None:
    config = random_config(family, seed)
    hf = _transformers_model(config)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path).eval()
    ids = torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
        err = max_diff(got, ref)
        if err < 1e-4:
            return
        # Recurrent layers (gated delta rule, SSM scans) sum in another order than transformers' chunked forms: a
        # larger gap passes when ours is as close to transformers' own float64 forward as its float32 one is.
        exact = hf.double()(ids).logits
    ours_err, hf_err = max_diff(got.double(), exact), max_diff(ref.double(), exact)
    assert ours_err <= 3 * hf_err + 1e-5, (config, err, ours_err, hf_err)
