"""LoRA adapters on our models (stage: shared model code: the trainer trains them, the engine serves them).

An adapter adds `scaling * B @ A` to each target linear's weight without touching it: the linear's output becomes
`base(x) + scaling * dropout(x) @ A^T @ B^T`, with A [r, in] (PEFT's init: uniform, as `nn.Linear`) and B [out, r]
(zeros, so a new adapter changes nothing), scaling = alpha / r. The adapter's tensors live outside the model's module
tree (forward hooks on the target linears), so the model's parameter names, HF names, checksums and checkpoints are
the base model's, unchanged.

Files are PEFT's (what SGLang's `/load_lora_adapter` and `peft.PeftModel.from_pretrained` read):
`adapter_config.json` (peft_type LORA, r, lora_alpha, lora_dropout, target_modules) and `adapter_model.safetensors`
with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].

Targets: `nn.Linear` modules whose name is one of `target_modules` or ends with `.<target>` (PEFT's matching), or
matches an entry written `re:<regex>` in full. MoE experts are fused tensors, not linears: they are not adapted (an
error names them if asked for); nor is `lm_head` (the engine computes it on the sampled rows only). Every mismatch between a file and a model names the file and the tensor.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "DEFAULT_TARGETS",
    "RECURRENT_TARGETS",
    "LoraAdapter",
    "LoraSpec",
    "attach",
    "family_targets",
    "load_adapter",
    "merge_into",
    "peft_name",
    "save_adapter",
    "target_linears",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A hybrid family's recurrent layers carry most of its token mixing: the default targets add their input and output
# projections (Gated DeltaNet's in either layout, Mamba-2's); their convolutions and decay parameters stay frozen.
RECURRENT_TARGETS: dict[str, tuple[str, ...]] = {
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
    "qwen3_5_moe_text": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "nemotron_h": ("in_proj", "out_proj"),
}


# A family whose modules the default names would miss or mis-hit gets its own default list (PEFT's matching: a
# target names a module or the end of its dotted path). DeepSeek-V4: its attention's projections and the shared
# expert's, not the compressors' and indexer's (`gate_proj`, `kv_proj` there pool blocks; the indexer gets no
# gradient).
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "deepseek_v4": (
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_proj",
        "self_attn.o_b_proj",
        "shared_experts.gate_proj",
        "shared_experts.up_proj",
        "shared_experts.down_proj",
    ),
}


def family_targets(targets: Sequence[str], model_type: str) -> tuple[str, ...]:
    """The targets a run adapts: the default list, on a hybrid family, with its recurrent layers' projections
    added, or a family's own (FAMILY_TARGETS); any other list as given."""
    if tuple(targets) != DEFAULT_TARGETS:
        return tuple(targets)
    return FAMILY_TARGETS.get(model_type) or DEFAULT_TARGETS + RECURRENT_TARGETS.get(model_type, ())


_PEFT = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """An adapter's shape: rank r, alpha (scaling = alpha / r), dropout on the adapter's input while training, and
    the target module names."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def matches(self, module_name: str) -> bool:
        for t in self.target_modules:
            if t.startswith("re:"):
                if re.fullmatch(t[3:], module_name):
                    return True
            elif module_name == t or module_name.endswith("." + t):
                return True
        return False

    def peft_config(self, base_model: str = "") -> dict[str, Any]:
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": _peft_targets(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "base_model_name_or_path": base_model,
        }


def target_linears(model: nn.Module, spec: LoraSpec) -> dict[str, nn.Linear]:
    """The model's linears `spec` adapts, by module name (model order). Raises when none matches, or when a target
    names something that is not a linear (MoE experts: fused tensors)."""
    out = {}
    for name, module in model.named_modules():
        if not name or not spec.matches(name):
            continue
        if name == "lm_head":
            raise ValueError(
                "LoRA target 'lm_head' is not supported: the engine runs the LM head on the sampled rows "
                "only, where the adapter's rows would not line up"
            )
        if not isinstance(module, nn.Linear):
            raise ValueError(
                f"LoRA target {name!r} is a {type(module).__name__}, not a linear layer (MoE experts are "
                "fused tensors and are not adapted; target the attention or dense MLP projections)"
            )
        out[name] = module
    if not out:
        raise ValueError(f"LoRA target_modules {list(spec.target_modules)} match no linear layer of the model")
    return out


def peft_name(module: str, which: str) -> str:
    return f"base_model.model.{module}.lora_{which}.weight"


class LoraAdapter(nn.Module):
    """One adapter's A and B per target module (`modules`: name -> (out_features, in_features)). Parameter names are
    the module names with '.' as '__' (`A.<module>`, `B.<module>`); `peft_state` gives PEFT's names."""

    def __init__(
        self,
        spec: LoraSpec,
        modules: Mapping[str, tuple[int, int]],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.modules_: dict[str, tuple[int, int]] = dict(modules)
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for name, (out_f, in_f) in self.modules_.items():
            a = torch.empty(spec.rank, in_f, device=device, dtype=dtype)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # PEFT's (and nn.Linear's) default
            self.A[_key(name)] = nn.Parameter(a)
            self.B[_key(name)] = nn.Parameter(torch.zeros(out_f, spec.rank, device=device, dtype=dtype))

    @classmethod
    def for_model(cls, model: nn.Module, spec: LoraSpec, **kw: Any) -> LoraAdapter:
        shapes = {n: (m.out_features, m.in_features) for n, m in target_linears(model, spec).items()}
        return cls(spec, shapes, **kw)

    def pair(self, module: str) -> tuple[nn.Parameter, nn.Parameter]:
        return self.A[_key(module)], self.B[_key(module)]

    def delta(self, module: str) -> torch.Tensor:
        """The weight change of `module`: scaling * B @ A, [out, in]."""
        a, b = self.pair(module)
        return (b @ a) * self.spec.scaling

    def peft_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(PEFT name, tensor) for every A and B, in module order."""
        for name in self.modules_:
            a, b = self.pair(name)
            yield peft_name(name, "A"), a
            yield peft_name(name, "B"), b

    @torch.no_grad()
    def load_peft_state(self, tensors: Mapping[str, torch.Tensor], *, source: str = "adapter") -> None:
        """Copy PEFT-named tensors in (all of this adapter's, of the same shapes; names the offending tensor)."""
        want = dict(self.peft_state())
        missing, extra = set(want) - set(tensors), set(tensors) - set(want)
        if missing or extra:
            raise KeyError(
                f"{source}: adapter tensors do not match the model's targets: missing "
                f"{sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}"
            )
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(want[name].shape):
                raise ValueError(
                    f"{source}: {name} has shape {tuple(t.shape)}, the model needs {tuple(want[name].shape)}"
                )
            want[name].copy_(t)

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def _key(module: str) -> str:
    return module.replace(".", "__")


def attach(model: nn.Module, adapter: LoraAdapter) -> list[torch.utils.hooks.RemovableHandle]:
    """Make `model`'s target linears add the adapter's update to their outputs (forward hooks; remove them with the
    returned handles). Dropout applies in training mode only. The adapter's tensors are cast to the input's dtype."""
    linears = target_linears(model, adapter.spec)
    if set(linears) != set(adapter.modules_):
        raise ValueError(
            f"adapter modules {sorted(set(adapter.modules_) ^ set(linears))[:4]} differ from the model's targets"
        )
    handles = []
    drop = adapter.spec.dropout
    for name, lin in linears.items():
        a, b = adapter.pair(name)
        scale = adapter.spec.scaling

        def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor, a=a, b=b) -> torch.Tensor:  # noqa: ANN001
            x = args[0]
            if drop and mod.training:
                x = nn.functional.dropout(x, drop, training=True)
            return out + (x @ a.to(x.dtype).t()) @ (b.to(x.dtype).t() * scale)

        handles.append(lin.register_forward_hook(hook))
    return handles


@torch.no_grad()
def merge_into(model: nn.Module, adapter: LoraAdapter) -> None:
    """Add each target's scaling * B @ A into its weight, in place (for export as a plain HF checkpoint)."""
    for name, lin in target_linears(model, adapter.spec).items():
        lin.weight.add_(adapter.delta(name).to(lin.weight.dtype))


def save_adapter(path: str | Path, adapter: LoraAdapter, *, base_model: str = "") -> Path:
    """Write `adapter` in PEFT's format under the directory `path` (created)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in adapter.peft_state()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter.spec.peft_config(base_model), indent=2) + "\n")
    return out


def load_adapter(path: str | Path, *, device: torch.device | str = "cpu") -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """Read a PEFT LoRA adapter directory: its spec and its tensors by PEFT name. Errors name the file and field."""
    root = Path(path)
    cfg_file, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(
                f"{f}: not found (a LoRA adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
            )
    raw = json.loads(cfg_file.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {raw.get('peft_type')!r}, only LORA adapters are supported")
    for field in ("r", "lora_alpha"):
        if field not in raw:
            raise ValueError(f"{cfg_file}: no {field!r}")
    if raw.get("use_rslora") or raw.get("use_dora") or raw.get("bias", "none") != "none":
        raise ValueError(f"{cfg_file}: rsLoRA, DoRA and LoRA biases are not supported")
    targets = raw.get("target_modules") or []
    targets = ("re:" + targets,) if isinstance(targets, str) else tuple(targets)
    spec = LoraSpec(
        rank=int(raw["r"]),
        alpha=float(raw["lora_alpha"]),
        dropout=float(raw.get("lora_dropout", 0.0)),
        target_modules=targets,
    )
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(weights), framework="pt", device=str(device)) as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if not _PEFT.match(name):
                raise ValueError(f"{weights}: tensor {name!r} is not a LoRA A/B weight in PEFT's naming")
            tensors[name] = f.get_tensor(name)
    return spec, tensors


def adapter_modules(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) from PEFT-named tensors."""
    shapes: dict[str, dict[str, Sequence[int]]] = {}
    for name, t in tensors.items():
        m = _PEFT.match(name)
        if m:
            shapes.setdefault(m.group(1), {})[m.group(2)] = tuple(t.shape)
    out = {}
    for module, ab in shapes.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter module {module!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        out[module] = (int(ab["B"][0]), int(ab["A"][1]))
    return out


def _peft_targets(targets: Sequence[str]) -> list[str] | str:
    """PEFT's `target_modules`: a list of names, or one regex string (ours: an entry `re:<regex>`)."""
    regex = [t[3:] for t in targets if t.startswith("re:")]
    if regex:
        names = [re.escape(t) for t in targets if not t.startswith("re:")]
        return "|".join(f"(?:{r})" for r in regex) + "".join(f"|(?:.*\\.{n})" for n in names)
    return list(targets)
