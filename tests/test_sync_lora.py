"""The "lora" weight sync end to end (sync/strategies/lora.py -> PEFT files -> SGLang's /unload_lora_adapter and
/load_lora_adapter on real `miles-hpc serve` processes, bf16), driven by the Publisher: only the adapter moves
(bytes = the adapter's), the engines' adapter checksums verify, their base weights never change (and a change is
caught), generations name the adapter and follow each new version."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from sync_support import bf16_fleet, engine_sums, router_of
from test_client_engine import tiny_model

from miles_hpc.models import load_pretrained, save_pretrained
from miles_hpc.models.lora import LoraAdapter, LoraSpec
from miles_hpc.sync.protocol import WeightSyncError
from miles_hpc.sync.publish import Publisher
from miles_hpc.sync.strategies.lora import ADAPTER_NAME, LoraSync, LoraSyncSpec

pytestmark = pytest.mark.process

SPEC = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj"))


def adapter_version(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A trainer's adapter after some steps (seeded), PEFT-named."""
    adapter = LoraAdapter.for_model(load_pretrained(tiny_model()), SPEC)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return [(n, t.detach().clone()) for n, t in adapter.peft_state()]


def test_lora_sync_moves_only_the_adapter(tmp_path: Path) -> None:
    async def go(procs: list) -> None:
        router = router_of(procs)
        sync = LoraSync(LoraSyncSpec(run_dir=tmp_path / "run", spec=SPEC, rollout_dtype=torch.bfloat16))
        publisher = Publisher(sync, router, pause_mode="retract")
        async with router:
            base = [await engine_sums(c) for c in router.clients]
            outputs = []
            for version, seed in ((1, 1), (2, 2)):
                named = adapter_version(seed)
                report = await publisher.publish(lambda named=named: iter(named), str(version))
                assert report.engines == 2 and report.tensors == len(named)
                assert sync.last_push_bytes == sum(t.numel() * 2 for _, t in named)  # bf16 adapter bytes
                assert sorted(p.name for p in (tmp_path / "run" / "lora").iterdir()) == [
                    f"v{v}" for v in range(1, version + 1)
                ]
                for c in router.clients:
                    info = await c.model_info()
                    assert str(info["weight_version"]) == str(version)
                out = await router.generate(
                    [5, 6, 7, 8], {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}, lora_path=ADAPTER_NAME
                )
                outputs.append(list(out.output_ids))
            assert outputs[0] != outputs[1]  # the second adapter is the one served
            assert [await engine_sums(c) for c in router.clients] == base  # base weights never moved
            # a base weight changed behind LoRA's back is caught at the next verify
            moved = load_pretrained(tiny_model())
            with torch.no_grad():
                moved.model.norm.weight.add_(1.0)
            save_pretrained(moved, tmp_path / "moved")
            await router.clients[0].update_weights_from_disk(str(tmp_path / "moved"))
            first = "model.norm.weight"
            try:
                await publisher.publish(lambda: iter(adapter_version(3)), "3")
            except WeightSyncError as e:
                assert "base weights changed" in str(e) and first in str(e)
            else:
                raise AssertionError("a moved base weight went unnoticed")

    (tmp_path / "fleet").mkdir()
    with bf16_fleet(tmp_path / "fleet") as procs:
        asyncio.run(go(procs))
