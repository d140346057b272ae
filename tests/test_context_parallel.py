"""Context parallelism's building block (`train/context_parallel.py`): the row layout over CP ranks (pure, many
shapes) and all-gather attention over gloo, exact against attention over the unsplit row: outputs and the
gradients of q, k and v, for GQA and MHA, several packed sequences and padding, CP 2 and 4. This file is also the
worker script (``python test_context_parallel.py CONFIG OUT`` under RANK/WORLD_SIZE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from test_train_fsdp import free_port, worker_main  # noqa: E402

from miles_hpc.train.context_parallel import allowed_rows, cp_attention, cp_layout  # noqa: E402


# ---------------------------------------------------------------- the layout (pure)
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_layout_covers_the_row_once_in_equal_shares(cp: int, multiple: int) -> None:
    for tokens in [1, 2, 5, 16, 17, 63, 64, 100, 257]:
        lay = cp_layout(tokens, cp, multiple)
        unit = 2 * cp * multiple if cp > 1 else multiple
        assert lay.padded % unit == 0 and tokens <= lay.padded < tokens + unit
        shares = [lay.positions(r) for r in range(cp)]
        assert all(s.numel() == lay.padded // cp and s.numel() % multiple == 0 for s in shares)
        assert torch.equal(torch.cat(shares).sort().values, torch.arange(lay.padded))
        gathered = torch.cat(shares)
        assert torch.equal(gathered[lay.gathered_order()], torch.arange(lay.padded))


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_layout_balances_causal_work(cp: int) -> None:
    """One sequence filling the row: every rank's queries see the same number of keys in total (without the
    balancing, the last rank's would see about 2 cp - 1 times the first's)."""
    lay = cp_layout(64 * cp, cp)
    work = [int((lay.positions(r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1, work


def test_layout_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        cp_layout(0, 2)
    with pytest.raises(ValueError, match="CP rank 2 outside 0..1"):
        cp_layout(8, 2).positions(2)


# ---------------------------------------------------------------- attention over gloo
CASES = [
    # (cp, sequence lengths of the packed row, heads, kv heads, head dim, value dim)
    (2, [7, 12, 5], 4, 2, 8, 8),
    (2, [31], 2, 2, 4, 6),
    (4, [9, 1, 14, 3, 6], 4, 1, 8, 8),
]


def _reference(seqs: list[int], heads: int, kv: int, d: int, dv: int, padded: int) -> dict[str, torch.Tensor]:
    """q, k, v, the output weights and the sequence ids of the whole (padded) row, the output and the gradients of
    a weighted sum of it, computed on the unsplit row (a block-diagonal causal mask)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(seqs)])
    pad = padded - seq.numel()
    seq = torch.cat([seq, len(seqs) + torch.arange(pad)])  # each pad token its own sequence
    q = torch.randn(padded, heads, d, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(padded, kv, d, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(padded, kv, dv, generator=g, dtype=torch.float64).requires_grad_()
    w = torch.randn(padded, heads, dv, generator=g, dtype=torch.float64)
    row = torch.arange(padded)
    allowed = (seq[:, None] == seq[None, :]) & (row[None, :] <= row[:, None])
    rep = heads // kv
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.repeat_interleave(rep, 1).transpose(0, 1)[None],
        v.repeat_interleave(rep, 1).transpose(0, 1)[None],
        attn_mask=allowed[None, None],
    )[0].transpose(0, 1)
    (out * w).sum().backward()
    return {"q": q, "k": k, "v": v, "w": w, "seq": seq, "out": out.detach()}


def check_rank(config: str) -> dict:
    cp, seqs, heads, kv, d, dv = json.loads(config)
    rank = torch.distributed.get_rank()
    lay = cp_layout(sum(seqs), cp)
    ref = _reference(seqs, heads, kv, d, dv, lay.padded)
    pos = lay.positions(rank)
    q, k, v = (ref[n].detach()[pos].clone().requires_grad_() for n in ("q", "k", "v"))
    allowed = allowed_rows(ref["seq"], lay, rank)
    out = cp_attention(q, k, v, allowed, lay, torch.distributed.group.WORLD)
    (out * ref["w"][pos]).sum().backward()
    err = {
        "out": (out.detach() - ref["out"][pos]).abs().max().item(),
        **{f"d{n}": (t.grad - ref[n].grad[pos]).abs().max().item() for n, t in (("q", q), ("k", k), ("v", v))},
    }
    return {"errors": err, "grad_norm": float(ref["k"].grad.norm())}


@pytest.mark.process
@pytest.mark.parametrize("case", CASES, ids=[f"cp{c[0]}-{len(c[1])}seqs-h{c[2]}kv{c[3]}" for c in CASES])
def test_cp_attention_equals_the_unsplit_row(case: tuple, tmp_path: Path) -> None:
    cp = case[0]
    env = {
        **os.environ,
        "WORLD_SIZE": str(cp),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, json.dumps(case), str(tmp_path / f"out{r}.pt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(cp)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=300)
        assert p.returncode == 0, log.decode()[-4000:]
    for r in range(cp):
        got = torch.load(tmp_path / f"out{r}.pt", weights_only=False)
        assert got["grad_norm"] > 0  # the keys' gradient is not trivially zero
        for name, e in got["errors"].items():
            assert e < 1e-12, (r, name, e)  # float64: only the summation order differs


if __name__ == "__main__":
    worker_main(check_rank)
