"""The fused distillation kernel (CE, L1, argmax and their gradient per row) against its PyTorch reference under
the CPU interpreter (reruns itself with TRITON_INTERPRET=1), and the training loss built on it."""

import pytest
import torch

from dspark_serve.kernels.distill_loss_ref import distill_rows_ref

from interpreter import INTERPRETED, rerun_under_interpreter


def _case(r: int, u: int, v: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(r, v, generator=g) * 4).to(dtype)
    t = (torch.randn(u, v, generator=g) * 4).to(dtype)
    row = torch.randint(0, u, (r,), generator=g)
    z[0] = t[row[0]]                                   # p == q everywhere: l1 = 0 and no L1 gradient
    z[1, 7] = z[1, 4000 % v] = z[1].max() + 1          # a tie for the argmax: the first index wins
    labels = torch.randint(0, v, (r,), generator=g)
    g_ce, g_l1 = torch.randn(r, generator=g), torch.randn(r, generator=g)
    return z, t, row, labels, g_ce, g_l1


def _run(fn, z, t, row, labels, g_ce, g_l1):
    z = z.clone().requires_grad_(True)
    ce, l1, top = fn(z, t, row, labels)
    ((ce * g_ce).sum() + (l1 * g_l1).sum()).backward()
    return ce.detach(), l1.detach(), top, z.grad


@pytest.mark.skipif(not INTERPRETED, reason="runs in a TRITON_INTERPRET=1 child (test_under_interpreter)")
@pytest.mark.parametrize("dtype,v", [(torch.float32, 5000), (torch.bfloat16, 4097), (torch.float32, 300)])
def test_fused_matches_reference(dtype, v):
    from dspark_serve.kernels.distill_loss import distill_rows
    case = _case(6, 4, v, dtype)
    ce, l1, top, grad = _run(distill_rows, *case)
    ce_r, l1_r, top_r, grad_r = _run(distill_rows_ref, *case)
    assert grad.dtype == dtype
    torch.testing.assert_close(ce, ce_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1, l1_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(top, top_r) and top[1] == 7
    assert l1[0] == 0
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad.float(), grad_r.float(), **tol)
    assert grad.float().abs().sum() > 0.1


@pytest.mark.skipif(not INTERPRETED, reason="runs in a TRITON_INTERPRET=1 child (test_under_interpreter)")
def test_fused_rejects_bad_shapes():
    from dspark_serve.kernels.distill_loss import distill_rows
    z, t, row, labels, _, _ = _case(3, 2, 50, torch.float32)
    with pytest.raises(ValueError, match=r"\[U, V\]"):
        distill_rows(z, t[:, :49], row, labels)
    with pytest.raises(ValueError, match="target_row and labels"):
        distill_rows(z, t, row[:2], labels)


def test_reference_gradient_is_the_closed_form():
    """d ce / dz = p - onehot(label); d l1 / dz = p * (s - sum s p), s = sign(p - q): what the kernel computes."""
    z, t, row, labels, g_ce, g_l1 = _case(5, 3, 40, torch.float64, seed=3)
    _, _, _, grad = _run(distill_rows_ref, z, t, row, labels, g_ce, g_l1)
    p, q = z.softmax(-1), t[row].softmax(-1)
    s = torch.sign(p - q)
    want = g_ce[:, None] * (p - torch.nn.functional.one_hot(labels, 40)) \
        + g_l1[:, None] * p * (s - (s * p).sum(-1, keepdim=True))
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-7)


def test_under_interpreter():
    if INTERPRETED:
        pytest.skip("already interpreted")
    rerun_under_interpreter(__file__)
