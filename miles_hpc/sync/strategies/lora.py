"""LoRA weight sync: only the adapter travels (stage: sync; docs/design.md section 6, LoRA RL).

The base weights on the engines never move. `push(named, version)` takes the trainer's adapter tensors (PEFT
names, `Trainer.adapter_for_sync`; every trainer rank holds them whole, so rank 0 alone iterates), writes them as a
PEFT directory ``RUN/lora/v<version>/`` (write-then-rename: an engine never reads half a directory), and on every
engine, concurrently, replaces the served adapter `adapter_name` with it through SGLang's own endpoints
(`/unload_lora_adapter`, then `/load_lora_adapter` with the directory: engines and trainer share a file system, as
on HPC clusters) and sets the weight version (`/update_weight_version`). The publisher pauses generation around
this, so requests in flight continue with the new adapter under the same name (the engine flushes the KV it
computed with the old one).

Returns the checksums of the adapter tensors in the rollout dtype; `verify` compares them with each engine's
(`/lora_adapter_checksums`, our engine's extension: SGLang serves no checksum of an adapter, so with SGLang
engines the load's answer, which lists the adapter under its name, is the check), and, with `check_base`, that
each engine's base weights (`/weights_checker`) are still those it had at the first update: LoRA never moves them.

`last_push_bytes`: the adapter's bytes in the rollout dtype, what one update moves per engine.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from miles_hpc.config import RunConfig
from miles_hpc.models.lora import LoraAdapter, LoraSpec, adapter_modules, save_adapter
from miles_hpc.rollout.client import EngineClient
from miles_hpc.rollout.errors import EngineError
from miles_hpc.sync.codec.delta_manifest import prune_versions
from miles_hpc.sync.protocol import EngineSyncError, WeightSyncError, check_answers
from miles_hpc.sync.strategies.base import EngineNeeds, Sends, Strategy
from miles_hpc.sync.wire.checksum import tensor_checksums

__all__ = ["ADAPTER_NAME", "LoraSync", "LoraSyncSpec"]

ADAPTER_NAME = "policy"


@dataclass(frozen=True, slots=True)
class LoraSyncSpec:
    run_dir: Path
    spec: LoraSpec
    rollout_dtype: torch.dtype
    base_model: str = ""
    adapter_name: str = ADAPTER_NAME
    timeout_s: float = 300.0
    keep_versions: int = 2
    verify_bits: bool = True  # False for SGLang engines (no adapter checksums there): verify checks the name only
    check_base: bool = True  # also check every engine's base weights against their first checksums


class LoraSync(Strategy):
    name = "lora"
    sends: ClassVar[Sends] = (
        "adapters"  # the named tensors are the adapter's (`source` picks the trainer's `adapter_for_sync`)
    )
    takes_named = True
    publish_at_start = True  # the engines serve the adapter by name from the first rollout on

    @classmethod
    def engine_needs(cls, cfg: RunConfig) -> EngineNeeds:
        """SGLang serves adapters only when started for them (rank, target modules); every generation names the
        adapter this strategy loads."""
        return EngineNeeds(
            lora_rank=cfg.lora.rank, lora_target_modules=tuple(cfg.lora.target_modules), adapter_name=ADAPTER_NAME
        )

    def metrics(self) -> dict[str, float]:
        return {"sync/bytes": float(self.last_push_bytes)}

    def __init__(self, spec: LoraSyncSpec) -> None:
        self.spec = spec
        self._clients: list[EngineClient] = []
        self.last_push_bytes = 0
        self._base: dict[str, dict[str, str]] = {}  # engine URL -> its base weights' checksums at the first verify

    @property
    def clients(self) -> Sequence[EngineClient]:
        return self._clients

    async def connect(self, clients: Sequence[EngineClient]) -> None:
        self._clients = list(clients)

    async def close(self) -> None:
        pass

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, str]:
        tensors = {n: t.detach().to("cpu", torch.float32) for n, t in named}
        if not tensors:
            raise WeightSyncError("lora sync: the trainer sent no adapter tensors (is lora.rank > 0?)")
        adapter = LoraAdapter(self.spec.spec, adapter_modules(tensors))
        adapter.load_peft_state(tensors, source="the trainer's adapter")
        path = self._write(adapter, version)
        held = {n: t.to(self.spec.rollout_dtype) for n, t in tensors.items()}  # what the engines will hold
        self.last_push_bytes = sum(t.numel() * t.element_size() for t in held.values())
        results = await asyncio.gather(*(self._swap(c, path, version) for c in self._clients), return_exceptions=True)
        failed = [(c.url, r) for c, r in zip(self._clients, results) if isinstance(r, BaseException)]
        if failed:
            raise EngineSyncError(
                [u for u, _ in failed], f"loading the LoRA adapter {path} failed on {failed[0][0]}: {failed[0][1]}"
            )
        self._prune(path)
        return tensor_checksums(held.items())

    async def verify(self, clients: Sequence[EngineClient], expected: dict[str, str]) -> None:
        if not self.spec.verify_bits:
            return  # SGLang: /load_lora_adapter answered success with the adapter listed (push checks that)
        answers = await asyncio.gather(
            *(c.lora_adapter_checksums(self.spec.adapter_name) for c in clients), return_exceptions=True
        )
        check_answers(clients, answers, expected, "LoRA adapter checksum", "tensor")
        if self.spec.check_base:
            await self._check_base(clients)

    async def _check_base(self, clients: Sequence[EngineClient]) -> None:
        answers = await asyncio.gather(*(c.weights_checksums() for c in clients))
        for client, answer in zip(clients, answers):
            now = {k: v for rank in answer.ranks for k, v in rank.checksums.items()}
            first = self._base.setdefault(client.url, now)
            moved = sorted(k for k in first.keys() | now.keys() if first.get(k) != now.get(k))
            if moved:
                raise WeightSyncError(
                    f"{client.url}: base weights changed during LoRA RL (first: {moved[0]!r} of "
                    f"{len(moved)}); the lora strategy must only move adapters"
                )

    # ------------------------------------------------------------------ internals
    async def _swap(self, client: EngineClient, path: Path, version: str) -> None:
        name = self.spec.adapter_name

        async def swap() -> None:
            try:
                await client.unload_lora_adapter(name)
            except EngineError:
                pass  # not loaded yet (first update, or a restarted engine): the load decides
            loaded = await client.load_lora_adapter(name, path)
            if loaded and name not in loaded:
                raise WeightSyncError(f"{client.url}: /load_lora_adapter answered without {name!r}: {loaded}")
            await client.update_weight_version(version)

        await asyncio.wait_for(swap(), self.spec.timeout_s)

    def _write(self, adapter: LoraAdapter, version: str) -> Path:
        final = self.spec.run_dir / "lora" / f"v{version}"
        tmp = final.with_name(final.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        save_adapter(tmp, adapter, base_model=self.spec.base_model)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        return final

    def _prune(self, keep: Path) -> None:
        """Keep the newest `keep_versions` adapter directories (a restarted engine reloads the current one)."""
        prune_versions(self.spec.run_dir / "lora", keep, self.spec.keep_versions)
