"""What zero-KL mode costs: the engine's generation throughput and the trainer's step time, normal mode versus
zero-KL mode (batch-invariant kernels on both sides, docs/lora.md), same device, same model, same requests, one run;
and what it buys: the train-inference mismatch each mode leaves on those requests.

Requests are RL-shaped: `--prompts` prompts of random lengths, `--group` samples each (sampled at temperature 1, so
a group's prompt hits the prefix cache and the batch size changes as samples finish at different lengths). Per
mode: an engine (normal: its default fast path, Triton decode and CUDA graphs on a GPU) generates them after a
warm-up, then a one-rank `FSDPTrainer` (bf16 mixed precision on a GPU) scores the same tokens and takes `--steps`
timed train steps on them. Printed, one JSON line each:
- `side=engine`: generated tokens per second (wall time of the whole request set, prefill included);
- `side=trainer`: median train-step seconds and tokens per second;
- `side=mismatch`: max |engine log-prob - trainer log-prob| over the sampled tokens (0.0 exactly in zero-KL mode);
- `side=cost`: zero-KL over normal, per side (the slowdown factor).
Zero-KL mode runs once per `--kernels` setting (models/invariant.py, MILES_INVARIANT_KERNELS: "torch" tiles, or
"triton" one-launch kernels on a GPU); the records' `mode` is `zero_kl:<kernels>`.

    python benchmarks/bench_zero_kl.py                              # GPU: qwen3-0.6b shapes, bf16
    python benchmarks/bench_zero_kl.py --shape moe-1b               # GPU: a reduced Qwen3-MoE (16 experts, top-4)
    python benchmarks/bench_zero_kl.py --kernels torch,triton       # GPU: both kernel settings beside normal mode
    python benchmarks/bench_zero_kl.py --device cpu --shape qwen3:small --prompts 8 --new-tokens 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import SHAPES, sync, write_checkpoint  # noqa: E402

from miles_hpc.config import AlgoConfig, TrainConfig  # noqa: E402
from miles_hpc.data.sample import token_hash  # noqa: E402
from miles_hpc.engine.config import EngineConfig  # noqa: E402
from miles_hpc.engine.core import Engine  # noqa: E402
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402
from miles_hpc.models import invariant  # noqa: E402
from miles_hpc.models.presets import preset_config  # noqa: E402
from miles_hpc.train import dist as tdist  # noqa: E402
from miles_hpc.train.batch import TrainBatch  # noqa: E402
from miles_hpc.train.fsdp import FSDPTrainer  # noqa: E402

# A reduced Qwen3-MoE: Qwen3-30B-A3B's widths (bench_rollout's shape) with 8 layers of 16 experts, 4 per token.
MOE_1B = SHAPES["qwen3-30b-a3b-12l"] | dict(num_hidden_layers=8, num_experts=16, num_experts_per_tok=4)


def make_checkpoint(shape: str, dtype: torch.dtype, out: Path) -> Path:
    """`shape`: qwen3-0.6b, moe-1b, or ARCH:SIZE of the presets (qwen3:small, qwen3_moe:tiny, ...)."""
    if shape == "moe-1b":
        hf = dict(MOE_1B)
    elif shape in SHAPES:
        hf = dict(SHAPES[shape])
    else:
        arch, _, size = shape.partition(":")
        hf = preset_config(arch, size or "small")
        hf.update(initializer_range=0.2, tie_word_embeddings=False)  # sharp logits: sampled text varies
    return write_checkpoint(hf, dtype, out)


def make_prompts(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(args.min_prompt, args.max_prompt + 1, (args.prompts,), generator=g).tolist()
    return [torch.randint(0, min(vocab, 32000), (n,), generator=g).tolist() for n in lens]


def generate(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, list[GenerateResult]]:
    """Wall seconds to run every prompt's group to completion, and the results in submission order."""
    results: dict[str, GenerateResult] = {}
    rids = [[uuid.uuid4().hex for _ in range(args.group)] for _ in prompts]

    def submit(j: int) -> None:
        for i, p in enumerate(prompts):
            # Sampled lengths: a sample stops between half and all of --new-tokens, so the batch shrinks unevenly.
            n = args.new_tokens // 2 + (i * args.group + j) * 7919 % (args.new_tokens // 2 + 1)
            sp = SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, sampling_seed=i * 1000 + j)
            req = GenerateRequest(rid=rids[i][j], input_ids=tuple(p), sampling=sp, return_logprob=True)
            engine.submit(req, lambda r: results.__setitem__(r.rid, r))

    t0 = time.perf_counter()
    submit(0)  # each group's first sample; the others join after one step and find the prompt in the prefix cache
    engine.step()
    for j in range(1, args.group):
        submit(j)
    total = len(prompts) * args.group
    while len(results) < total:
        engine.step()
    sync(str(engine.device))
    return time.perf_counter() - t0, [results[r] for group in rids for r in group]


def train_batch(prompts: list[list[int]], results: list[GenerateResult], group: int) -> TrainBatch:
    toks, masks, lps, adv = [], [], [], []
    for k, r in enumerate(results):
        p = prompts[k // group]
        toks.append(p + r.output_ids)
        masks.append([0] * len(p) + [1] * len(r.output_ids))
        lps.append([0.0] * len(p) + list(r.output_logprobs))
        adv.append([1.0 if k % 2 else -1.0] * (len(p) + len(r.output_ids)))
    return TrainBatch(
        tokens=toks, loss_mask=masks, rollout_logprobs=lps, advantages=adv, token_hash=[token_hash(t) for t in toks]
    )


def max_mismatch(trainer: FSDPTrainer, batch: TrainBatch) -> float:
    worst = 0.0
    for mask, engine_lp, mine in zip(batch.loss_mask, batch.rollout_logprobs, trainer.compute_logprobs(batch)):
        for m, a, b in zip(mask[1:], engine_lp[1:], mine[1:]):
            if m:
                worst = max(worst, abs(a - b))
    return worst


def run_mode(ckpt: Path, kernels: str | None, args: argparse.Namespace, vocab: int) -> dict[str, dict[str, object]]:
    """Normal mode (`kernels` None), or zero-KL mode with MILES_INVARIANT_KERNELS=`kernels` for both sides."""
    zero_kl = kernels is not None
    mode = f"zero_kl:{kernels}" if zero_kl else "normal"
    os.environ[invariant.KERNELS_ENV] = kernels or "torch"
    on_gpu = args.device.startswith("cuda")
    ecfg = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        batch_invariant=zero_kl,
        seed=0,
        num_blocks=args.num_blocks,
        max_running_requests=args.prompts * args.group,
    )
    engine = Engine.from_pretrained(str(ckpt), ecfg)
    generate(engine, make_prompts(args, vocab, seed=99)[:2], args)  # warm-up: kernels, graphs, allocator
    prompts = make_prompts(args, vocab, seed=0)
    wall, results = generate(engine, prompts, args)
    new = sum(len(r.output_ids) for r in results)
    cached = sum(r.cached_tokens for r in results)
    out: dict[str, dict[str, object]] = {}
    out["engine"] = {
        "bench": "zero_kl",
        "side": "engine",
        "mode": mode,
        "tokens_per_s": round(new / wall, 1),
        "wall_s": round(wall, 3),
        "generated_tokens": new,
        "requests": len(results),
        "prompt_tokens_cached": cached,
    }
    del engine
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()

    tcfg = TrainConfig(
        device="cuda" if on_gpu else "cpu", mixed_precision=on_gpu, max_tokens_per_microbatch=args.microbatch_tokens
    )
    trainer = FSDPTrainer(str(ckpt), tcfg, AlgoConfig(), device=tcfg.device, seed=0, zero_kl=zero_kl)
    batch = train_batch(prompts, results, args.group)
    out["mismatch"] = {
        "bench": "zero_kl",
        "side": "mismatch",
        "mode": mode,
        "max_abs_logprob_diff": max_mismatch(trainer, batch),
    }
    trainer.train_step(batch)  # warm-up
    times = []
    for _ in range(args.steps):
        sync(args.device)
        t0 = time.perf_counter()
        trainer.train_step(batch)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    tokens = sum(len(t) for t in batch.tokens)
    step = statistics.median(times)
    out["trainer"] = {
        "bench": "zero_kl",
        "side": "trainer",
        "mode": mode,
        "step_s": round(step, 4),
        "tokens_per_s": round(tokens / step, 1),
        "tokens": tokens,
        "step_times_s": [round(t, 4) for t in times],
    }
    del trainer
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return out


def _report(res: dict[str, dict[str, Any]], env_info: dict[str, Any]) -> None:
    for side in ("engine", "trainer", "mismatch"):
        print(json.dumps({**res[side], **env_info}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--shape", default=None, help="qwen3-0.6b (GPU default), moe-1b, or ARCH:SIZE (CPU default qwen3:small)"
    )
    ap.add_argument("--prompts", type=int, default=None, help="default 16 on GPU, 8 on CPU")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (prefix-cache hits)")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=None, help="default 128 on GPU, 64 on CPU")
    ap.add_argument("--new-tokens", type=int, default=None, help="at most; default 64 on GPU, 32 on CPU")
    ap.add_argument("--steps", type=int, default=3, help="timed train steps (after one warm-up)")
    ap.add_argument("--microbatch-tokens", type=int, default=8192)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=4, help="CPU: intra-op threads (zero-KL caps them at 8)")
    ap.add_argument(
        "--kernels",
        default=None,
        help="zero-KL kernel settings to time, comma-separated (default: triton on a GPU, torch on CPU)",
    )
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    args.shape = args.shape or ("qwen3-0.6b" if on_gpu else "qwen3:small")
    args.prompts = args.prompts or (16 if on_gpu else 8)
    args.max_prompt = args.max_prompt or (128 if on_gpu else 64)
    args.new_tokens = args.new_tokens or (64 if on_gpu else 32)
    kernels = (args.kernels or ("triton" if on_gpu else "torch")).split(",")
    args.dtype = "bfloat16" if on_gpu else "float32"  # zero-KL: the trainer's compute dtype (bf16 mixed on GPUs)
    if not on_gpu:
        torch.set_num_threads(args.threads)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cuda" if on_gpu else "cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(args.shape, getattr(torch, args.dtype), Path(tmp) / "model")
        vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
        env_info = {
            "device": torch.cuda.get_device_name() if on_gpu else f"cpu x{torch.get_num_threads()}",
            "shape": args.shape,
            "torch": torch.__version__,
            "prompts": args.prompts,
            "group": args.group,
            "max_new_tokens": args.new_tokens,
            "dtype": args.dtype,
        }
        normal = run_mode(ckpt, None, args, vocab)
        _report(normal, env_info)  # each mode's lines as soon as it is timed: a run cut short keeps what it measured
        for k in kernels:
            got = run_mode(ckpt, k, args, vocab)
            _report(got, env_info)
            eng = normal["engine"]["tokens_per_s"] / got["engine"]["tokens_per_s"]
            trn = got["trainer"]["step_s"] / normal["trainer"]["step_s"]
            cost = {"bench": "zero_kl", "side": "cost", "kernels": k}
            print(
                json.dumps(
                    {**cost, "engine_slowdown_x": round(eng, 2), "trainer_slowdown_x": round(trn, 2), **env_info}
                ),
                flush=True,
            )
    tdist.teardown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
