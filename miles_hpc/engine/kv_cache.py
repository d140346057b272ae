"""Paged KV cache: the per-layer K/V tensors, the block allocator with ref counts, and the prefix cache.

Stage: engine. The scheduler owns a `BlockManager` (bookkeeping, host side); the runner owns a `KVCache`
(device tensors). A request's KV lives in the blocks of its block table, token p at slot
`table[p // block_size] * block_size + p % block_size`.

Invariants:
- A block is in exactly one of: the free list (ref 0, no hash), the LRU of cached-free blocks (ref 0, hashed,
  reusable by a prefix hit until evicted), or in use (ref > 0, hashed or not).
- Only full blocks whose every token's KV has been computed are hashed. The key is blake2b-128 chained over
  (parent block's key, the block's token ids as int64), so equal keys mean equal token prefixes (up to 2^-128).
  A hashed block is never written again, so sharing it needs no copy-on-write.
- `flush()` forgets every hash (cached-free blocks return to the free list) and bumps `epoch`; requests admitted
  before a flush never register hashes again (their KV may come from old weights).
- MoE models also keep the routed expert ids of every cached token in `KVCache.routing` (same slots as the KV),
  so a request served from the prefix cache still returns routing rows for its cached prompt tokens.
- Block tables are mirrored in one persistent int32 tensor `[max_running, max_blocks_per_seq]` (row per running
  request): the runner indexes it once per step instead of rebuilding Python lists, and a CUDA-graph runner can
  point at a fixed buffer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained key of one full block: blake2b-128 over the parent key and the block's token ids."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(array("q", tokens).tobytes())  # native int64: keys only need to agree within one process
    return h.digest()


class KVCache:
    """Device tensors of the dense and GQA families: `k[row]` [num_blocks, block_size, kv_heads, head_dim] and
    `v[row]` (the same with `v_head_dim`, default head_dim) for the model layer `layers[row]` (default: every one of
    `num_layers`; a hybrid's attention layers only, its recurrent ones keep a state per sequence instead), and for
    MoE models `routing` int32 [num_blocks * block_size, num_moe_layers, top_k] (expert ids per slot). MLA models use
    `LatentCache` (latent_cache.py) instead."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_moe_layers: int = 0,
        top_k: int = 0,
        v_head_dim: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.row = {layer: i for i, layer in enumerate(range(num_layers) if layers is None else layers)}
        shape = (len(self.row), num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(*shape[:-1], v_head_dim or head_dim, dtype=dtype, device=device)
        self.routing: torch.Tensor | None = None
        if num_moe_layers:
            self.routing = torch.zeros(num_blocks * block_size, num_moe_layers, top_k, dtype=torch.int32, device=device)

    def bytes_per_token(self) -> int:
        """Bytes of device memory one slot holds, summed over this cache's tensors (`latent_cache.geometry`)."""
        tensors = [self.k, self.v] + ([self.routing] if self.routing is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors) // (self.num_blocks * self.block_size)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V viewed as [num_slots, kv_heads, head_dim] (KeyError: a layer without KV)."""
        k, v = self.k[self.row[layer]], self.v[self.row[layer]]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


class BlockManager:
    """Allocator with ref counts, prefix-cache index (hash -> block, LRU eviction) and the block-table tensor."""

    def __init__(self, num_blocks: int, block_size: int, *, max_rows: int, max_blocks_per_seq: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # LRU: evict from the front
        self.index: dict[bytes, int] = {}
        self.epoch = 0
        # One row per running request; rows are recycled. int32 is what paged-attention kernels take.
        self.tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32)
        self.free_rows: list[int] = list(range(max_rows - 1, -1, -1))

    # ---- capacity
    def num_available(self) -> int:
        """Blocks an allocation can take now (free + evictable cached-free)."""
        return len(self.free) + len(self.cached_free)

    def num_used(self) -> int:
        return self.num_blocks - self.num_available()

    # ---- allocation
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref 1), evicting least recently freed cached blocks if needed; None if not enough."""
        if n > self.num_available():
            return None
        out: list[int] = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.cached_free.popitem(last=False)
                key = self.key[b]
                if key is not None and self.index.get(key) == b:
                    del self.index[key]
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; freed hashed blocks stay reusable (LRU), others go to the free list.
        Callers pass a request's table in reverse, so a sequence's tail is evicted before its shared prefix."""
        for b in blocks:
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released more often than taken"
            if self.ref[b] == 0:
                if self.key[b] is not None:
                    self.cached_free[b] = None
                else:
                    self.free.append(b)

    # ---- prefix cache
    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys`, each with one more reference."""
        hit: list[int] = []
        for key in keys:
            b = self.index.get(key)
            if b is None:
                break
            hit.append(b)
        for b in hit:
            if self.ref[b] == 0:
                del self.cached_free[b]
            self.ref[b] += 1
        return hit

    def register(self, block: int, key: bytes) -> None:
        """Make a full, computed block findable by `key` (a duplicate of an indexed key stays private)."""
        if self.key[block] is None and key not in self.index:
            self.key[block] = key
            self.index[key] = block

    def flush(self) -> None:
        """Forget every cached prefix; blocks in use keep their KV but can no longer be matched."""
        for b in self.index.values():  # exactly the blocks holding a key (register/evict keep both in step)
            self.key[b] = None
        self.free.extend(self.cached_free)
        self.cached_free.clear()
        self.index.clear()
        self.epoch += 1

    # ---- block-table rows
    def take_row(self) -> int:
        return self.free_rows.pop()

    def give_row(self, row: int) -> None:
        self.free_rows.append(row)

    def set_row(self, row: int, start: int, blocks: Sequence[int]) -> None:
        if blocks:
            self.tables[row, start : start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
