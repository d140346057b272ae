"""Per-token log-probs and entropy from logits (`token_logprobs`, `LogProbEntropy`): the chunked float32 math
equals the plain log_softmax formulation in value and gradient, chunk boundaries included."""

from __future__ import annotations

import pytest
import torch

import miles_hpc.train.logprobs as lpmod
from miles_hpc.train.batch import TrainBatch
from miles_hpc.train.logprobs import LogProbEntropy, pack_samples, token_logprobs


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lpmod, "CHUNK_ELEMENTS", 3 * 11)  # 3 rows per chunk at vocab 11: several chunks + a tail


def test_chunk_plan_covers_rows_once() -> None:
    for n, vocab in [(0, 5), (1, 5), (10, 1 << 30), (1000, 152_000)]:
        spans = lpmod._chunks(n, vocab)
        assert [i for a, b in spans for i in range(a, b)] == list(range(n))


@pytest.mark.usefixtures("small_chunks")
def test_gradients_match_finite_differences() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 11, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=g)
    assert torch.autograd.gradcheck(lambda z: LogProbEntropy.apply(z, t, True), (z,))
    assert torch.autograd.gradcheck(lambda z: LogProbEntropy.apply(z, t, False)[0], (z,))


@pytest.mark.usefixtures("small_chunks")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_plain_log_softmax(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 11, (n,), generator=g).tolist() for n in (4, 1, 6)]
    batch = TrainBatch(
        tokens=seqs,
        loss_mask=[[1] * len(s) for s in seqs],
        rollout_logprobs=[[0.0] * len(s) for s in seqs],
        advantages=[[1.0] * len(s) for s in seqs],
        token_hash=["" for _ in seqs],
    )
    mb = pack_samples(batch, [0, 1, 2], torch.device("cpu"))
    logits = torch.randn(1, mb.num_tokens, 11, generator=g).to(dtype).requires_grad_()
    w_lp, w_ent = torch.randn(mb.num_tokens, generator=g), torch.randn(mb.num_tokens, generator=g)

    lp, ent = token_logprobs(logits, mb, with_entropy=True)
    assert ent is not None
    (lp * w_lp + ent * w_ent).sum().backward()
    got_grad, logits.grad = logits.grad, None

    # The plain formulation: float32 log_softmax of rows t-1, gathered at token t, 0 at sequence starts.
    logp = torch.log_softmax(logits[0, :-1].float(), -1)
    ref_lp = torch.cat([logp.new_zeros(1), logp.gather(1, mb.input_ids[0, 1:, None])[:, 0]])
    ref_ent = torch.cat([logp.new_zeros(1), -(logp.exp() * logp).sum(-1)])
    ref_lp, ref_ent = (x.masked_fill(mb.is_start, 0.0) for x in (ref_lp, ref_ent))
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()

    assert lp.dtype == torch.float32 and lp[mb.is_start].eq(0).all() and ent[mb.is_start].eq(0).all()
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is stored in the logits' dtype
    torch.testing.assert_close(got_grad, logits.grad, rtol=tol, atol=tol)


def test_entropy_as_metric_only_has_no_grad() -> None:
    batch = TrainBatch(
        tokens=[[1, 2, 3]], loss_mask=[[1, 1, 1]], rollout_logprobs=[[0.0] * 3], advantages=[[1.0] * 3], token_hash=[""]
    )
    mb = pack_samples(batch, [0], torch.device("cpu"))
    logits = torch.randn(1, 3, 5, requires_grad=True)
    lp, ent = token_logprobs(logits, mb, with_entropy=True, entropy_grad=False)
    assert lp.requires_grad and ent is not None and not ent.requires_grad
    lp, ent = token_logprobs(logits, mb, with_entropy=False)
    assert ent is None


INTERPRETED = """
import torch
from miles_hpc.train import logprob_kernels, logprobs as lpmod
torch.set_num_threads(1)
g = torch.Generator().manual_seed(3)
n, vocab = 40, 10_007  # a vocabulary that is no multiple of the kernel's block
logits = 4 * torch.randn(n, vocab, generator=g)  # float32: the interpreter's bf16 rounding is not the GPU's
target = torch.randint(0, vocab, (n,), generator=g)
g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
for with_entropy in (False, True):
    got = logprob_kernels.forward(logits, target, with_entropy)
    want = lpmod._forward_torch(logits, target, with_entropy)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    lse, _, ent = want
    g_e = g_ent if with_entropy else None
    grad = logprob_kernels.backward(logits, target, lse, ent, g_lp, g_e)
    torch.testing.assert_close(grad, lpmod._backward_torch(logits, target, lse, ent, g_lp, g_e), rtol=1e-4,
                               atol=1e-6)
print("ok")
"""


@pytest.mark.process
def test_triton_kernels_in_the_interpreter() -> None:
    """The kernels' logic on CPU tensors in Triton's interpreter (CI has no GPU); the GPU test below checks them
    compiled, in bf16."""
    from conftest import run_interpreted

    run_interpreted(INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("with_entropy", [False, True])
def test_triton_kernels_match_torch_path(with_entropy: bool) -> None:
    from miles_hpc.train import logprob_kernels

    g = torch.Generator(device="cuda").manual_seed(3)
    n, vocab = 300, 10_007  # a vocabulary that is no multiple of the kernel's block
    logits = (4 * torch.randn(n, vocab, device="cuda", generator=g)).to(torch.bfloat16)
    target = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g) if with_entropy else None
    got = logprob_kernels.forward(logits, target, with_entropy)
    want = lpmod._forward_torch(logits, target, with_entropy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    lse, _, ent = want
    grad = logprob_kernels.backward(logits, target, lse, ent, g_lp, g_ent)
    ref = lpmod._backward_torch(logits, target, lse, ent, g_lp, g_ent)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref.float(), rtol=1e-2, atol=1e-5)
