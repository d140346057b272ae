"""R3 benchmark: rollout-vs-train log-prob mismatch on a tiny MoE, with and without routing replay, over RL steps.

The rollout side is the real embedded engine serving the policy in bf16 (as rollout engines do); the trainer holds
fp32 weights (as FSDP master weights are). Per step: the engine generates `--prompts` x `--group` samples with
their log-probs and routed experts; the trainer scores the same tokens (a) with its own routers (R3 off) and (b)
replaying the engine's experts (R3 on); then it takes one AdamW policy-gradient step (GRPO-normalised random
rewards: the update size of RL, not its direction, is what moves the routers) and publishes the new weights to the
engine. One JSON line per (model, step): mean and max |rollout - train| log-prob over response tokens, the k3 KL
estimate, top-k agreement of the live routers with the record, and the routing storage per token (HDF5 layout).

    python benchmarks/bench_r3.py                     # qwen3_moe and deepseek_v3 "small" presets, CPU, ~1 min
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from miles_hpc.data.store import expert_dtype
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, SamplingParams
from miles_hpc.models import iter_hf_tensors, load_pretrained
from miles_hpc.models.presets import init_model


def generate(engine: Engine, prompts: list[list[int]], group: int, new: int, seed: int) -> list[tuple]:
    out: dict[str, object] = {}
    for i, p in enumerate(prompts):
        for j in range(group):
            sp = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, sampling_seed=seed + 97 * i + j)
            req = GenerateRequest(rid=f"{i}-{j}", input_ids=tuple(p), sampling=sp, return_routed_experts=True)
            engine.submit(req, lambda r: out.__setitem__(r.rid, r))
    while engine.step():
        pass
    return [(p, out[f"{i}-{j}"]) for i, p in enumerate(prompts) for j in range(group)]


def score(model: torch.nn.Module, p: list[int], res: object, replay: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = p + res.output_ids  # type: ignore[attr-defined]
    routed = torch.from_numpy(res.routed_experts.astype(np.int64))  # type: ignore[attr-defined]
    record = torch.full((1, len(tokens), *routed.shape[1:]), -1, dtype=torch.long)
    record[0, : routed.shape[0]] = routed
    logits = model(torch.tensor([tokens]), routing_replay=record, routing_compare=not replay)
    lp = torch.log_softmax(logits[0].float(), dim=-1)[len(p) - 1 : -1]
    return lp.gather(1, torch.tensor(res.output_ids)[:, None]).squeeze(1), model.replay_stats()  # type: ignore


def bench(arch: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = init_model(arch, "small", Path(tmp) / "m", seed=args.seed)
        trainer = load_pretrained(ckpt).train()
        engine = Engine.from_pretrained(str(ckpt), EngineConfig(dtype="bfloat16", block_size=16))
        opt = torch.optim.AdamW(trainer.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(args.seed)
        cfg = trainer.config
        for step in range(args.steps):
            prompts = [torch.randint(0, 256, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
            samples = generate(engine, prompts, args.group, args.new_tokens, seed=1000 * step)
            line: dict[str, object] = {
                "bench": "r3",
                "model": f"{arch}-small",
                "moe_layers": trainer.num_moe_layers,
                "top_k": trainer.top_k,
                "experts": cfg.num_experts,
                "step": step,
            }
            for replay in (False, True):
                diffs, kls, stats = [], [], torch.zeros(3, dtype=torch.long)
                with torch.no_grad():
                    for p, res in samples:
                        lp, st = score(trainer, p, res, replay)
                        ro = torch.tensor(res.output_logprobs)
                        diffs.append((lp - ro).abs())
                        kls.append(torch.exp(lp - ro) - (lp - ro) - 1)  # k3 estimate of KL(rollout || train)
                        stats += st
                d, k = torch.cat(diffs), torch.cat(kls)
                tag = "r3_on" if replay else "r3_off"
                line[tag] = {
                    "mean_abs_logprob_diff": round(d.mean().item(), 6),
                    "max_abs_logprob_diff": round(d.max().item(), 5),
                    "kl_k3": round(k.mean().item(), 7),
                    "topk_agreement": round(stats[1].item() / max(stats[0].item(), 1), 4),
                }
            rows = sum(res.routed_experts.shape[0] for _, res in samples)
            tokens = sum(len(p) + len(res.output_ids) for p, res in samples)
            width = trainer.num_moe_layers * trainer.top_k * np.dtype(expert_dtype(cfg.num_experts)).itemsize
            line["routing_bytes_per_token"] = round(rows * width / tokens, 2)
            print(json.dumps(line), flush=True)
            # One policy-gradient step on these samples (R3 on, as the trainer would), then publish to the engine.
            rewards = torch.rand(args.prompts, args.group, generator=g)
            adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
            opt.zero_grad()
            loss = sum(-a * score(trainer, p, res, True)[0].sum() for a, (p, res) in zip(adv.tolist(), samples))
            (loss / len(samples)).backward()
            opt.step()
            engine.update_weights(
                [(n, t.detach().to(torch.bfloat16)) for n, t in iter_hf_tensors(trainer)], version=str(step + 1)
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="qwen3_moe,deepseek_v3")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    for arch in args.archs.split(","):
        bench(arch, args)


if __name__ == "__main__":
    main()
