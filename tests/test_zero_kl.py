"""Zero-KL mode on the CPU (issue 12): an engine with `batch_invariant` and an `FSDPTrainer(zero_kl=True)` give
bit-identical log-probs for the same tokens, whatever the engine's batch sizes, chunking and prefix-cache hits.
A control without the mode shows a nonzero difference on the same requests, so the test can fail."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_hpc.config import AlgoConfig, ConfigError, RunConfig, TrainConfig, config_from_dict
from miles_hpc.data.sample import token_hash
from miles_hpc.engine.config import EngineConfig
from miles_hpc.engine.core import Engine
from miles_hpc.engine.types import GenerateRequest, GenerateResult, SamplingParams
from miles_hpc.models import ModelConfig, build_model, load_pretrained, save_pretrained
from miles_hpc.models.batch_invariant import make_batch_invariant, packed_attention
from miles_hpc.models.presets import init_model, preset_config
from miles_hpc.train import dist as tdist
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.fsdp import FSDPTrainer

PROMPT_LENS = (3, 9, 17, 30, 5, 44)
NEW_TOKENS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    """A gloo world of one process, at most 4 CPU threads (16 break the tiled GEMMs, see
    test_tiled_linear_at_16_threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 4))
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    tdist.init_trainer_world(tdist.world_from_env(env, device="cpu"))
    yield
    tdist.teardown()
    torch.set_num_threads(threads)


def make_ckpt(out: Path, arch: str, size: str = "tiny") -> Path:
    """A random checkpoint with a sharp init (std 0.2, untied head): sampled text depends on the whole context."""
    init_model(arch, size, out, seed=0)
    hf = preset_config(arch, size)
    hf.update(initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    save_pretrained(build_model(ModelConfig.from_hf_dict(hf)), out)
    return out


def request(rid: str, prompt: list[int], with_input_lps: bool = False) -> GenerateRequest:
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, sampling_seed=int(rid) + 7)
    return GenerateRequest(
        rid=rid,
        input_ids=tuple(prompt),
        sampling=sp,
        return_logprob=True,
        logprob_start_len=0 if with_input_lps else -1,
    )


def generate(ckpt: Path, batch_invariant: bool, **engine_kw: object) -> list[tuple[list[int], list[float], int]]:
    """(tokens, log-probs of tokens 1.. as the engine reports them (None where it reports none), prompt length) per
    request: round 1 in batches of 1, then 2, then 3 joining running requests, chunked prefills; round 2 continues
    each sequence of round 1 with new tokens, so its prompts hit the prefix cache."""
    cfg = EngineConfig(block_size=4, max_prefill_tokens=24, batch_invariant=batch_invariant, **engine_kw)
    engine = Engine.from_pretrained(str(ckpt), cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    results: dict[str, GenerateResult] = {}

    def submit(*reqs: GenerateRequest) -> None:
        for r in reqs:
            engine.submit(r, lambda res: results.__setitem__(res.rid, res))

    submit(request("0", prompts[0]))
    engine.step()
    engine.step()
    submit(request("1", prompts[1]), request("2", prompts[2], with_input_lps=True))
    engine.step()
    submit(*(request(str(i), prompts[i]) for i in (3, 4, 5)))
    while engine.step():
        pass
    first = [prompts[i] + results[str(i)].output_ids for i in range(len(prompts))]
    submit(*(request(str(10 + i), seq + [1, 2, 3], with_input_lps=i == 1) for i, seq in enumerate(first[:4])))
    while engine.step():
        pass
    assert sum(results[str(10 + i)].cached_tokens for i in range(4)) > 0  # the prefix cache served round 2
    out = []
    for rid, prompt in [(str(i), p) for i, p in enumerate(prompts)] + [
        (str(10 + i), s + [1, 2, 3]) for i, s in enumerate(first[:4])
    ]:
        r = results[rid]
        lps: list[float | None] = [None] * (len(prompt) - 1) + list(r.output_logprobs)
        if r.input_logprobs is not None:
            lps[: len(prompt) - 1] = r.input_logprobs[1:]
        out.append((prompt + r.output_ids, lps, len(prompt)))
    return out


def max_diff(trainer: FSDPTrainer, seqs: list[tuple[list[int], list[float], int]]) -> float:
    toks = [t for t, _, _ in seqs]
    batch = TrainBatch(
        tokens=toks,
        loss_mask=[[0] * p + [1] * (len(t) - p) for t, _, p in seqs],
        rollout_logprobs=[[0.0] * len(t) for t in toks],
        advantages=[[0.0] * len(t) for t in toks],
        token_hash=[token_hash(t) for t in toks],
    )
    got = trainer.compute_logprobs(batch)
    worst = 0.0
    for (_, lps, _), mine in zip(seqs, got):
        for a, b in zip(lps, mine[1:]):
            if a is not None:
                worst = max(worst, abs(torch.tensor(a, dtype=torch.float32).item() - b))
    return worst


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_engine_and_trainer_logprobs_are_bitwise_equal(world: None, tmp_path: Path, arch: str) -> None:
    ckpt = make_ckpt(tmp_path / "m", arch)
    seqs = generate(ckpt, batch_invariant=True)
    assert sum(lp is not None for _, lps, _ in seqs for lp in lps) > 10 * NEW_TOKENS
    # Micro-batches of several sequences (positions in the packed row vary), then one sequence per micro-batch.
    for budget in (200, 1):
        trainer = FSDPTrainer(
            ckpt, TrainConfig(max_tokens_per_microbatch=budget), AlgoConfig(), device="cpu", seed=0, zero_kl=True
        )
        assert max_diff(trainer, seqs) == 0.0


def test_control_without_the_mode_differs(world: None, tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "m", "qwen3", "small")
    trainer = FSDPTrainer(ckpt, TrainConfig(max_tokens_per_microbatch=200), AlgoConfig(), device="cpu", seed=0)
    diff = max_diff(trainer, generate(ckpt, batch_invariant=False))
    assert 0.0 < diff < 1e-3  # fp32 noise, not a bug, but not zero
    zk = FSDPTrainer(ckpt, TrainConfig(max_tokens_per_microbatch=200), AlgoConfig(), device="cpu", seed=0, zero_kl=True)
    assert max_diff(zk, generate(ckpt, batch_invariant=True)) == 0.0


def test_invariant_model_matches_plain_model_and_keeps_names(tmp_path: Path) -> None:
    ckpt = make_ckpt(tmp_path / "m", "qwen3")
    plain, inv = load_pretrained(ckpt), load_pretrained(ckpt)
    names = list(inv.state_dict())
    make_batch_invariant(inv)
    assert list(inv.state_dict()) == names
    ids = torch.randint(0, 256, (1, 40))
    cu = torch.tensor([0, 13, 40], dtype=torch.int32)
    with torch.no_grad():
        ref = plain(ids, cu_seqlens=cu)
        got = inv(ids, cu_seqlens=cu, attn_backend=packed_attention)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        # A sequence alone gives the bits it has packed with another one.
        alone = inv(ids[:, 13:], attn_backend=packed_attention)
        assert torch.equal(alone[0], got[0, 13:])
    # Gradients flow through the invariant pieces.
    inv(ids, cu_seqlens=cu, attn_backend=packed_attention).sum().backward()
    assert all(p.grad is not None for p in inv.parameters())


def test_rope_cos_sin_do_not_depend_on_the_batch(tmp_path: Path) -> None:
    model = make_batch_invariant(load_pretrained(make_ckpt(tmp_path / "m", "qwen3")))
    pos = torch.arange(300)[None]
    cos, sin = model.rotary(pos, torch.float32)
    for p in (0, 1, 17, 299):
        c1, s1 = model.rotary(torch.tensor([[p]]), torch.float32)
        assert torch.equal(c1[0, 0], cos[0, p]) and torch.equal(s1[0, 0], sin[0, p])


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_invariant_moe_model_routes_and_replays_the_same_bits(tmp_path: Path, arch: str) -> None:
    """MoE routers and experts (and DeepSeek's MLA) made invariant: the plain model's logits to fp32 noise and its
    routes exactly; a sequence alone, or 5 of its tokens, give the bits and routes it has packed with another;
    replaying its own routes changes nothing and counts every token once (tile padding left out)."""
    plain = load_pretrained(make_ckpt(tmp_path / "m", arch))
    inv = make_batch_invariant(load_pretrained(tmp_path / "m"))
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    with torch.no_grad():
        ref, ref_routes = plain(ids, cu_seqlens=cu, return_routed_experts=True)
        got, routes = inv(ids, cu_seqlens=cu, attn_backend=packed_attention, return_routed_experts=True)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(routes, ref_routes)
        alone, alone_routes = inv(ids[:, 30:], attn_backend=packed_attention, return_routed_experts=True)
        assert torch.equal(alone[0], got[0, 30:]) and torch.equal(alone_routes[0], routes[0, 30:])
        assert torch.equal(inv(ids[:, 30:35], attn_backend=packed_attention)[0], got[0, 30:35])
        replayed = inv(ids, cu_seqlens=cu, attn_backend=packed_attention, routing_replay=routes)
        assert torch.equal(replayed, got)
        layers = inv.num_moe_layers
        assert inv.replay_stats().tolist() == [70 * layers, 70 * layers, 70 * layers]
    inv(ids, cu_seqlens=cu, attn_backend=packed_attention, routing_replay=routes).sum().backward()
    assert all(p.grad is not None for p in inv.parameters() if p.requires_grad)


def test_dynamic_rope_past_its_native_length_is_refused() -> None:
    hf = preset_config("qwen3", "tiny")
    hf.update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=32)
    model = make_batch_invariant(build_model(ModelConfig.from_hf_dict(hf)))
    with torch.no_grad():
        model(torch.zeros(1, 32, dtype=torch.long), attn_backend=packed_attention)  # within it: static frequencies
        with pytest.raises(ValueError, match="max_position_embeddings=32"):
            model(torch.zeros(1, 33, dtype=torch.long), attn_backend=packed_attention)


@pytest.mark.parametrize(
    "overrides,key",
    [
        ({"lora": {"rank": 8}}, "lora.rank"),
        ({"train": {"backend": "megatron", "device": "cuda"}}, "train.backend"),
        ({"rollout": {"backend": "sglang"}}, "rollout.backend"),
        ({"model": {"dtype": "bfloat16"}}, "model.dtype"),
        ({"train": {"device": "cuda"}, "rollout": {"device": "cuda"}}, "model.dtype"),  # mixed precision: bf16
        (
            {"train": {"device": "cuda", "compile": True, "mixed_precision": False}, "rollout": {"device": "cuda"}},
            "train.compile",
        ),
        ({"rollout": {"device": "cuda"}}, "rollout.device"),
    ],
)
def test_config_refusals_name_the_key(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        config_from_dict({"zero_kl": True, **overrides})


def test_config_accepts_matching_dtypes() -> None:
    assert config_from_dict({"zero_kl": True}).zero_kl
    for arch in ("qwen3_moe", "deepseek_v3", "glm4_moe"):
        assert config_from_dict({"zero_kl": True, "model": {"init_arch": arch}}).zero_kl
    cfg = config_from_dict(
        {"zero_kl": True, "model": {"dtype": "bfloat16"}, "train": {"device": "cuda"}, "rollout": {"device": "cuda"}}
    )
    assert isinstance(cfg, RunConfig) and cfg.zero_kl


@pytest.mark.xfail(
    strict=False,
    reason="known gap (docs/lora.md, Zero-KL mode): with 16 intra-op threads torch's CPU "
    "GEMM of a [32, 768] tile gives a row bits that depend on its position in the tile",
)
def test_tiled_linear_at_16_threads() -> None:
    """Pins the gap found on a 16-core host: `invariant.linear` with in_features 768 (32-row tiles) is invariant at
    1-8 threads, not at 16 (the thread count, not the core count, decides: it reproduces on 2 cores)."""
    from miles_hpc.models import invariant as inv

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(100, 768, generator=g), torch.randn(256, 768, generator=g) * 0.05
    threads = torch.get_num_threads()
    torch.set_num_threads(16)
    try:
        ref = inv.linear(x, w)
        assert all(torch.equal(inv.linear(x[k : k + n], w), ref[k : k + n]) for k, n in ((5, 20), (1, 64), (37, 1)))
    finally:
        torch.set_num_threads(threads)
