"""The paged cache of MLA models (DeepSeek-V3, DeepSeek-V3.2, GLM-5): the compressed latent per token, not the
expanded keys and values; with DeepSeek sparse attention also each indexer layer's key per token. Also the cache
geometry of every family (bytes per cached token, both forms), which sizes the cache and `/get_server_info` reports.

Stage: engine. `make_cache` builds the cache a model needs (a `KVCache` for dense and GQA families, a `LatentCache`
for MLA); the scheduler's `BlockManager` and the slot mapping are the same for both, so prefix caching,
retraction and the routing store work unchanged: a cached block carries whatever this cache holds per slot.

Per token and per decoder layer a `LatentCache` holds (in the engine dtype, the model's):
- `latent[layer]`: the kv_a_layernorm-ed latent (`kv_lora_rank` values) and `k_rot[layer]`: the rotated key part all
  heads share (`qk_rope_head_dim`), exactly what the model hands `kv_b_proj` and concatenates to every head's key;
- `index_k[i]` for the i-th layer that runs an indexer (every layer of DeepSeek-V3.2, GLM-5.2's "full" layers):
  its key (`index_head_dim` values). The indexer computes it in the model dtype and scores in float32, so the
  engine dtype holds it exactly; the cache casts it back to float32 to score. GLM-5.2's "shared" layers have none.
With `record_indexer_topk` (EngineConfig; indexer replay) also, per slot, `indexer_topk` [indexer layers,
index_topk] int32: the key positions (within the sequence) the token's query selected in each indexer layer, -1 for
entries that are no key (a query at position p < index_topk - 1 has only p + 1), written by `dsa_select` when the
token is processed, so a prefix-cache hit returns the rows of the request that computed the block.
The expanded form an engine would otherwise hold is heads * (qk_head_dim + v_head_dim) values per layer.
Multi-token-prediction layers (`model.layers.{N}`) are held by the model but never run, so they have no cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_hpc.models import ModelConfig

from .kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """What one cached token costs in a model's cache, in both forms (bytes, every layer, routing ids and recorded
    indexer selections included)."""

    form: str  # "latent" (MLA) or "kv" (per-head keys and values)
    bytes_per_token: int  # what this engine's cache holds
    expanded_bytes_per_token: int  # per-head K and V of every layer (what a "kv" cache holds)
    latent_values: int  # per layer: kv_lora_rank + qk_rope_head_dim (0 for "kv")
    index_values: int  # per indexer layer: index_head_dim (0 without DSA)
    index_layers: int  # layers whose indexer keys are cached
    routing_bytes: int  # int32 expert ids per token (MoE)
    indexer_topk_bytes: int = 0  # int32 recorded selections per token (DSA with record_indexer_topk)

    def info(self) -> dict[str, object]:
        """For /get_server_info."""
        return {
            "kv_cache_form": self.form,
            "kv_cache_bytes_per_token": self.bytes_per_token,
            "kv_cache_expanded_bytes_per_token": self.expanded_bytes_per_token,
        }


def index_layer_ids(mc: ModelConfig) -> tuple[int, ...]:
    """Decoder layers that run their own indexer (whose keys the cache keeps)."""
    return tuple(i for i in range(mc.num_hidden_layers) if mc.indexer_full(i))


def kv_layer_ids(mc: ModelConfig) -> tuple[int, ...]:
    """The decoder layers that cache keys and values: all, or a hybrid's full-attention ones."""
    every = range(mc.num_hidden_layers)
    return tuple(i for i in every if not mc.is_hybrid or mc.layer_types[i] == "full_attention")


def geometry(
    mc: ModelConfig, dtype: torch.dtype, routing_width: int, *, record_indexer_topk: bool = False
) -> CacheGeometry:
    """The cache geometry of `mc` in `dtype` (`routing_width` = num_moe_layers * top_k int32 ids per token;
    `record_indexer_topk`: DSA models also keep num_indexer_layers * index_topk int32 positions per token)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = len(kv_layer_ids(mc))
    v_dim = mc.v_head_dim if mc.is_mla else mc.head_dim
    expanded = layers * mc.num_key_value_heads * (mc.qk_head_dim + v_dim) * elem
    routing = 4 * routing_width
    if not mc.is_mla:
        return CacheGeometry("kv", expanded + routing, expanded + routing, 0, 0, 0, routing)
    latent = mc.kv_lora_rank + mc.head_dim
    n_index = len(index_layer_ids(mc))
    index = mc.index_head_dim if n_index else 0
    own = (layers * latent + n_index * index) * elem
    extra = routing + (4 * n_index * mc.index_topk if record_indexer_topk else 0)  # int32 ids kept per slot
    return CacheGeometry("latent", own + extra, expanded + extra, latent, index, n_index, routing, extra - routing)


class LatentCache:
    """Device tensors of an MLA model's cache: `latent` [layers, num_blocks, block_size, kv_lora_rank], `k_rot`
    [layers, num_blocks, block_size, qk_rope_head_dim], `index_k` [indexer layers, num_blocks, block_size,
    index_head_dim] (DSA; `index_row[layer]` names a layer's row), for MoE models `routing` as `KVCache`'s, and with
    `record_indexer_topk` `indexer_topk` [num_slots, indexer layers, index_topk] int32 (module docstring)."""

    def __init__(
        self,
        mc: ModelConfig,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_moe_layers: int = 0,
        top_k: int = 0,
        record_indexer_topk: bool = False,
    ) -> None:
        if not mc.is_mla:
            raise ValueError(f"a latent cache is for MLA models; {mc.model_type} has per-head keys and values")
        self.num_blocks, self.block_size = num_blocks, block_size
        base = (mc.num_hidden_layers, num_blocks, block_size)
        self.latent = torch.zeros(*base, mc.kv_lora_rank, dtype=dtype, device=device)
        self.k_rot = torch.zeros(*base, mc.head_dim, dtype=dtype, device=device)
        ids = index_layer_ids(mc)
        self.index_row = {layer: i for i, layer in enumerate(ids)}
        self.index_k = torch.zeros(len(ids), num_blocks, block_size, mc.index_head_dim, dtype=dtype, device=device)
        self.routing: torch.Tensor | None = None
        if num_moe_layers:
            self.routing = torch.zeros(num_blocks * block_size, num_moe_layers, top_k, dtype=torch.int32, device=device)
        self.indexer_topk: torch.Tensor | None = None
        if record_indexer_topk:
            shape = (num_blocks * block_size, len(ids), mc.index_topk)
            self.indexer_topk = torch.full(shape, -1, dtype=torch.int32, device=device)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s latent [num_slots, kv_lora_rank] and rotated key part [num_slots, rope]."""
        lat, kr = self.latent[layer], self.k_rot[layer]
        return lat.view(-1, lat.shape[-1]), kr.view(-1, kr.shape[-1])

    def index_flat(self, layer: int) -> torch.Tensor:
        """Indexer keys of layer `layer` [num_slots, index_head_dim] (KeyError for a layer without an indexer)."""
        k = self.index_k[self.index_row[layer]]
        return k.view(-1, k.shape[-1])

    def bytes_per_token(self) -> int:
        """Bytes of device memory one slot holds, summed over this cache's tensors (what `geometry` predicts)."""
        tensors = [self.latent, self.k_rot, self.index_k]
        tensors += [t for t in (self.routing, self.indexer_topk) if t is not None]
        slots = self.num_blocks * self.block_size
        return sum(t.numel() * t.element_size() for t in tensors) // slots


def make_cache(
    mc: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_moe_layers: int,
    top_k: int,
    record_indexer_topk: bool = False,
) -> KVCache | LatentCache:
    """The cache `mc` needs: latent for MLA, per-head K/V (only the KV heads) otherwise (`record_indexer_topk`:
    DSA models only, the engine refuses it for others)."""
    if mc.is_mla:
        return LatentCache(
            mc,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            device=device,
            num_moe_layers=num_moe_layers,
            top_k=top_k,
            record_indexer_topk=record_indexer_topk,
        )
    return KVCache(
        num_layers=mc.num_hidden_layers,
        layers=kv_layer_ids(mc),
        num_blocks=num_blocks,
        block_size=block_size,
        kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        num_moe_layers=num_moe_layers,
        top_k=top_k,
    )
