"""LoRA adapters on our models (miles_hpc/models/lora.py): the forward with an adapter equals the merged weights,
names and checksums of the base model stay, PEFT's file format both ways (peft itself reads our files and gives the
same logits on transformers' model), and errors that name the file and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models_support import hf_load, input_ids, max_diff

from miles_hpc.models import CausalLM, ModelConfig, build_model, iter_hf_tensors, save_pretrained
from miles_hpc.models.lora import (
    ADAPTER_CONFIG,
    LoraAdapter,
    LoraSpec,
    adapter_modules,
    attach,
    load_adapter,
    merge_into,
    save_adapter,
    target_linears,
)
from miles_hpc.models.presets import preset_config


def tiny(arch: str = "qwen3") -> CausalLM:
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf_dict(preset_config(arch, "tiny")))


def random_adapter(model: CausalLM, spec: LoraSpec, seed: int = 1) -> LoraAdapter:
    adapter = LoraAdapter.for_model(model, spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return adapter


def test_targets_follow_peft_matching() -> None:
    model = tiny()
    names = set(target_linears(model, LoraSpec(rank=2, alpha=4)))
    layers = model.config.num_hidden_layers
    assert len(names) == 7 * layers and "model.layers.0.self_attn.q_proj" in names and "lm_head" not in names
    only_q = LoraSpec(rank=2, alpha=4, target_modules=("re:model\\.layers\\.0\\.self_attn\\.q_proj",))
    assert set(target_linears(model, only_q)) == {"model.layers.0.self_attn.q_proj"}
    with pytest.raises(ValueError, match="match no linear"):
        target_linears(model, LoraSpec(rank=2, alpha=4, target_modules=("nothing",)))
    with pytest.raises(ValueError, match="'lm_head' is not supported"):
        target_linears(model, LoraSpec(rank=2, alpha=4, target_modules=("lm_head",)))
    with pytest.raises(ValueError, match="not a linear layer.*MoE experts"):
        target_linears(tiny("qwen3_moe"), LoraSpec(rank=2, alpha=4, target_modules=("experts",)))


def test_adapter_forward_equals_merged_weights_and_keeps_base_names() -> None:
    model = tiny()
    spec = LoraSpec(rank=4, alpha=8)
    ids = input_ids(seq=9)
    with torch.no_grad():
        base = model(ids)
    names_before = [n for n, _ in iter_hf_tensors(model)]
    fresh = LoraAdapter.for_model(model, spec)  # B = 0: changes nothing
    handles = attach(model, fresh)
    with torch.no_grad():
        assert torch.equal(model(ids), base)
    for h in handles:
        h.remove()
    adapter = random_adapter(model, spec)
    handles = attach(model, adapter)
    with torch.no_grad():
        adapted = model(ids)
    assert max_diff(adapted, base) > 1e-2  # the adapter matters
    assert [n for n, _ in iter_hf_tensors(model)] == names_before  # base names only: adapters live outside
    for h in handles:
        h.remove()
    merge_into(model, adapter)
    with torch.no_grad():
        assert max_diff(model(ids), adapted) < 1e-5


def test_gradients_reach_only_the_adapter() -> None:
    model = tiny()
    model.requires_grad_(False)
    adapter = random_adapter(model, LoraSpec(rank=2, alpha=2))
    attach(model, adapter)
    model(input_ids(seq=7)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_peft_files_round_trip_and_peft_reads_them(tmp_path: Path) -> None:
    """Our files in PEFT's format: we read back the same tensors, and peft on transformers' Qwen3 with our adapter
    gives our adapted logits."""
    peft = pytest.importorskip("peft")  # the dev extra installs it: a skip here fails under MILES_REQUIRE_ALL
    model = tiny()
    save_pretrained(model, tmp_path / "base")
    spec = LoraSpec(rank=4, alpha=16, target_modules=("q_proj", "v_proj", "down_proj"))
    adapter = random_adapter(model, spec)
    save_adapter(tmp_path / "adapter", adapter, base_model=str(tmp_path / "base"))
    cfg = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 16
    spec2, tensors = load_adapter(tmp_path / "adapter")
    assert spec2 == spec
    assert set(adapter_modules(tensors)) == set(adapter.modules_)
    back = LoraAdapter(spec2, adapter_modules(tensors))
    back.load_peft_state(tensors)
    theirs_back = dict(back.peft_state())
    assert set(theirs_back) == {n for n, _ in adapter.peft_state()}
    assert all(torch.equal(t, theirs_back[n]) for n, t in adapter.peft_state())

    attach(model, adapter)
    ids = input_ids(seq=9)
    with torch.no_grad():
        ours = model(ids)
        hf = peft.PeftModel.from_pretrained(hf_load(tmp_path / "base"), str(tmp_path / "adapter"))
        theirs = hf(ids).logits
    assert max_diff(ours, theirs) < 1e-4


def test_bad_adapter_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        load_adapter(tmp_path)
    model = tiny()
    adapter = random_adapter(model, LoraSpec(rank=2, alpha=2))
    save_adapter(tmp_path / "a", adapter)
    cfg = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    (tmp_path / "a" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="adapter_config.json.*DoRA"):
        load_adapter(tmp_path / "a")
    (tmp_path / "a" / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    _, tensors = load_adapter(tmp_path / "a")
    other = LoraAdapter.for_model(model, LoraSpec(rank=3, alpha=2))
    with pytest.raises(ValueError, match="lora_A.weight has shape"):
        other.load_peft_state(tensors, source="a")
    tensors.pop(next(iter(tensors)))
    with pytest.raises(KeyError, match="missing"):
        adapter.load_peft_state(tensors, source="a")
