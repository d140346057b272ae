"""R3 (rollout routing replay): when rollout and training disagree on MoE routing (here the engine's routers are
slightly perturbed, as a bf16 rollout next to an fp32 trainer would be), training without R3 picks other experts for
some tokens and its log-probs drift from the rollout's; with R3 the training forward uses exactly the rollout's
experts and the mismatch drops. The rollout side is the real engine (routing capture, log-probs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_support import make_ckpt, run

from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import iter_hf_tensors, load_pretrained


def rollouts(ckpt: Path, noise: float, n: int = 6) -> list[tuple[list[int], np.ndarray, list[float], int]]:
    """(tokens, routed_experts [T-1, L, k], output log-probs, prompt length) from an engine whose router weights are
    the checkpoint's plus `noise` x N(0, 1)."""
    engine = Engine.from_pretrained(str(ckpt), EngineConfig(block_size=4))
    g = torch.Generator().manual_seed(3)
    moved = [
        (name, t + noise * torch.randn(t.shape, generator=g))
        for name, t in iter_hf_tensors(engine.model)
        if name.endswith("mlp.gate.weight")
    ]
    engine.update_weights(moved, version="perturbed")
    prompts = [torch.randint(0, 256, (7 + i,), generator=g).tolist() for i in range(n)]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, sampling_seed=9)
    reqs = [
        GenerateRequest(rid=str(i), input_ids=tuple(p), sampling=sp, return_routed_experts=True)
        for i, p in enumerate(prompts)
    ]
    res = run(engine, *reqs)
    return [
        (p + res[str(i)].output_ids, res[str(i)].routed_experts, res[str(i)].output_logprobs, len(p))
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_replay_uses_the_rollouts_experts_and_cuts_the_mismatch(arch: str, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path, arch, 0)
    trainer = load_pretrained(ckpt)
    diffs = {"off": [], "on": []}
    stats = {"off": torch.zeros(3, dtype=torch.long), "on": torch.zeros(3, dtype=torch.long)}
    for tokens, routed, lps, p in rollouts(ckpt, noise=0.02):
        ids = torch.tensor([tokens])
        record = torch.full((1, len(tokens), trainer.num_moe_layers, trainer.top_k), -1, dtype=torch.long)
        record[0, : routed.shape[0]] = torch.from_numpy(routed.astype(np.int64))  # the last token has no record
        for mode in ("off", "on"):
            with torch.no_grad():
                logits, used = trainer(
                    ids, routing_replay=record, routing_compare=mode == "off", return_routed_experts=True
                )
            stats[mode] += trainer.replay_stats()
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            mine = [lp[p - 1 + j, t].item() for j, t in enumerate(tokens[p:])]
            diffs[mode] += [abs(a - b) for a, b in zip(mine, lps)]
            if mode == "on":  # every recorded token went to exactly the rollout's experts
                assert torch.equal(used[0, : routed.shape[0]].long(), record[0, : routed.shape[0]])
    recorded, agree_off, total = stats["off"].tolist()
    assert recorded == stats["on"][0] and recorded < total  # coverage: all but each sample's last token
    assert agree_off < recorded  # without R3 the trainer's own routers disagree on some tokens
    mean_off, mean_on = float(np.mean(diffs["off"])), float(np.mean(diffs["on"]))
    assert mean_on < 0.5 * mean_off, (mean_on, mean_off)


def test_r3_loads_with_agents_and_in_fully_async_mode() -> None:
    """R3 was refused with agents and in fully async mode (no rows per turn, none stitched across pauses); both
    keep their rows now (tests/test_agent_routing.py, the end-to-end runs in tests/test_loop_e2e.py)."""
    from miles_hpc.config import load_config

    repo = Path(__file__).resolve().parents[1]
    r3 = ["algo.routing_replay=true", "model.init_arch=qwen3_moe"]
    assert load_config(repo / "configs/tiny_cpu.yaml", ["mode=fully_async", *r3]).algo.routing_replay
    assert load_config(repo / "configs/tiny_agent_cpu.yaml", ["mode=fully_async", *r3]).algo.routing_replay
    assert load_config(repo / "configs/tiny_cpu.yaml", ["algo.routing_replay=true"]).algo.routing_replay
