"""LoRA adapters in the embedded engine (stage: engine): loaded by name from PEFT directories (SGLang's
`/load_lora_adapter`), chosen per request (`lora_path` = the adapter's name), applied at run time so the base
weights never change.

How a step applies them: the runner tells the `AdapterSet` which packed rows belong to which adapter (`step`);
forward hooks on the adapted linears add `scaling * (x @ A^T) @ B^T` to those rows only, one adapter at a time.
Rows of requests without an adapter get nothing added, so base-model requests batch with adapter requests.

Invariants:
- Adapters are held in the engine's dtype on its device; their checksums (`checksums`) are of those tensors.
- Loading or unloading changes what a name computes: the caller flushes the prefix cache (Engine does), and the
  scheduler keys cached blocks by adapter name, so KV computed under one adapter (or none) is never reused under
  another.
- Only linears of the base model can be adapted (MoE experts are fused tensors); an adapter for other modules or
  shapes is refused naming the file and tensor. MLA's `kv_b_proj` is refused too: the engine applies it to
  latents gathered from its cache (latent_attention.py), rows no hook could attribute to a request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from miles_hpc.models.linear_attn import call_rows
from miles_hpc.models.lora import LoraAdapter, adapter_modules, load_adapter, peft_name
from miles_hpc.sync.wire.checksum import tensor_checksums

__all__ = ["AdapterSet"]


class AdapterSet:
    """The adapters one engine holds, by name, and the hooks that apply them."""

    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, max_loras: int = 8) -> None:
        self.model, self.device, self.dtype, self.max_loras = model, device, dtype, max_loras
        self.adapters: dict[str, LoraAdapter] = {}
        self.paths: dict[str, str] = {}
        self._linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        self._hooks: dict[str, Any] = {}
        self._active: list[tuple[LoraAdapter, torch.Tensor]] = []  # this step's (adapter, its packed rows)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read the PEFT adapter at `path` and serve it as `name` (replacing an adapter of that name)."""
        if name not in self.adapters and len(self.adapters) >= self.max_loras:
            raise ValueError(
                f"cannot load LoRA adapter {name!r}: {len(self.adapters)} adapters are loaded, the "
                f"most this engine holds (max_loras); unload one first"
            )
        spec, tensors = load_adapter(path)
        modules = adapter_modules(tensors)
        for module, (out_f, in_f) in modules.items():
            lin = self._linears.get(module) if module != "lm_head" else None  # the LM head sees sampled rows only
            if lin is None:
                raise ValueError(f"{path}: adapter module {module!r} is not a linear layer of this model")
            if module.endswith(".kv_b_proj"):
                raise ValueError(
                    f"{path}: adapter module {module!r}: the engine runs MLA's kv_b_proj on latents read from its "
                    "cache, not on a step's rows, so it cannot carry a per-request adapter; adapt the other projections"
                )
            if (lin.out_features, lin.in_features) != (out_f, in_f):
                raise ValueError(
                    f"{path}: {peft_name(module, 'B')} adapts a [{out_f}, {in_f}] weight, the model's "
                    f"{module} is [{lin.out_features}, {lin.in_features}]"
                )
        adapter = LoraAdapter(spec, modules, device=self.device, dtype=self.dtype)
        adapter.load_peft_state({k: v.to(self.dtype) for k, v in tensors.items()}, source=path)
        adapter.requires_grad_(False)
        self.adapters[name], self.paths[name] = adapter, path
        for module in modules:
            if module not in self._hooks:
                self._hooks[module] = self._linears[module].register_forward_hook(self._hook(module))
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        del self.adapters[name], self.paths[name]
        still = {m for a in self.adapters.values() for m in a.modules_}
        for module in [m for m in self._hooks if m not in still]:
            self._hooks.pop(module).remove()

    def checksums(self, name: str) -> dict[str, str]:
        """PEFT name -> checksum of each of the adapter's tensors as this engine holds them."""
        if name not in self.adapters:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded (loaded: {sorted(self.adapters)})")
        return tensor_checksums(self.adapters[name].peft_state())

    def info(self) -> list[dict[str, Any]]:
        return [
            {"lora_name": n, "lora_path": self.paths[n], "rank": a.spec.rank, "bytes": a.num_bytes()}
            for n, a in self.adapters.items()
        ]

    @contextmanager
    def step(self, row_adapters: Sequence[str | None]) -> Iterator[None]:
        """Apply the adapters to the packed rows of one forward: `row_adapters[i]` names the adapter of row i
        (None: the base model)."""
        names = {n for n in row_adapters if n is not None}
        active = []
        for name in sorted(names):
            rows = [i for i, n in enumerate(row_adapters) if n == name]
            active.append((self.adapters[name], torch.tensor(rows, dtype=torch.int64, device=self.device)))
        self._active = active
        try:
            yield
        finally:
            self._active = []

    def _hook(self, module: str) -> Any:
        def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            if not self._active:
                return out
            x = args[0].reshape(-1, args[0].shape[-1])  # packed rows (B = 1)
            flat = out.reshape(-1, out.shape[-1])
            # A recurrent mixer's projection runs on one group of the packed row's sequences at a time
            # (models/linear_attn.py `run_sequences`): its rows are the packed positions `where` names.
            where = call_rows()
            for adapter, rows in self._active:
                if module not in adapter.modules_:
                    continue
                a, b = adapter.pair(module)
                at = rows if where is None else torch.isin(where, rows).nonzero().squeeze(1)
                flat.index_add_(0, at, (x.index_select(0, at) @ a.t()) @ b.t(), alpha=adapter.spec.scaling)
            return out

        return hook
