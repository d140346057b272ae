"""The gated delta rule (Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5), in two forms that
compute the same thing: chunked (training and prefill: a few matmuls per chunk) and recurrent (decode: one token per
step on a carried state). Issue 29: the family's layers build on these.

Stage: shared model code (the trainer's forward; the engine's prefill and decode).

Per value head, the state ``S`` is a [d_k, d_v] matrix. Token ``t`` (query ``q_t``, key ``k_t``, both L2-normalised,
the query scaled by d_k^-0.5; value ``v_t``; log-decay ``g_t <= 0``; write strength ``beta_t`` in (0, 1)):

    S <- exp(g_t) S                                  (decay)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T           (delta rule: write the part of v_t that S does not predict)
    o_t = S^T q_t

Chunked form. Inside a chunk of C tokens with cumulative log-decay ``G_i = g_1 + ... + g_i`` and the state ``S0``
at its start, the state after token i is ``exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j u_j^T`` for the written values
``u_j``. Substituting it into the rule gives the lower-triangular system ``(I + A) U = diag(beta) V -
diag(beta exp(G)) K S0`` with ``A_ij = beta_i exp(G_i - G_j) k_i . k_j`` for j < i, solved for U once per chunk;
then ``O = diag(exp(G)) Q S0 + (L o Q K^T) U`` with ``L_ij = exp(G_i - G_j)`` for j <= i, and the state passed on is
``exp(G_C) S0 + (K o exp(G_C - G))^T U``. Everything runs in float32 whatever the input dtype; outputs take the
input's dtype.

Grouped heads: a query/key head serves ``n_v // n_k`` consecutive value heads (as transformers' ``repeat_interleave``).

Shapes: tensors are [B, T, heads, dim] (q, k: n_k heads of d_k; v: n_v heads of d_v), g and beta [B, T, n_v], the
state [B, n_v, d_k, d_v]. A packed batch (several sequences in one row) runs sequence by sequence
(:func:`gated_delta_packed`): the state starts from zero (or the given state) at each sequence's first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the normalisation FLA's kernels apply to q and k)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """float32, heads first ([B, n_v, T, d]), q and k normalised and expanded to the value heads, q scaled."""
    n_k, n_v = k.shape[2], v.shape[2]
    if n_v % n_k:
        raise ValueError(f"value heads ({n_v}) must be a multiple of key heads ({n_k})")
    if n_v != n_k:
        q, k = (x.repeat_interleave(n_v // n_k, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    q, k = l2_normalize(q), l2_normalize(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g.transpose(1, 2).float(), beta.transpose(1, 2).float()


def _initial(state: torch.Tensor | None, q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if state is not None:
        return state.float()
    return q.new_zeros(q.shape[0], q.shape[1], q.shape[-1], v.shape[-1])


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token (the decode form; any T): (outputs [B, T, n_v, d_v], final state)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = _initial(state, q, v)
    out = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])
        write = beta[:, :, t, None] * (v[:, :, t] - predicted)
        s = s + k[:, :, t, :, None] * write[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    o = torch.stack(out, dim=2) if out else v.new_zeros(v.shape)
    return o.transpose(1, 2).to(dtype), s


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule a chunk at a time (module docstring): (outputs [B, T, n_v, d_v], final state)."""
    dtype, length = v.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = _initial(state, q, v)
    pad = (-length) % chunk
    if pad:  # padded tokens: no decay (g 0), no write (beta 0), outputs dropped
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    b, h, total, dk = q.shape
    n = total // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    cum = g.reshape(b, h, n, chunk).cumsum(-1)  # G_i inside each chunk
    beta = beta.reshape(b, h, n, chunk)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) where j <= i, else 0 (masked before exp: above the diagonal the difference is positive)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a = (beta[..., :, None] * decay * kk).tril(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    lower = eye + a  # (I + A): unit lower triangular
    rhs_v = beta[..., None] * v  # diag(beta) V
    rhs_k = (beta * cum.exp())[..., None] * k  # diag(beta exp(G)) K: multiplies S0
    w = torch.linalg.solve_triangular(lower, rhs_v, upper=False, unitriangular=True)
    kd = torch.linalg.solve_triangular(lower, rhs_k, upper=False, unitriangular=True)
    attn = decay * (q @ k.transpose(-1, -2))  # L o Q K^T
    q_decayed = cum.exp()[..., None] * q
    k_to_end = (cum[..., -1:] - cum).exp()[..., None] * k
    outs = []
    for c in range(n):
        u = w[:, :, c] - kd[:, :, c] @ s
        outs.append(q_decayed[:, :, c] @ s + attn[:, :, c] @ u)
        s = cum[:, :, c, -1, None, None].exp() * s + k_to_end[:, :, c].transpose(-1, -2) @ u
    o = torch.cat(outs, dim=2)[:, :, :length]
    return o.transpose(1, 2).to(dtype), s


def gated_delta_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: Sequence[int],
    states: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One packed row ([1, T, ...], sequences of ``lengths`` back to back, summing to T): each sequence from its own
    state (``states`` [len(lengths), n_v, d_k, d_v], or zeros), never from the previous sequence's. Returns the
    outputs [1, T, n_v, d_v] and each sequence's final state."""
    if sum(lengths) != q.shape[1] or q.shape[0] != 1:
        raise ValueError(f"a packed row [1, T] of sequences summing to T: got {tuple(q.shape[:2])}, {list(lengths)}")
    outs, finals, start = [], [], 0
    for i, n in enumerate(lengths):
        part = slice(start, start + n)
        init = None if states is None else states[i : i + 1]
        o, s = gated_delta_chunked(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], init, chunk)
        outs.append(o)
        finals.append(s)
        start += n
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution (plus ``bias``) then ``act`` (SiLU; Gated DeltaNet: its config's hidden_act),
    the short convolution of Gated DeltaNet and Mamba-2 layers: ``x`` [B, T, C], ``weight`` [C, W]; ``state`` [B, C, W - 1]: the inputs before ``x`` (zeros when None: a
    sequence's start). Returns the output [B, T, C] and the new state (the last W - 1 inputs), so a prefill then
    token-by-token decode equals one pass."""
    width = weight.shape[-1]
    xt = x.transpose(1, 2)
    if state is None:
        state = xt.new_zeros(xt.shape[0], xt.shape[1], width - 1)
    full = torch.cat([state.to(xt.dtype), xt], dim=-1)
    out = F.conv1d(full, weight[:, None, :].to(xt.dtype), None if bias is None else bias.to(xt.dtype),
                   groups=xt.shape[1])  # fmt: skip
    return act(out).transpose(1, 2), full[..., full.shape[-1] - (width - 1) :]
