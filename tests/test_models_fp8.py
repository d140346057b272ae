"""FP8 block-quantized HF checkpoints (DeepSeek-V3 / Kimi-K2 / GLM-5 releases) as `model.path`: written here with the
real layout (float8_e4m3fn weights, float32 `weight_scale_inv` = block amax / 448 over a ceil grid, ragged edges),
loaded dequantized exactly as the reference does, by `load_pretrained` and the engine's reload; every refusal names
what it refuses; transformers 5.24 reads the same files to the same logits."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_deepseek import deepseek
from test_models_support import input_ids, max_diff

from miles_hpc.models import CausalLM, fp8, iter_hf_tensors, load_pretrained, read_config, save_pretrained

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
CASE = "q-lora-interleaved-yarn"  # q_lora 12, kv_a out 20, kv_b out 56, o_proj in 24: ragged for blocks 8 and 16
Ref = dict[str, torch.Tensor]


# ---------------------------------------------------------------- the reference: our own writer of the real layout
def _quantized(name: str, t: torch.Tensor) -> bool:
    """Linear weights are quantized; embeddings, lm_head, router gates, norms and biases stay plain (as released)."""
    return t.ndim == 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight"))


def quantize(w: torch.Tensor, block: tuple[int, int], pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bo x bi block (ragged at the edges): dequant factor s = amax / 448 (a power of two above it with
    `pow2`, as UE8M0 releases), fp8 = w / s. Returns (fp8 weight, s), the checkpoint's `weight_scale_inv`."""
    (rows, cols), (bo, bi) = w.shape, block
    gr, gc = math.ceil(rows / bo), math.ceil(cols / bi)
    padded = torch.zeros(gr * bo, gc * bi)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(gr, bo, gc, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * bo, gc * bi)[:rows, :cols].contiguous(), s


def dequant_ref(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: each fp8 value times its block's factor, in float32 (scales expanded over the full grid)."""
    rows, cols = q.shape
    full = s.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return q.float() * full[:rows, :cols]


def write_fp8(
    model: CausalLM,
    out: Path,
    block: tuple[int, int],
    *,
    shards: int = 1,
    scales: str = "float32",
    extra: dict[str, torch.Tensor] | None = None,
) -> Ref:
    """An FP8 checkpoint of `model`; returns the reference value (float32) of each HF tensor. Sharded: tensor i in
    shard i % shards and its scale in the next one (a scale need not share its weight's shard). `scales`: float32,
    float32 powers of two with scale_fmt ue8m0 (DeepSeek-V3.1), or e8m0 bytes (float8_e8m0fnu)."""
    save_pretrained(model, out)
    (out / "model.safetensors").unlink()
    pow2 = scales != "float32"
    stored: list[tuple[str, torch.Tensor, int]] = []
    ref: Ref = {}
    for i, (name, t) in enumerate([*iter_hf_tensors(model), *(extra or {}).items()]):
        if not _quantized(name, t):
            stored.append((name, t.detach().clone(), i % shards))
            ref[name] = t.detach().float()
            continue
        q, s = quantize(t.detach(), block, pow2)
        ref[name] = dequant_ref(q, s, block)
        stored += [(name, q, i % shards), (name + "_scale_inv", _stored_scale(s, scales), (i + 1) % shards)]
    _write_shards(out, stored, shards)
    cfg = json.loads((out / "config.json").read_text())
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    qc["weight_block_size"] = list(block)
    if pow2:
        qc["scale_fmt"] = "ue8m0"
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}, indent=2))
    return ref


def _stored_scale(s: torch.Tensor, scales: str) -> torch.Tensor:
    return s.to(torch.float8_e8m0fnu) if scales == "e8m0" else s.float()


def _write_shards(out: Path, stored: list[tuple[str, torch.Tensor, int]], shards: int) -> None:
    if shards == 1:
        save_file({n: t for n, t, _ in stored}, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: t for n, t, j in stored if j == k}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n, _, j in stored if j == k})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """Our tiny DeepSeek-V3 model (MLA with compressed q, MoE with shared experts, a dense first layer), fp32."""
    path = tmp_path_factory.mktemp("plain")
    hf = deepseek(CASE)
    hf.config.num_nextn_predict_layers = 0  # no multi-token-prediction layers (transformers writes 1 by default)
    hf.save_pretrained(path)
    return load_pretrained(path)


def _ragged(model: CausalLM, block: tuple[int, int]) -> bool:
    return any(_quantized(n, t) and (t.shape[0] % block[0] or t.shape[1] % block[1]) for n, t in iter_hf_tensors(model))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- loading
@pytest.mark.parametrize(
    ("block", "shards", "scales"),
    [
        ((16, 16), 1, "float32"),
        ((16, 8), 3, "float32"),
        ((128, 128), 1, "float32"),
        ((8, 8), 2, "e8m0"),
        ((8, 16), 1, "pow2"),
    ],
)
def test_loads_dequantized_exactly_and_close_to_the_unquantized_model(
    plain: CausalLM, tmp_path: Path, block: tuple[int, int], shards: int, scales: str
) -> None:
    assert _ragged(plain, block)  # the last row / column blocks are partial somewhere
    ref = write_fp8(plain, tmp_path, block, shards=shards, scales=scales)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shards > 1)
    ours = load_pretrained(tmp_path)
    assert next(ours.parameters()).dtype == torch.float32
    loaded = dict(iter_hf_tensors(ours))
    assert loaded.keys() == ref.keys()
    for name, t in loaded.items():
        assert torch.equal(t, ref[name]), name

    # Closeness to the unquantized model, bounded by the quantization error itself: eps is the largest relative
    # (Frobenius) error of a quantized weight; at first order each quantized matmul on a path perturbs its output by
    # at most about eps and the perturbations add up, and a path crosses at most 5 per layer (q_a, q_b or kv_a, kv_b,
    # then o_proj; gate/up, then down). The routes are replayed from the unquantized model: a flipped top-k choice is
    # a jump, not a small error.
    orig = dict(iter_hf_tensors(plain))
    eps = max(_relative(t, orig[n]) for n, t in loaded.items() if _quantized(n, orig[n]))
    assert 0 < eps < 2**-4  # e4m3 keeps 3 mantissa bits: at most half an ulp, 2^-4, relative per normal value
    ids = input_ids(seq=13)
    with torch.no_grad():
        want, routes = plain(ids, return_routed_experts=True)
        got = ours(ids, routing_replay=routes)
    err = _relative(got, want)
    assert 0 < err <= 5 * ours.config.num_hidden_layers * eps, (err, eps)


def test_dequantizes_to_the_model_dtype_and_saves_plain(plain: CausalLM, tmp_path: Path) -> None:
    ref = write_fp8(plain, tmp_path / "fp8", (16, 16))
    ours = load_pretrained(tmp_path / "fp8", dtype=torch.bfloat16)
    for name, t in iter_hf_tensors(ours):
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name  # fp32 math, one cast

    save_pretrained(ours, tmp_path / "saved")
    cfg = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "bfloat16"
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert not any(fp8.is_scale(n) for n in saved) and {t.dtype for t in saved.values()} == {torch.bfloat16}
    again = load_pretrained(tmp_path / "saved")
    assert all(torch.equal(t, ref[n].to(torch.bfloat16)) for n, t in iter_hf_tensors(again))


def test_engine_reload_from_disk_dequantizes(plain: CausalLM, tmp_path: Path) -> None:
    from miles_hpc.engine.validate import RequestError
    from miles_hpc.engine.weights import apply_named, iter_checkpoint

    ref = write_fp8(plain, tmp_path, (8, 8), shards=2)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    streamed = dict(iter_checkpoint(model, tmp_path))
    assert streamed.keys() == ref.keys() and all(torch.equal(t, ref[n].to(t.dtype)) for n, t in streamed.items())
    assert {t.dtype for n, t in streamed.items() if _quantized(n, t)} == {torch.bfloat16}
    apply_named(model, streamed.items())
    assert all(torch.equal(t, ref[n].to(torch.bfloat16)) for n, t in iter_hf_tensors(model))

    _drop(tmp_path, "model.layers.1.self_attn.o_proj.weight_scale_inv")
    with pytest.raises(RequestError, match=r"model_path: .*fp8 weight 'model.layers.1.self_attn.o_proj.weight' has no"):
        iter_checkpoint(model, tmp_path)


def test_multi_token_prediction_layers_are_ignored_with_their_scales(plain: CausalLM, tmp_path: Path) -> None:
    n = plain.config.num_hidden_layers
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.randn(16, 24)}  # a release's MTP layer, quantized as well
    ref = write_fp8(plain, tmp_path, (16, 16), extra=mtp)
    assert f"model.layers.{n}.eh_proj.weight_scale_inv" in load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(t, ref[name]) for name, t in iter_hf_tensors(load_pretrained(tmp_path)))


def test_transformers_reads_the_same_checkpoint_to_the_same_logits(plain: CausalLM, tmp_path: Path) -> None:
    """transformers 5.24 on CPU dequantizes FP8 checkpoints on load (FineGrainedFP8's dequantize mode, switched on
    without a GPU). It derives the block size from the scale grid (rows / grid rows), which is right only where every
    dimension is a multiple of the block (or fits in one block): with ragged blocks (e.g. [16, 16] on a 24-wide
    o_proj) it silently scales with the wrong blocks, so only those blocks are compared with it here."""
    from test_models_support import hf_load

    ids = input_ids(seq=13)
    for block in ((4, 4), (128, 128)):
        path = tmp_path / str(block[0])
        write_fp8(plain, path, block, shards=2)
        ours, hf = load_pretrained(path), hf_load(path)
        mine = dict(ours.named_parameters())
        for name, t in hf.named_parameters():  # fused experts share transformers' in-memory names and layout
            assert torch.equal(mine[name], t), name
        with torch.no_grad():
            assert max_diff(ours(ids), hf(ids).logits) < 1e-4


# ---------------------------------------------------------------- refusals
def _drop(path: Path, name: str) -> None:
    index = path / "model.safetensors.index.json"
    file = path / (json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors")
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    if index.exists():
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data))


def _edit(path: Path, name: str, value: torch.Tensor) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = value
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _set_config(path: Path, **changes: Any) -> None:
    cfg = {**json.loads((path / "config.json").read_text()), **changes}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))


def test_missing_scale_names_weight_scale_and_file(plain: CausalLM, tmp_path: Path) -> None:
    write_fp8(plain, tmp_path, (16, 16), shards=2)
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    _drop(tmp_path, name + "_scale_inv")
    with pytest.raises(ValueError, match=rf"model-0000\d-of-00002.safetensors: fp8 weight '{name}' has no scale"):
        load_pretrained(tmp_path)


def test_scale_shape_mismatch_names_scale_and_file(plain: CausalLM, tmp_path: Path) -> None:
    write_fp8(plain, tmp_path, (16, 16))
    name = "model.layers.0.self_attn.kv_b_proj.weight"  # [56, 16]: a grid of [4, 1]
    _edit(tmp_path, name + "_scale_inv", torch.ones(3, 1))
    with pytest.raises(ValueError, match=rf"model.safetensors: scale '{name}_scale_inv' has shape \(3, 1\), expected"):
        load_pretrained(tmp_path)


def test_scale_without_its_fp8_weight_is_refused(plain: CausalLM, tmp_path: Path) -> None:
    write_fp8(plain, tmp_path, (16, 16))
    _edit(tmp_path, "model.layers.0.self_attn.nowhere.weight_scale_inv", torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"scale 'model.layers.0.self_attn.nowhere.weight_scale_inv' has no weight"):
        load_pretrained(tmp_path)
    _drop(tmp_path, "model.layers.0.self_attn.nowhere.weight_scale_inv")
    _edit(tmp_path, "model.norm.weight_scale_inv", torch.ones(1))  # a plain (bf16/fp32) tensor with a scale
    with pytest.raises(ValueError, match=r"scale 'model.norm.weight_scale_inv' belongs to 'model.norm.weight', which"):
        load_pretrained(tmp_path)


def test_fp8_tensor_without_quantization_config_is_refused(plain: CausalLM, tmp_path: Path) -> None:
    write_fp8(plain, tmp_path, (16, 16))
    _set_config(tmp_path, quantization_config=None)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    plain_names = {n: t for n, t in tensors.items() if not fp8.is_scale(n)}
    save_file(plain_names, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor '[\w.]+' is stored as F8_E4M3 but .* no quantization_config"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("qc", "field"),
    [
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quant_method = 'compressed-tensors'"),
        ({"quant_method": "gptq", "bits": 4}, "quant_method = 'gptq'"),
        ({"quant_method": "awq", "bits": 4}, "quant_method = 'awq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method = 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size is missing: per-tensor"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size = \[128\]"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt = 'e5m2'"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [8, 8]}, "activation_scheme"),
    ],
)
def test_unsupported_quantization_is_refused_before_loading(
    plain: CausalLM, tmp_path: Path, qc: dict[str, Any], field: str
) -> None:
    save_pretrained(plain, tmp_path)
    _set_config(tmp_path, quantization_config=qc)
    for load in (read_config, load_pretrained):
        with pytest.raises(
            ValueError, match=rf"config.json: quantization_config.{field}.*supported: quant_method 'fp8'"
        ):
            load(tmp_path)


def test_dequantize_checks_the_grid_and_handles_leading_dims() -> None:
    spec = fp8.Fp8Quantization(block=(4, 8))
    w = torch.randn(2, 10, 12)  # fused experts [E, out, in]: a grid of [2, 3, 2], ragged both ways
    parts = [quantize(w[e], spec.block) for e in range(2)]
    q, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    got = fp8.dequantize(q, s, spec, torch.float32, name="x.gate_up_proj", file="f.safetensors")
    assert torch.equal(got, torch.stack([dequant_ref(*p, spec.block) for p in parts]))
    with pytest.raises(ValueError, match=r"f.safetensors: scale 'x.gate_up_proj_scale_inv' has shape \(2, 2, 2\)"):
        fp8.dequantize(q, s[:, :2], spec, torch.float32, name="x.gate_up_proj", file="f.safetensors")
    assert fp8.scale_shape((576, 7168), (128, 128)) == (5, 56)  # DeepSeek-V3's kv_a_proj_with_mqa
    assert fp8.is_scale("a.weight_scale_inv") and not fp8.is_scale("a.weight")
    assert fp8.weight_name(fp8.scale_name("a.weight")) == "a.weight"
    cfg = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "ignored_layers": ["g"]}}
    assert fp8.parse_quantization(cfg) == fp8.Fp8Quantization((128, 128), "float", ("g",))
    assert fp8.parse_quantization({}) is None
