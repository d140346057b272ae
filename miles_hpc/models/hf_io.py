"""HF checkpoint I/O: config.json + safetensors (single file or sharded with an index), in HF tensor names.

Stage: shared (engine loads and hot-swaps weights, trainer loads and saves, sync names tensors).

Name mapping (the only place that knows it):
- Dense tensors: our parameter name == HF name.
- Qwen3-MoE experts: we hold `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I]
  (transformers 5's in-memory layout). Hub checkpoints (and transformers 5.24 `save_pretrained`, which reverts
  its load-time conversion by default) store per-expert `mlp.experts.{j}.gate_proj.weight` [I, H],
  `up_proj.weight` [I, H], `down_proj.weight` [H, I]. transformers 5 with `save_original_format=False` writes
  the fused tensors under their in-memory names (no `.weight` suffix). We read both, per layer, and write the
  Hub per-expert layout.
- Nemotron-H: in memory `model.*` with fused non-gated experts `mixer.experts.up_proj` [E, I, D] and `down_proj`
  [E, D, I]; the Hub (and transformers' `save_pretrained`) writes `backbone.*` and per-expert
  `mixer.experts.{j}.up_proj.weight` / `down_proj.weight`. We read both prefixes and both expert layouts, and write
  the Hub's.
- Multimodal checkpoints of a supported text family (`families.WRAPPERS`: Qwen3.5-MoE's `qwen3_5_moe`, Kimi-K2.5's
  `kimi_k25`): the text model's tensors sit under the wrapper's prefixes (`model.language_model.*`; Kimi's Hub
  `language_model.model.*`) and its head under its names; we load those as our `model.*`, keep every other tensor
  (the vision tower, projector, MTP layers) as it was read (`CausalLM.hf_extra`, with the wrapper's config in
  `hf_wrapper`) and write them back unchanged beside ours, ours under the wrapper's first prefix, under the same
  config.json with our text config.
- A `families.FAMILY_MODULES` family names its Hub tensors itself (`hub_name` / `our_name`; DeepSeek-V4's release
  names), may store its experts fused (`FUSED_EXPERTS`: Inkling) and ignore tensors of layers it does not build
  (`IGNORED_PREFIXES`: DeepSeek-V4's `mtp.*`).
- Tied embeddings: `lm_head.weight` is not written; if a checkpoint has it anyway it is ignored (transformers
  ties it to the embedding too). Legacy `rotary_emb.inv_freq` buffers are ignored.
- Multi-token-prediction layers (MLA families; `model.layers.{N + j}.*`, N = num_hidden_layers, mtp.py) load and
  save when the config has `num_nextn_predict_layers`; their copies of the embedding and output head
  (`embed_tokens`, `shared_head.head`, in DeepSeek-V3 releases) are ignored, and so are layers past the ones the
  config names. A checkpoint with none of them (transformers saves none) loads without them (a warning says so).

Every missing, unexpected or mis-shaped tensor is an error naming the tensor and the file.
FP8 block-quantized checkpoints (`fp8.py`) are dequantized to the parameters' dtype as they load; saving always
writes the parameters' plain dtype and no `quantization_config`.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import fp8
from .config import ModelConfig
from .families import WRAPPERS, family_module
from .transformer import CausalLM

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(
    r"^((?:model|backbone)\.layers\.\d+\.(?:mlp|mixer)\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED = (".experts.gate_up_proj", ".experts.down_proj", ".experts.up_proj")
_HUB_PREFIX = {"nemotron_h": "backbone."}  # the Hub's prefix for our `model.` where a family renames it


def hub_name(config: ModelConfig, name: str) -> str:
    """The Hub's spelling of our parameter name (or of a checkpoint's in-memory-style name); a Hub name as it is."""
    fam = family_module(config.model_type)
    if fam is not None and hasattr(fam, "hub_name"):
        return str(fam.hub_name(name))
    prefix = _HUB_PREFIX.get(config.model_type)
    return prefix + name.removeprefix("model.") if prefix and name.startswith("model.") else name


def _our_name(config: ModelConfig, name: str) -> str:
    fam = family_module(config.model_type)
    if fam is not None and hasattr(fam, "our_name"):  # per-expert names as `model.layers.{i}.mlp.experts.{j}.*`
        return str(fam.our_name(name))
    prefix = _HUB_PREFIX.get(config.model_type)
    return "model." + name.removeprefix(prefix) if prefix and name.startswith(prefix) else name


# ---------------------------------------------------------------- name mapping
def hf_target(model: CausalLM, name: str, params: dict[str, torch.nn.Parameter] | None = None) -> torch.Tensor:
    """The view of our parameter that HF tensor `name` fills (per-expert names map into the fused tensors).

    Writing into the view updates the model: this is how checkpoints load and how weight updates apply.
    Pass `params=dict(model.named_parameters())` when resolving many names.
    """
    if params is None:
        params = dict(model.named_parameters())
    ours = _our_name(model.config, name)
    m = _EXPERT.match(ours)
    if m is None:
        if ours not in params:
            raise KeyError(f"no parameter for HF tensor {name!r}")
        return params[ours].data
    prefix, j, kind = m.group(1), int(m.group(2)), m.group(3)
    plain = f"{prefix}.up_proj" in params  # Nemotron-H's non-gated experts
    if (f"{prefix}.gate_up_proj" not in params and not plain) or j >= model.config.num_experts:
        raise KeyError(f"no parameter for HF tensor {name!r}")
    if plain and kind == "gate_proj":
        raise KeyError(f"no parameter for HF tensor {name!r} (these experts have no gate)")
    if kind == "down_proj" or plain:
        return params[f"{prefix}.{kind}"].data[j]
    inter = model.config.moe_intermediate_size
    rows = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
    return params[f"{prefix}.gate_up_proj"].data[j, rows]


def hf_parts(config: ModelConfig, name: str, shape: Iterable[int]) -> list[tuple[str, tuple[int | slice, ...]]]:
    """The HF tensors carved out of our state-dict tensor `name`: (HF name, index into ours), in Hub order.

    `()` indexes the whole tensor; fused experts give `(j, rows)` / `(j,)` per expert; a tied `lm_head` gives none.
    """
    if config.tie_word_embeddings and name == "lm_head.weight":
        return []
    if getattr(family_module(config.model_type), "FUSED_EXPERTS", False):  # stored fused, as held (Inkling)
        return [(hub_name(config, name), ())]
    name = hub_name(config, name)
    if name.endswith((".experts.up_proj", ".experts.down_proj")):  # per expert (j,): gated ones' down, plain ones'
        prefix, kind = name.rsplit(".", 1)
        return [(hub_name(config, f"{prefix}.{j}.{kind}.weight"), (j,)) for j in range(next(iter(shape)))]
    if name.endswith(".experts.gate_up_proj"):
        prefix, inter = name[: -len(".gate_up_proj")], config.moe_intermediate_size
        return [
            (hub_name(config, f"{prefix}.{j}.{kind}.weight"), (j, rows))
            for j in range(next(iter(shape)))
            for kind, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter)))
        ]
    return [(name, ())]


def iter_hf_tensors(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in the Hub layout: per-expert MoE tensors, no `lm_head.weight` when tied. Views, no copy."""
    for name, t in model.state_dict().items():
        for hf_name, index in hf_parts(model.config, name, t.shape):
            yield hf_name, t[index] if index else t


def _zero_width_shared_experts(model: CausalLM) -> list[tuple[str, torch.Tensor]]:
    """With n_shared_experts=0 a DeepSeek-V3 / GLM-4.5 MoE layer of transformers still has a shared expert, zero
    wide (it adds exactly nothing): its empty tensors, so transformers finds every weight it builds."""
    c = model.config
    if not c.group_router or c.n_shared_experts:
        return []
    out = []
    dtype = next(model.parameters()).dtype
    for i in model.moe_layer_ids:
        p = f"model.layers.{i}.mlp.shared_experts."
        out += [(p + n, torch.zeros(0, c.hidden_size, dtype=dtype)) for n in ("gate_proj.weight", "up_proj.weight")]
        out.append((p + "down_proj.weight", torch.zeros(c.hidden_size, 0, dtype=dtype)))
    return out


def expected_hf_shapes(model: CausalLM, present: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
    """HF names a checkpoint of `model` must hold, with shapes. A layer whose fused expert tensors are in
    `present` expects the fused layout instead of the per-expert one."""
    present = set(present)
    shapes: dict[str, tuple[int, ...]] = {}
    fused_prefixes = set()
    for name, t in model.state_dict().items():
        hub = hub_name(model.config, name)
        if name.endswith(_FUSED) and hub in present:
            fused_prefixes.add(hub.rsplit(".", 1)[0])
            shapes[hub] = tuple(t.shape)
    for name, t in iter_hf_tensors(model):
        m = _EXPERT.match(name)
        if m is None or m.group(1) not in fused_prefixes:
            shapes[name] = tuple(t.shape)
    return shapes


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
        return True
    if name.startswith(getattr(family_module(config.model_type), "IGNORED_PREFIXES", ())):
        return True  # a family's tensors of layers not built (DeepSeek-V4's `mtp.*`, as transformers drops them)
    if config.group_router and not config.n_shared_experts and ".mlp.shared_experts." in name:
        return True  # n_shared_experts=0: transformers' zero-width shared expert, whose output is exactly zero
    m = _LAYER.match(name)
    if not config.is_mla or m is None or int(m.group(1)) < config.num_hidden_layers:
        return False
    # Multi-token-prediction layers: their copies of the model's embedding and head, and depths we do not build.
    copies = name.endswith((".embed_tokens.weight", ".shared_head.head.weight"))
    return copies or int(m.group(1)) >= config.num_hidden_layers + config.num_nextn_predict_layers


def without_absent_mtp(config: ModelConfig, names: Iterable[str], source: Path) -> ModelConfig:
    """`config` with no MTP layers when the checkpoint holds none of them (transformers saves none)."""
    n = config.num_hidden_layers
    if not config.num_nextn_predict_layers:
        return config
    if any((m := _LAYER.match(name)) is not None and int(m.group(1)) >= n for name in names):
        return config
    log.warning("%s: no multi-token-prediction layer model.layers.%d.*: loading without it", source, n)
    return config.replace(num_nextn_predict_layers=0)


# ---------------------------------------------------------------- loading
def checkpoint_files(path: Path) -> tuple[dict[str, Path], Path]:
    """Map each tensor name to the safetensors file holding it; also return the file to blame for absences."""
    single, index = path / SINGLE_FILE, path / INDEX_FILE
    if single.exists():
        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}, single
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
        return {k: path / v for k, v in weight_map.items()}, index
    raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


@torch.no_grad()
def load_hf_checkpoint(model: CausalLM, path: str | os.PathLike[str]) -> None:
    """Fill every parameter of `model` from the HF checkpoint directory `path`, checking names and shapes."""
    files, blame = checkpoint_files(Path(path))
    wrapper = _wrapper_config(Path(path))
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # ours from a reshaped stored tensor
    if wrapper is None:
        stored = {hub_name(model.config, n): n for n in files}  # Hub spelling -> the name in the file
    else:  # a multimodal checkpoint: the text model's tensors under its prefix; the others kept as they are
        text = WRAPPERS[wrapper["model_type"]].sources(files)
        stored = {hub_name(model.config, ours): n for ours, (n, _) in text.items()}
        transforms = {hub_name(model.config, ours): f for ours, (_, f) in text.items() if f is not None}
        consumed = {n for n, _ in text.values()}
        extra = {n: files[n] for n in files if n not in consumed}
        model.hf_wrapper, model.hf_extra = wrapper, _read_all(extra)
    files = {hub: files[n] for hub, n in stored.items()}
    quant = fp8.read_quantization(path)
    if quant is not None and wrapper is not None:  # its other tensors would be written back fp8, unscaled
        raise ValueError(
            f"{Path(path) / 'config.json'}: an FP8 multimodal checkpoint is not supported; use its bf16 release"
        )
    files, scales = fp8.split_scales(files)  # FP8 block scales: consumed with their weights, never "unexpected"
    expected = expected_hf_shapes(model, files)
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{blame}: missing tensor {missing[0]!r}{more} for {model.config.model_type}")
    unexpected = [n for n in files if n not in expected and not _ignorable(n, model.config)]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r}{more}")
    fp8.check_scales(scales, files, quant)
    by_stored = {stored[w]: file for w, file in scales.items()}  # the scales by the names the files use
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = {}
    for n in expected:
        by_file.setdefault(files[n], []).append(n)
    for file, names in by_file.items():
        if not file.exists():
            raise FileNotFoundError(f"{blame}: shard {file.name} (holding {names[0]!r}) does not exist")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for n in names:
                if n in transforms:  # a multimodal release's fused or permuted tensor (families.Wrapper.codec)
                    t = transforms[n](f.get_tensor(stored[n]))
                    if tuple(t.shape) != expected[n]:
                        raise ValueError(f"{file}: {stored[n]!r} gives {n!r} of {tuple(t.shape)}, not {expected[n]}")
                    hf_target(model, n, params).copy_(t)
                    continue
                shape = tuple(f.get_slice(stored[n]).get_shape())
                if shape != expected[n]:
                    raise ValueError(f"{file}: tensor {stored[n]!r} has shape {shape}, expected {expected[n]}")
                target = hf_target(model, n, params)  # an fp8 weight is dequantized to its dtype, one at a time
                target.copy_(fp8.read_tensor(f, file, stored[n], quant, by_stored, target.dtype))


def _wrapper_config(path: Path) -> dict | None:
    """The config.json of a multimodal checkpoint whose text model we train, else None."""
    cfg = path / "config.json"
    d = json.loads(cfg.read_text()) if cfg.is_file() else {}
    return d if d.get("model_type") in WRAPPERS else None


def _read_all(files: dict[str, Path]) -> dict[str, torch.Tensor]:
    """Tensors by name, as stored (CPU)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(files.values())):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update({n: f.get_tensor(n) for n in files if files[n] == file})
    return out


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} does not exist")
    d = json.loads(cfg_path.read_text())
    fp8.parse_quantization(d, source=str(cfg_path))  # refuse an unsupported quantization before any allocation
    return ModelConfig.from_hf_dict(d, source=str(cfg_path))


def build_model(
    config: ModelConfig, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> CausalLM:
    """Random-init model (seed with torch.manual_seed); dtype defaults to the config's, else float32."""
    model = _empty_model(config, dtype, device)
    model.reset_parameters()
    return model


def load_pretrained(
    path: str | os.PathLike[str], dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> CausalLM:
    """Load an HF-format checkpoint directory; dtype defaults to the config's `torch_dtype`/`dtype`, else float32."""
    config = read_config(path)
    files, blame = checkpoint_files(Path(path))
    model = _empty_model(without_absent_mtp(config, files, blame), dtype, device)
    load_hf_checkpoint(model, path)
    return model.eval()


def _empty_model(config: ModelConfig, dtype: torch.dtype | None, device: str | torch.device | None) -> CausalLM:
    # Build on the meta device and allocate once in the target dtype/device: no throwaway random init.
    with torch.device("meta"):
        model = CausalLM(config)
    model.to(dtype=dtype or config.torch_dtype() or torch.float32)
    model.to_empty(device=torch.device(device) if device is not None else torch.device("cpu"))
    model.tie_weights()  # to_empty may re-create Parameters, which unties them
    return model


# ---------------------------------------------------------------- saving
def save_pretrained(model: CausalLM, out_dir: str | os.PathLike[str], max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors in the Hub layout (sharded with an index above `max_shard_bytes`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = next(model.parameters()).dtype
    config = model.config.replace(dtype=str(dtype).removeprefix("torch."))
    tensors = list(iter_hf_tensors(model)) + _zero_width_shared_experts(model)
    if model.hf_wrapper is not None:  # the multimodal checkpoint this text model came from: its layout, all of it
        tensors = WRAPPERS[model.hf_wrapper["model_type"]].store(tensors)
        tensors += list(model.hf_extra.items())
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        # Greedy like transformers: start a new shard when this tensor would overflow the current one.
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    # Remove weights of an earlier save so a stale index or shard cannot shadow the new files.
    for old in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: t.detach().contiguous().cpu() for n, t in shards[0]}, str(out / SINGLE_FILE), metadata=meta)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: t.detach().contiguous().cpu() for n, t in shard}, str(out / fname), metadata=meta)
            weight_map.update({n: fname for n, _ in shard})
        total = sum(t.numel() * t.element_size() for _, t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    written = config.to_hf_dict()
    if model.hf_wrapper is not None:
        text = {k: v for k, v in written.items() if k != "architectures"}
        written = {
            **model.hf_wrapper,
            "text_config": {**model.hf_wrapper["text_config"], **text},
            "dtype": config.dtype,
        }
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
