"""Weight-sync benchmarks: one JSON line per result, one section per concern (docs/design.md section 6).

Sections (`--sections a,b` or `--only a`; all by default):
- delta: the BF16 delta codec (`miles_hpc.sync.codec.delta_codec`) on real AdamW RL steps. Per learning rate: a fresh
  random-init Qwen3-shaped model with fp32 master weights takes `--steps` GRPO-style steps (loss = -advantage x
  log-prob of random token sequences, advantages normalised per group); after each step every HF tensor is cast to
  bf16 and coded against the previous bf16 copy, as the trainer does when it publishes. Reported per lr, summed
  over steps and tensors: fraction of bf16 values changed; delta bytes (framed, all headers included) / full bf16
  bytes; XOR + zstd baseline (if `zstandard` is installed); two entropy bounds of the update, order-0
  (`entropy_iid_ratio`: change mask iid, ulp differences iid) and conditioned on the exponent of the old value
  (`entropy_ctx_ratio`, the context the codec uses, so it can beat the order-0 bound); encode/decode speed in
  full-tensor GB/s (with and without the `tensor_checksum` both a full and a delta send compute); and whether
  encode + send delta + decode beats sending the full bytes over a `--link-gbps` link (codec time only, checksums
  being common to both).

    python benchmarks/bench_weight_sync.py                                   # CPU, ~25M-param model, < 2 min
    python benchmarks/bench_weight_sync.py --only delta --size small         # the "small" preset, seconds
    python benchmarks/bench_weight_sync.py --only delta --device cuda --size 1b --steps 2
    python benchmarks/bench_weight_sync.py --only transfer                   # real engine processes, CPU gloo

- codec: the codec alone on one large synthetic tensor (`--codec-mb`), per `--classes` bound: GB/s of encode,
  decode and both, against the `--link-gbps` link.

    python benchmarks/bench_weight_sync.py --only codec --device cuda --codec-mb 1024

- transfer: one publish per strategy to real `miles-hpc serve` engines on this host (sync_transfer.py).

- checksum: the verification's own cost on `--checksum-mb` of weights (`--checksum-tensors` tensors, bf16 and
  fp32): `tensor_checksums` (one launch for all on a GPU) against one copy of the same bytes on the device in the
  same run, and on a GPU the copy that hashes what it writes (`copy_with_lanes`, the direct write's pass).

    python benchmarks/bench_weight_sync.py --only checksum --threads 1
    python benchmarks/bench_weight_sync.py --only checksum --device cuda --checksum-mb 13000 --checksum-tensors 310
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from miles_hpc.models import ModelConfig, build_model, iter_hf_tensors
from miles_hpc.models.presets import preset_config
from miles_hpc.sync.codec.delta_codec import decode, encode, to_bytes, warm_kernels
from miles_hpc.sync.wire.checksum import copy_with_lanes, tensor_checksum, tensor_checksums

# Few-layer Qwen3 shapes on top of the "small" preset (its byte-level vocabulary): big enough matrices for
# realistic per-tensor statistics, small enough for CPU.
SIZES: dict[str, dict[str, int]] = {
    "small": {},
    "25m": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 4,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
    "100m": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },  # bench_train.py's ~1.1B shapes, byte vocabulary
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
    },  # Qwen2.5-1.5B's layer shapes, byte vocabulary (1.3B)
    "7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },  # Qwen2.5-7B's layer shapes, byte vocabulary (6.5B params)
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- delta section
def grpo_step(model: torch.nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, g: torch.Generator) -> None:
    """One policy-gradient step: groups of `--group` completions per random prompt, random rewards."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    n = args.prompts * args.group
    prompt = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=g).repeat_interleave(args.group, 0)
    completion = torch.randint(0, vocab, (n, args.seq - args.prompt_len), generator=g)
    ids = torch.cat([prompt, completion], 1).to(device)
    reward = torch.rand(args.prompts, args.group, generator=g)
    adv = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)).reshape(n, 1).to(device)
    logits = model(ids)[:, args.prompt_len - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, args.prompt_len :, None]).squeeze(-1)
    loss = -(adv * logp).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _keys16(bits: torch.Tensor) -> torch.Tensor:
    u = bits.long() & 0xFFFF
    return u ^ (0x8000 + (u >> 15) * 0x7FFF)


def entropy_bits(old: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """(order-0, exponent-of-old-conditioned) empirical entropy in bits of the bf16 update old -> new.

    Order-0: N H(K/N) for the change mask plus K times the entropy of the nonzero ulp differences. Conditioned:
    the same per exponent field of `old`, summed. Independent of the codec's own code.
    """
    ob, nb = old.reshape(-1).view(torch.int16), new.reshape(-1).view(torch.int16)  # on their device (a GPU sorts)
    d = _keys16(nb) - _keys16(ob)
    exp = (ob.long() >> 7) & 0xFF
    changed = d != 0

    def mask_bits(n: torch.Tensor, k: torch.Tensor) -> float:
        p = (k / n.clamp(min=1)).clamp(1e-300, 1 - 1e-16)
        hb = torch.where((k > 0) & (k < n), -(p * torch.log2(p) + (1 - p) * torch.log2(1 - p)), 0.0)
        return float((n * hb).sum())

    def value_bits(groups: torch.Tensor, values: torch.Tensor) -> float:
        _, cnt = torch.unique(groups * (1 << 18) + values + (1 << 17), return_counts=True)
        _, gcnt = torch.unique(groups, return_counts=True)
        cnt, gcnt = cnt.double(), gcnt.double()
        return float((gcnt * torch.log2(gcnt)).sum() - (cnt * torch.log2(cnt)).sum())

    n_all, k_all = torch.tensor([float(d.numel())], device=d.device), changed.sum().double()[None]
    zeros = torch.zeros(int(changed.sum()), dtype=torch.long, device=d.device)
    iid = mask_bits(n_all, k_all) + value_bits(zeros, d[changed])
    n_e, k_e = torch.bincount(exp, minlength=256).double(), torch.bincount(exp[changed], minlength=256).double()
    ctx = mask_bits(n_e, k_e) + value_bits(exp[changed], d[changed])
    return iid, ctx


def bench_delta(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    device = torch.device(args.device)
    hf = preset_config("qwen3", "small") | SIZES[args.size]
    cfg = ModelConfig.from_hf_dict(hf)
    try:
        import zstandard
    except ImportError:
        zstandard = None
    warm = torch.randn(1 << 16, device=device).bfloat16()
    decode(warm, encode(warm, warm + 1e-3))  # first-call costs (CUDA context, kernels) out of the timings
    warm_kernels(device)
    for lr in (float(x) for x in args.lrs.split(",")):
        torch.manual_seed(args.seed)
        model = build_model(cfg, dtype=torch.float32, device=device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
        g = torch.Generator().manual_seed(args.seed)
        prev = {name: t.detach().to(torch.bfloat16) for name, t in iter_hf_tensors(model)}
        tot: Counter[str] = Counter()
        kinds: Counter[str] = Counter()
        per_step: list[tuple[float, float]] = []
        for _ in range(args.steps):
            grpo_step(model, opt, args, g)
            step: Counter[str] = Counter()
            news = [(name, t.detach().to(torch.bfloat16)) for name, t in iter_hf_tensors(model)]
            for group in groups(news, args.group_mb << 20):
                old_parts, new_parts = [prev[name] for name, _ in group], [t for _, t in group]
                # What a publish codes: the group's tensors back to back (the concatenation is timed as coding).
                (old, new), t_cat = timed(device, lambda: (flat_cat(old_parts), flat_cat(new_parts)))
                _, t_ck = timed(device, tensor_checksum, new)
                payload, t_enc = timed(device, encode, old, new)
                out, t_dec = timed(device, decode, old, payload)
                if not torch.equal(out.view(torch.int16), new.view(torch.int16)):
                    raise AssertionError(f"{[n for n, _ in group]}: decode is not bit-exact")
                kinds[payload.kind] += 1
                step.update(
                    full_bytes=new.numel() * 2,
                    delta_bytes=len(to_bytes(payload)),
                    t_enc=t_enc + t_cat,
                    t_dec=t_dec,
                    t_ck=t_ck,
                    groups=1,
                )
                for (name, t), o in zip(group, old_parts):
                    iid, ctx = entropy_bits(o, t)
                    step.update(
                        numel=t.numel(),
                        iid_bits=iid,
                        ctx_bits=ctx,
                        changed=int((o.view(torch.int16) != t.view(torch.int16)).sum()),
                    )
                    if zstandard is not None:
                        xor = (o.view(torch.int16) ^ t.view(torch.int16)).cpu().numpy().tobytes()
                        step["zstd_bytes"] += len(zstandard.ZstdCompressor(level=args.zstd_level).compress(xor))
                    prev[name] = t
            per_step.append((step["changed"] / step["numel"], step["delta_bytes"] / step["full_bytes"]))
            tot.update(step)
        full = tot["full_bytes"]
        t_codec = (tot["t_enc"] - tot["t_ck"]) + (tot["t_dec"] - tot["t_ck"])  # each side computes one checksum
        link = args.link_gbps * 1e9
        line = {
            "bench": "weight_sync",
            "section": "delta",
            "device": _device_name(device),
            "model": f"qwen3-{args.size}",
            "params": sum(p.numel() for p in model.parameters()),
            "lr": lr,
            "steps": args.steps,
            "tensors_per_step": len(prev),
            "group_mb": args.group_mb,
            "groups_per_step": tot["groups"] // args.steps,
            "kinds": dict(kinds),
            "changed_frac": round(tot["changed"] / tot["numel"], 5),
            "delta_ratio": round(tot["delta_bytes"] / full, 5),
            "xor_zstd_ratio": round(tot["zstd_bytes"] / full, 5) if zstandard is not None else None,
            "entropy_iid_ratio": round(tot["iid_bits"] / 8 / full, 5),
            "entropy_ctx_ratio": round(tot["ctx_bits"] / 8 / full, 5),
            "per_step_changed_frac": [round(c, 5) for c, _ in per_step],
            "per_step_delta_ratio": [round(r, 5) for _, r in per_step],
            "encode_gbps": round(full / tot["t_enc"] / 1e9, 4),
            "decode_gbps": round(full / tot["t_dec"] / 1e9, 4),
            "checksum_gbps": round(full / tot["t_ck"] / 1e9, 4),
            "encode_gbps_excl_checksum": round(full / max(tot["t_enc"] - tot["t_ck"], 1e-9) / 1e9, 4),
            "decode_gbps_excl_checksum": round(full / max(tot["t_dec"] - tot["t_ck"], 1e-9) / 1e9, 4),
            "link_gbps": args.link_gbps,
            "full_send_s": round(full / link, 6),
            "delta_send_s": round(t_codec + tot["delta_bytes"] / link, 6),
            "delta_faster_than_link": t_codec + tot["delta_bytes"] / link < full / link,
        }
        yield line


def bench_codec(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The codec alone on one large synthetic bf16 tensor: weights spread over many exponents (lognormal scale),
    every value moved by +-lr in fp32 then rounded (an AdamW-like sign update), per `--classes` bound."""
    device = torch.device(args.device)
    n = (args.codec_mb << 20) // 2
    g = torch.Generator(device=device).manual_seed(args.seed)
    w = torch.randn(n, device=device, generator=g) * torch.exp(0.5 * torch.randn(n, device=device, generator=g)) * 0.02
    old, new = w.bfloat16(), (w + 1e-6 * torch.randn(n, device=device, generator=g).sign()).bfloat16()
    del w
    warm_kernels(device, max_classes=max(int(c) for c in args.classes.split(",")))
    for mc in (int(c) for c in args.classes.split(",")):
        payload = encode(old, new, max_classes=mc)
        decode(old, payload)  # untimed first call
        enc = min(timed(device, lambda: encode(old, new, max_classes=mc))[1] for _ in range(args.reps))
        dec = min(timed(device, decode, old, payload)[1] for _ in range(args.reps))
        gb = n * 2 / 1e9
        yield {
            "bench": "weight_sync",
            "section": "codec",
            "device": _device_name(device),
            "values": n,
            "max_classes": mc,
            "classes": payload.counts[0] if payload.kind == "delta" else None,
            "changed_frac": round(float((old.view(torch.int16) != new.view(torch.int16)).float().mean()), 5),
            "delta_ratio": round(len(to_bytes(payload)) / (n * 2), 5),
            "encode_s": round(enc, 5),
            "decode_s": round(dec, 5),
            "encode_gbps": round(gb / enc, 3),
            "decode_gbps": round(gb / dec, 3),
            "both_gbps": round(gb / (enc + dec), 3),
            "link_gbps": args.link_gbps,
            "faster_than_link": enc + dec + len(to_bytes(payload)) / (args.link_gbps * 1e9) < gb / args.link_gbps,
            "reps": args.reps,
        }


def bench_checksum(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Checksums of many tensors vs one device copy of the same bytes (module docstring)."""
    for dtype in (torch.bfloat16, torch.float32):
        yield _checksum_row(args, torch.device(args.device), dtype)  # buffers freed between dtypes


def _checksum_row(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    per = (args.checksum_mb << 20) // args.checksum_tensors // dtype.itemsize
    named = [(f"t{i}", torch.randn(per, device=device, dtype=dtype)) for i in range(args.checksum_tensors)]
    nbytes = per * dtype.itemsize * len(named)
    src, dst = (torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2))
    dsts = [torch.empty_like(t) for _, t in named]
    runs: dict[str, Callable[[], Any]] = {
        "copy": lambda: dst.copy_(src),  # the reference: one copy of the same bytes
        "copy_per_tensor": lambda: [d.copy_(t) for d, (_, t) in zip(dsts, named)],
        "checksums": lambda: tensor_checksums(named),
    }
    if device.type == "cuda":
        runs["copy_and_checksums"] = lambda: copy_with_lanes([(t, d) for d, (_, t) in zip(dsts, named)]).cpu()
    times = {}
    for key, fn in runs.items():
        fn()  # untimed first call (compiles kernels, builds tables)
        times[key] = min(timed(device, fn)[1] for _ in range(args.reps))
    return {
        "bench": "weight_sync",
        "section": "checksum",
        "device": _device_name(device),
        "dtype": str(dtype),
        "tensors": len(named),
        "bytes": nbytes,
        "reps": args.reps,
        **{f"{k}_s": round(v, 5) for k, v in times.items()},
        **{f"{k}_gbps": round(nbytes / v / 1e9, 2) for k, v in times.items()},
    }


def groups(named: list[tuple[str, torch.Tensor]], group_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors in groups of at most `group_bytes` (a bigger tensor alone; 0: one tensor per group)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > group_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield cur


def flat_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts])


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()} threads"


def bench_transfer(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from sync_transfer import bench_transfer as run  # benchmarks/ is on sys.path when this file runs

    yield from run(args, SIZES)


SECTIONS: dict[str, Callable[[argparse.Namespace], Iterator[dict[str, Any]]]] = {
    "delta": bench_delta,
    "codec": bench_codec,
    "transfer": bench_transfer,
    "checksum": bench_checksum,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--only", choices=sorted(SECTIONS), help="run this one section (overrides --sections)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    d = ap.add_argument_group("delta")
    d.add_argument("--size", choices=sorted(SIZES), default="25m", help="model shape (Qwen3, byte vocabulary)")
    d.add_argument("--lrs", default="1e-6,3e-6,1e-5", help="comma-separated AdamW learning rates")
    d.add_argument("--steps", type=int, default=3, help="RL steps per learning rate")
    d.add_argument("--prompts", type=int, default=2)
    d.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO group)")
    d.add_argument("--seq", type=int, default=128, help="tokens per sequence, prompt included")
    d.add_argument("--prompt-len", type=int, default=32)
    d.add_argument("--zstd-level", type=int, default=3)
    d.add_argument(
        "--group-mb",
        type=int,
        default=256,
        help="code consecutive tensors together, up to this many MB per payload (0: each tensor alone)",
    )
    d.add_argument("--codec-mb", type=int, default=64, help="codec section: MB of the synthetic bf16 tensor")
    d.add_argument("--classes", default="8,16", help="codec section: comma-separated max_classes to compare")
    d.add_argument("--link-gbps", type=float, default=25.0, help="link speed (GB/s) the delta send competes with")
    c = ap.add_argument_group("checksum")
    c.add_argument("--checksum-mb", type=int, default=256, help="MB of weights per dtype")
    c.add_argument("--checksum-tensors", type=int, default=16, help="how many tensors they are split into")
    t = ap.add_argument_group("transfer")
    t.add_argument("--transfer-size", choices=sorted(SIZES), default="100m", help="model shape published")
    t.add_argument("--engines", default="1,2", help="comma-separated engine counts")
    t.add_argument("--strategies", default="broadcast,p2p,colocated,delta", help="comma-separated strategies to time")
    t.add_argument("--trainer-ranks", type=int, default=2, help="p2p: trainer ranks (threads of this process)")
    t.add_argument("--reps", type=int, default=3, help="timed publishes per setting (median reported)")
    t.add_argument("--bucket-mb", type=int, default=512, help="broadcast bucket size")
    t.add_argument("--first-launch-mb", type=int, help="colocated direct writes: MiB of the first launch")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [args.only] if args.only else [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    for name in names:
        for line in SECTIONS[name](args):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
