"""Verification: greedy hand cases, exact p/q cases, and chi-square tests that outputs follow the target's p."""

import math

import pytest
import torch

from dspark_serve.engine.rejection import verify_greedy, verify_mixed, verify_sampled
from dspark_serve.engine.sampling import DRAFT_SALT, processed_probs, sample_from_probs

N = 20000  # samples per statistical check


def _binomial_tol(p: float, n: int) -> float:
    return 5 * math.sqrt(max(p * (1 - p), 1e-4) / n)


def _chi2_pvalue(samples: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells with expected count < 5 are pooled into one."""
    n = samples.numel()
    observed = torch.bincount(samples, minlength=expected_probs.numel()).double()
    expected = expected_probs.double() * n
    assert observed[expected == 0].sum() == 0, "a zero-probability outcome was sampled"
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(obs.numel() - 1.0, dtype=torch.float64)
    return torch.special.gammaincc(df / 2, chi2 / 2).item()


def _sampled(draft, num_draft, q, p, seeds=None, positions=None):
    r, n = draft.shape
    seeds = torch.arange(r) if seeds is None else seeds
    positions = torch.arange(n + 1).expand(r, n + 1) + 100 if positions is None else positions
    return verify_sampled(draft, num_draft, q, p, seeds, positions)


def test_greedy_hand_cases():
    target_ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0], [4, 4, 0, 1], [2, 0, 0, 0], [3, 1, 1, 1]])
    logits = torch.nn.functional.one_hot(target_ids, 5).float() * 3 + torch.rand(5, 4, 5)
    draft = torch.tensor([[1, 2, 3], [1, 0, 3], [4, 4, -1], [-1, -1, -1], [0, 3, 3]])
    num_draft = torch.tensor([3, 3, 1, 0, 2])
    res = verify_greedy(draft, num_draft, logits)
    assert res.num_accepted.tolist() == [3, 1, 1, 0, 0]
    assert res.output_tokens.tolist() == [
        [1, 2, 3, 4],     # all accepted, bonus 4
        [1, 2, -1, -1],   # correction 2 at the first mismatch
        [4, 4, -1, -1],   # num_draft 1 caps acceptance although slot 1 would match; bonus from row 1
        [2, -1, -1, -1],  # nothing proposed: the target's token
        [3, -1, -1, -1],
    ]


def test_greedy_with_no_draft_slots():
    draft, num_draft = torch.zeros(2, 0, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    logits = torch.eye(3)[[2, 0]]
    res = verify_greedy(draft, num_draft, logits[:, None])
    assert res.num_accepted.tolist() == [0, 0] and res.output_tokens.tolist() == [[2], [0]]
    res = _sampled(draft, num_draft, None, logits[:, None])  # p one-hot: the bonus is certain
    assert res.num_accepted.tolist() == [0, 0] and res.output_tokens.tolist() == [[2], [0]]


def test_draft_where_target_has_zero_mass_is_always_rejected():
    p = torch.tensor([0.3, 0.0, 0.7]).expand(N, 2, 3)
    draft = torch.ones(N, 1, dtype=torch.long)  # q one-hot on token 1, which p never emits
    for q in (None, torch.nn.functional.one_hot(draft, 3).float()):
        res = _sampled(draft, torch.ones(N, dtype=torch.long), q, p)
        assert (res.num_accepted == 0).all()
        assert (res.output_tokens[:, 0] != 1).all() and (res.output_tokens[:, 1] == -1).all()


def test_p_equal_q_is_always_accepted():
    gen = torch.Generator().manual_seed(1)
    p = torch.rand(N, 4, 5, generator=gen).softmax(-1)
    draft = sample_from_probs(p[:, :3], torch.arange(N), torch.arange(3).expand(N, 3), DRAFT_SALT)
    res = _sampled(draft, torch.full((N,), 3), p[:, :3], p)
    assert (res.num_accepted == 3).all()
    assert torch.equal(res.output_tokens[:, :3], draft) and (res.output_tokens[:, 3] >= 0).all()


def test_empty_residual_falls_back_to_p():
    # An over-weighted q (not a distribution) rejects half the time and leaves no residual mass.
    p = torch.tensor([0.0, 1.0, 0.0]).expand(N, 2, 3)
    q = torch.tensor([0.0, 2.0, 0.0]).expand(N, 1, 3)
    res = _sampled(torch.ones(N, 1, dtype=torch.long), torch.ones(N, dtype=torch.long), q, p)
    assert abs((res.num_accepted == 0).double().mean().item() - 0.5) < _binomial_tol(0.5, N)
    assert (res.output_tokens[:, 0] == 1).all()


def test_acceptance_residual_and_bonus_match_theory():
    p0, q0 = torch.tensor([0.5, 0.2, 0.3, 0.0]), torch.tensor([0.2, 0.4, 0.1, 0.3])
    p1 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    draft = sample_from_probs(q0.expand(N, 1, 4), torch.arange(N), torch.full((N, 1), 100), DRAFT_SALT)
    res = _sampled(draft, torch.ones(N, dtype=torch.long), q0.expand(N, 1, 4), torch.stack([p0, p1]).expand(N, 2, 4))
    accepted = res.num_accepted == 1
    for tok in range(4):
        sel = draft[:, 0] == tok
        rate, expect = accepted[sel].double().mean().item(), min(1.0, (p0[tok] / q0[tok]).item())
        assert abs(rate - expect) < _binomial_tol(expect, int(sel.sum())), (tok, rate, expect)
    corrections = res.output_tokens[~accepted, 0]
    assert _chi2_pvalue(corrections, torch.tensor([0.6, 0.0, 0.4, 0.0])) > 1e-3  # normalize(max(p - q, 0))
    assert _chi2_pvalue(res.output_tokens[accepted, 1], p1) > 1e-3  # the bonus comes from p at row 1
    assert _chi2_pvalue(res.output_tokens[:, 0], p0) > 1e-3  # and the first token is exactly p


def test_none_draft_probs_equals_explicit_one_hot_and_padding_is_rejected():
    gen = torch.Generator().manual_seed(2)
    p = torch.rand(64, 4, 6, generator=gen).softmax(-1)
    draft = torch.randint(0, 6, (64, 3), generator=gen)
    draft[::4, 1] = -1  # padding inside the proposed range
    num_draft = torch.randint(0, 4, (64,), generator=gen)
    a = _sampled(draft, num_draft, None, p)
    b = _sampled(draft, num_draft, torch.nn.functional.one_hot(draft.clamp(min=0), 6).float(), p)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.output_tokens, b.output_tokens)
    assert (a.num_accepted <= num_draft).all() and (a.num_accepted[::4] <= 1).all()
    assert ((a.output_tokens >= 0).sum(1) == a.num_accepted + 1).all()


def test_sampled_verify_ignores_batch_order():
    gen = torch.Generator().manual_seed(3)
    p, q = torch.rand(32, 3, 5, generator=gen).softmax(-1), torch.rand(32, 2, 5, generator=gen).softmax(-1)
    draft, num_draft = torch.randint(0, 5, (32, 2), generator=gen), torch.full((32,), 2)
    seeds, positions = torch.randint(0, 1000, (32,), generator=gen), torch.randint(0, 500, (32, 3), generator=gen)
    res = verify_sampled(draft, num_draft, q, p, seeds, positions)
    perm = torch.randperm(32, generator=gen)
    again = verify_sampled(draft[perm], num_draft[perm], q[perm], p[perm], seeds[perm], positions[perm])
    assert torch.equal(again.output_tokens, res.output_tokens[perm])


def test_mixed_batch_routes_rows():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 3, 7, generator=gen)
    draft, num_draft = logits[:, :2].argmax(-1), torch.tensor([2, 1, 0, 2, 2, 1, 0, 2])
    draft[1::3, 0] = (draft[1::3, 0] + 1) % 7
    is_greedy = torch.tensor([True, False] * 4)
    t, k = torch.where(is_greedy, 0.0, 0.8), torch.tensor([0, 3] * 4)
    top_p, min_p = torch.full((8,), 0.9), torch.full((8,), 0.05)
    seeds, pos = torch.arange(8), torch.arange(3).expand(8, 3)
    res = verify_mixed(draft, num_draft, logits, None, is_greedy, t, k, top_p, min_p, seeds, pos)
    greedy = verify_greedy(draft, num_draft, logits)
    sampled = verify_sampled(draft, num_draft, None, processed_probs(logits, t, k, top_p, min_p), seeds, pos)
    g, s = is_greedy, ~is_greedy
    assert torch.equal(res.output_tokens[g], greedy.output_tokens[g])
    assert torch.equal(res.output_tokens[s], sampled.output_tokens[s])
    assert torch.equal(res.num_accepted[s], sampled.num_accepted[s])


# A toy autoregressive pair over V = 6: the target's logits and a different draft, conditioned on the prefix.
V = 6
_gen = torch.Generator().manual_seed(5)
T1, T2, T3 = torch.randn(V, generator=_gen), torch.randn(V, V, generator=_gen), torch.randn(V, V, V, generator=_gen)
D1, D2, D3 = (x + 1.2 * torch.randn(x.shape, generator=_gen) for x in (T1, T2, T3))


def _draft_q(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """q over [..., V]; with top_k, zero outside the k candidates (renormalized)."""
    if top_k:
        drop = logits < logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def _propose(qs, seeds, start, greedy_draft):
    """Draft tokens [R] at position start from q [R, V]; q becomes one-hot for greedy drafting."""
    if greedy_draft:
        tok = qs.argmax(-1)
        return tok, torch.nn.functional.one_hot(tok, V).float()
    return sample_from_probs(qs[:, None], seeds, torch.full((len(seeds), 1), start), DRAFT_SALT)[:, 0], qs


def _first_two_tokens(params, q_top_k=0, greedy_draft=False, seed_base=0):
    """Two speculative rounds (a second only where the first accepted nothing) -> tokens [R, 2]."""
    seeds = torch.arange(N) + seed_base
    t, k, top_p, min_p = (torch.full((N,), v) for v in params)
    is_greedy = torch.zeros(N, dtype=torch.bool)

    def verify(d, qrows, target_rows, start):
        n = d.shape[1]
        pos = torch.arange(start, start + n + 1).expand(N, n + 1)
        draft_probs = None if greedy_draft else torch.stack(qrows, 1)
        return verify_mixed(d, torch.full((N,), n), torch.stack(target_rows, 1), draft_probs, is_greedy,
                            t, k, top_p, min_p, seeds, pos)

    d0, q0 = _propose(_draft_q(D1, q_top_k).expand(N, V), seeds, 0, greedy_draft)
    d1, q1 = _propose(_draft_q(D2[d0], q_top_k), seeds, 1, greedy_draft)
    first = verify(torch.stack([d0, d1], 1), [q0, q1], [T1.expand(N, V), T2[d0], T3[d0, d1]], 0)
    x0 = first.output_tokens[:, 0]
    e1, r1 = _propose(_draft_q(D2[x0], q_top_k), seeds, 1, greedy_draft)  # reuses position 1's draft noise
    second = verify(e1[:, None], [r1], [T2[x0], T3[x0, e1]], 1)
    x1 = torch.where(first.num_accepted >= 1, first.output_tokens[:, 1], second.output_tokens[:, 0])
    return torch.stack([x0, x1], 1)


def _target_joint(params) -> tuple[torch.Tensor, torch.Tensor]:
    t, k, top_p, min_p = (torch.tensor([v]) for v in params)
    p1 = processed_probs(T1.view(1, 1, V), t, k, top_p, min_p)[0, 0]
    p2 = processed_probs(T2.view(1, V, V), t, k, top_p, min_p)[0]  # [V, V]: p(x1 | x0)
    return p1, (p1[:, None] * p2).flatten()


CASES = {
    "plain": dict(params=(1.0, 0, 1.0, 0.0)),
    "draft_top_k": dict(params=(1.0, 0, 1.0, 0.0), q_top_k=2),
    "processed_target": dict(params=(0.8, 4, 0.9, 0.05)),
    "processed_target_truncated_draft": dict(params=(1.3, 5, 0.85, 0.1), q_top_k=3),
    "greedy_draft": dict(params=(0.7, 0, 1.0, 0.0), greedy_draft=True),
}


@pytest.mark.parametrize("case", CASES)
def test_outputs_follow_the_target_distribution(case):
    kw = CASES[case]
    tokens = _first_two_tokens(**kw, seed_base=10**6 * len(case))
    p1, joint = _target_joint(kw["params"])
    assert _chi2_pvalue(tokens[:, 0], p1) > 1e-3
    assert _chi2_pvalue(tokens[:, 0] * V + tokens[:, 1], joint) > 1e-3


def test_chi_square_check_has_power():
    """The same check rejects the draft's own distribution and a p without its processing."""
    q = _draft_q(D1, 0).expand(N, 1, V)
    tokens = sample_from_probs(q, torch.arange(N), torch.zeros(N, 1, dtype=torch.long), DRAFT_SALT)[:, 0]
    assert _chi2_pvalue(tokens, T1.softmax(-1)) < 1e-3
    processed = _first_two_tokens((0.8, 4, 0.9, 0.05))
    assert _chi2_pvalue(processed[:, 0], T1.softmax(-1)) < 1e-3
