"""miles_hpc.models on a CUDA/ROCm device (`-m gpu` tier): loading straight to the device, parity with CPU and with
transformers there, packed sequences, and routing replay being exact run to run (no atomics in the MoE combine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models_support import hf_model, input_ids, max_diff

from miles_hpc.models import load_pretrained

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_cuda_matches_cpu_and_transformers(model_type: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model(model_type, num_hidden_layers=3).save_pretrained(tmp_path)
    cpu = load_pretrained(tmp_path)
    gpu = load_pretrained(tmp_path, device="cuda")
    assert next(gpu.parameters()).is_cuda
    ids = input_ids(batch=3, seq=40)
    with torch.no_grad():
        ref, routed_ref = cpu(ids, return_routed_experts=True)
        got, routed = gpu(ids.cuda(), return_routed_experts=True)
        assert max_diff(got.cpu(), ref) < 1e-3
        assert torch.equal(routed.cpu(), routed_ref)

        bf16 = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa")
        hf_logits = hf.cuda().eval()(ids.cuda()).logits
        ours = bf16(ids.cuda())
        assert ours.dtype == torch.bfloat16
        assert max_diff(ours, hf_logits) < 0.1  # bf16 kernels may differ; the fp32 comparison above is the tight one


def test_cuda_packed_and_replay_are_exact(tmp_path: Path) -> None:
    hf_model("qwen3_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=4).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    lengths = [7, 1, 30, 12]
    seqs = [input_ids(batch=1, seq=n, seed=n).cuda() for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        packed, routed = model(torch.cat(seqs, 1), cu_seqlens=cu, return_routed_experts=True)
        for i, s in enumerate(seqs):
            assert max_diff(packed[:, cu[i] : cu[i + 1]], model(s)) < 0.05
        for _ in range(3):  # deterministic: replaying the recorded routes gives the same bits every time
            again = model(torch.cat(seqs, 1), cu_seqlens=cu, routing_replay=routed)
            assert torch.equal(again, packed)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_cuda_dsa_matches_cpu_at_a_context_past_index_topk(arch: str, tmp_path: Path) -> None:
    """The DSA families on the device: the same logits and MTP logits as on the CPU (fp32: the indexer's scores
    agree to ~1e-6, so the same tokens are selected), at 96 tokens against index_topk 16."""
    from miles_hpc.models.presets import init_model

    init_model(arch, "tiny", tmp_path, seed=2)
    cpu, gpu = load_pretrained(tmp_path), load_pretrained(tmp_path, device="cuda")
    ids = input_ids(batch=2, seq=96)
    mtp_cpu: list[torch.Tensor] = []
    mtp_gpu: list[torch.Tensor] = []
    with torch.no_grad():
        ref = cpu(ids, mtp_out=mtp_cpu)
        got = gpu(ids.cuda(), mtp_out=mtp_gpu)
    assert max_diff(got.cpu(), ref) < 1e-3
    assert max_diff(mtp_gpu[0].cpu(), mtp_cpu[0]) < 1e-3
