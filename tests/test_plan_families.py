"""`miles-hpc plan` on the families with their own modules (DeepSeek-V4, Inkling: families.FAMILY_MODULES): the
activations the planner measures on the meta device (planner/measure.py) are what a real CPU forward of the tiny
model keeps, byte for byte, as tests/test_plan_estimate.py checks the other families; a checkpointed layer's input
is the tensor the layer is handed; the rollout cache is the decode state the engine's backbones really hold
(`new_state`, models/dsv4_state.py, inkling_state.py), for every length, however the tokens come.

Inkling's attention calls SDPA itself with a relative-logit mask that needs a gradient: on CPU that falls back to
the math kernel (float32 [H, L, L] probabilities), which CUDA's memory-efficient kernel, the one the planner
assumes, does not keep. The reference forward here swaps in CPU's flash kernel (real values) keeping what CUDA's
kernel keeps (measure._MaskedKeeps' docstring, as seen on an H100). DeepSeek-V4 computes its attention eagerly: no
stand-in anywhere.
"""

from __future__ import annotations

import weakref
from typing import Any
from unittest import mock

import pytest
import torch

from miles_hpc.models import ModelConfig, build_model, inkling_attention
from miles_hpc.models.dsv4_state import state_bytes as dsv4_state_bytes
from miles_hpc.models.inkling_state import state_bytes as inkling_state_bytes
from miles_hpc.models.presets import MODULE_ARCHS, preset_config
from miles_hpc.planner.accounting import activations, kv_bytes_per_token, model_config
from miles_hpc.planner.estimate import Cluster, TrainBatch, estimate
from miles_hpc.planner.measure import family_state, recurrent_state_bytes
from miles_hpc.train.logprobs import LogProbEntropy

STATE_BYTES = {"deepseek_v4": dsv4_state_bytes, "inkling_text": inkling_state_bytes}


class _CudaKeeps(torch.autograd.Function):
    """CPU's flash kernel for the values; saved: what CUDA's memory-efficient kernel keeps (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> Any:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=mask.detach(), scale=scale
        )
        length, keys = q.shape[2], mask.shape[-1]
        lse = torch.nn.functional.pad(lse, (0, -length % 32))
        if keys % 8:
            mask = torch.nn.functional.pad(mask, (0, -keys % 8))
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out


class _Functional:
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, attn_mask: Any, scale: float) -> Any:
        return _CudaKeeps.apply(q, k, v, attn_mask, scale)


def _tiny(arch: str, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, Any]:
    cfg = preset_config(arch, "tiny")
    torch.manual_seed(0)
    return cfg, build_model(ModelConfig.from_hf_dict(cfg), dtype=dtype)


def _saved_bytes(arch: str, seq_len: int, micro_batch: int, layer_inputs: dict[int, int] | None = None) -> int:
    """What autograd holds after the trainer's kind of forward (packed sequences, then the log-prob kernel with
    entropy): each live storage once, parameters excluded. `layer_inputs` receives each layer input's storage."""
    cfg, model = _tiny(arch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    if layer_inputs is not None:
        for layer in model.model.layers:
            layer.register_forward_pre_hook(
                lambda _, args: layer_inputs.__setitem__(
                    args[0].untyped_storage().data_ptr(), args[0].untyped_storage().nbytes()
                )
            )
    saved: list[weakref.ref[torch.Tensor]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(weakref.ref(t))
        return t

    width = cfg.get("unpadded_vocab_size") or cfg["vocab_size"]
    ids = torch.randint(0, width, (1, seq_len * micro_batch))
    cu = torch.arange(micro_batch + 1, dtype=torch.int32) * seq_len
    swap = mock.patch.object(inkling_attention, "F", _Functional())
    with swap, torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits = model(ids, cu_seqlens=cu)
        out = LogProbEntropy.apply(logits.flatten(0, 1), torch.cat([ids[0, 1:], ids[0, :1]]), True)
    live = {s.data_ptr(): s.nbytes() for r in saved if (t := r()) is not None for s in [t.untyped_storage()]}
    del out
    return sum(n for ptr, n in live.items() if ptr not in params)


@pytest.mark.parametrize("arch", MODULE_ARCHS)
def test_activations_are_what_autograd_saves(arch: str) -> None:
    """Sequences shorter and longer than the tiny presets' windows (16) and compression blocks (4, 16), one or
    several packed, a key count that is not a multiple of 8 (Inkling's padded mask)."""
    mc = model_config(preset_config(arch, "tiny"))
    for seq_len, micro_batch in ((32, 3), (48, 1), (20, 2), (7, 1)):
        want = activations(mc, seq_len=seq_len, micro_batch=micro_batch)
        assert _saved_bytes(arch, seq_len, micro_batch) == sum(want.saved.values()), (seq_len, micro_batch)


@pytest.mark.parametrize("arch", MODULE_ARCHS)
def test_checkpointed_layer_inputs_are_the_layers_inputs(arch: str) -> None:
    """A checkpointed layer keeps what it is handed: DeepSeek-V4's first layer the embedding (a view broadcast over
    the hc_mult streams), the others hc_mult x hidden per token; Inkling's the hidden state."""
    mc = model_config(preset_config(arch, "tiny"))
    inputs: dict[int, int] = {}
    _saved_bytes(arch, 24, 2, inputs)
    ckpt = activations(mc, seq_len=24, micro_batch=2, checkpointing=True)
    assert ckpt.saved["layer_inputs"] == sum(inputs.values())
    plain = activations(mc, seq_len=24, micro_batch=2)
    assert ckpt.saved["other"] == plain.saved["other"] and ckpt.saved["logits"] == plain.saved["logits"]
    layers = [sum(v for k, v in layer.items() if k != "layer_inputs") for layer in _layers(mc, 24, 2)]
    assert ckpt.transient["recompute"] == max(layers)
    if arch == "deepseek_v4":  # the streams: every layer keeps its input, which is the checkpoint's
        assert plain.saved["layer_inputs"] == ckpt.saved["layer_inputs"]


def _layers(mc: ModelConfig, seq_len: int, micro_batch: int) -> list[dict[str, int]]:
    from miles_hpc.planner.accounting import layer_saved

    return [layer_saved(mc, i, seq_len=seq_len, micro_batch=micro_batch) for i in range(mc.num_hidden_layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", MODULE_ARCHS)
def test_state_bytes_are_what_the_engine_holds(arch: str, dtype: torch.dtype) -> None:
    """Two sequences packed in each call, in uneven chunks (a prefill, single decode tokens, more chunks) past
    the windows and several compressed blocks: after every call each state's `nbytes()` is `state_bytes` of its
    length, and the planner's (per token, per sequence) pair bounds it."""
    cfg, model = _tiny(arch, dtype)
    mc, size = model_config(cfg), dtype.itemsize
    states = [model.model.new_state(), model.model.new_state()]
    per_token, per_seq = family_state(mc, size)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunks in ((5, 9), (1, 1), (3, 0), (14, 6), (1, 1), (19, 33), (1, 1)):
            ids = torch.randint(3, 300, (1, sum(chunks)), generator=g)
            cu = torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32)
            model(ids, cu_seqlens=cu, family_states=states)
            for state in states:
                assert state.nbytes() == STATE_BYTES[arch](mc, state.length, size), state.length
                assert state.nbytes() <= per_seq + per_token * state.length
    assert [s.length for s in states] == [44, 51]


@pytest.mark.parametrize("arch", MODULE_ARCHS)
def test_rollout_state_terms(arch: str) -> None:
    """Per token: what the state grows by past the windows; per sequence: the most the rest holds; the bound is
    reached; the estimate reports both (no TP: the engine runs these families whole)."""
    mc = model_config(preset_config(arch, "tiny"))
    size = STATE_BYTES[arch]
    per_token, per_seq = family_state(mc, 2)
    assert kv_bytes_per_token(mc, 2) == per_token == kv_bytes_per_token(mc, 2, tp=4) > 0
    assert recurrent_state_bytes(mc, 2) == per_seq > 0
    lengths = range(2000)
    assert max(size(mc, n, 2) - per_token * n for n in lengths) == per_seq
    assert size(mc, 2016, 2) - size(mc, 1008, 2) == per_token * 1008  # whole blocks apart; exact at tiny sizes
    mem = estimate(preset_config(arch, "tiny"), Cluster(train_gpus=1, engines=1, engine_tp=1))["memory"]
    assert (mem["rollout_kv_bytes_per_token"], mem["rollout_state_bytes_per_seq"]) == (per_token, per_seq)


def test_a_planned_micro_batch_scales() -> None:
    """DeepSeek-V4's eager attention keeps [H, S, S + entries] logits per sequence: quadratic in the length;
    the rest doubles with the sequences but the float32 copies of weights the code makes (hyper-connections,
    routers, norms), once per micro-batch."""
    cfg = {**preset_config("deepseek_v4", "tiny"), "hidden_size": 256, "num_attention_heads": 8}
    mc = model_config(cfg)
    one, two = (sum(activations(mc, seq_len=256, micro_batch=n).saved.values()) for n in (1, 2))
    assert 0 < 2 * one - two < one / 100
    longer = sum(activations(mc, seq_len=512, micro_batch=1).saved.values())
    assert 2 * one < longer < 4 * one
    assert estimate(cfg, Cluster(train_gpus=1, engines=1, engine_tp=1), batch=TrainBatch(seq_len=256))["memory"]
