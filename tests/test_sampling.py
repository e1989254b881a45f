"""Keyed randomness, the processed target distribution, Gumbel-max sampling and SamplingParams checks."""

import math

import pytest
import torch

from dspark_serve.engine import sampling as S
from dspark_serve.engine.sampling_params import SamplingParams

M64 = (1 << 64) - 1
GAMMA, M1, M2, SEED_KEY = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD1B54A32D192ED03


def _py_mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * M1) & M64
    z = ((z ^ (z >> 27)) * M2) & M64
    return z ^ (z >> 31)


def _py_uniform(seed: int, pos: int, salt: int) -> float:
    h = _py_mix((seed & M64) ^ SEED_KEY)
    h = _py_mix((h + salt * GAMMA) & M64)
    h = _py_mix((h + pos * GAMMA) & M64)
    return ((h >> 41) + 0.5) * 2.0**-23


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def test_mixer_matches_splitmix64_known_answer():
    # splitmix64 seeded with 0: the first output is mix(GAMMA).
    got = S._mix64(torch.tensor([_signed(GAMMA)])).item()
    assert got & M64 == 0xE220A8397B1DCDAF


@pytest.mark.parametrize("seed", [0, 1, 12345, -7, (1 << 63) - 1, -(1 << 63)])
def test_keyed_uniform_matches_unsigned_python(seed):
    positions = [0, 1, 2**31 + 5, 2**40]
    got = S.keyed_uniform(torch.tensor([seed]), torch.tensor([positions]), S.VERIFY_SALT)[0].tolist()
    assert got == [_py_uniform(seed, p, S.VERIFY_SALT) for p in positions]


def test_keyed_values_ignore_batch_composition():
    seeds = torch.tensor([3, 99, 3, 3, 2**40])
    positions = torch.tensor([[0, 7], [1, 2], [5, 6], [7, 0], [9, 10]])
    u = S.keyed_uniform(seeds, positions, S.DRAFT_SALT)
    perm = torch.tensor([4, 2, 0, 3, 1])
    assert torch.equal(S.keyed_uniform(seeds[perm], positions[perm], S.DRAFT_SALT), u[perm])
    assert torch.equal(S.keyed_uniform(seeds[1:2], positions[1:2], S.DRAFT_SALT), u[1:2])
    assert u[3, 0] == u[0, 1] and u[3, 1] == u[0, 0]  # the same key in another row
    g = S.keyed_gumbel(seeds, positions, 11, S.BONUS_SALT)
    assert torch.equal(S.keyed_gumbel(seeds[perm], positions[perm], 11, S.BONUS_SALT), g[perm])
    assert torch.equal(S.keyed_gumbel(seeds, positions, 5, S.BONUS_SALT), g[..., :5])  # keyed by token id


def test_salts_are_distinct_and_uncorrelated():
    salts = [S.DRAFT_SALT, S.VERIFY_SALT, S.RESAMPLE_SALT, S.BONUS_SALT]
    assert S.DRAFT_SALT == 1 << 30 and len(set(salts)) == 4
    seeds = torch.arange(100).repeat_interleave(100)
    positions = torch.arange(100).repeat(100)[:, None]  # 10000 distinct (seed, position) keys
    draws = torch.stack([S.keyed_uniform(seeds, positions, s)[:, 0] for s in salts])
    corr = torch.corrcoef(draws)
    off_diag = corr[~torch.eye(4, dtype=torch.bool)]
    assert off_diag.abs().max() < 0.05
    # Neighbouring positions and seeds are uncorrelated too.
    u = draws[0].view(100, 100)
    assert torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].abs() < 0.05
    assert torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].abs() < 0.05


def test_uniform_and_gumbel_moments():
    n = 20000
    u = S.keyed_uniform(torch.arange(n), torch.full((n, 1), 17), S.VERIFY_SALT)[:, 0].double()
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    assert abs((u < 0.1).double().mean().item() - 0.1) < 5 * math.sqrt(0.09 / n)
    g = S.keyed_gumbel(torch.arange(200), torch.zeros(200, 1, dtype=torch.long), 100, 0).double().flatten()
    assert abs(g.mean().item() - 0.5772157) < 5 * math.sqrt(math.pi**2 / 6 / g.numel())
    assert abs(g.var().item() - math.pi**2 / 6) < 0.1


def test_sample_from_probs_frequencies_and_zeros():
    n = 20000
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0]).expand(n, 1, 5)
    tokens = S.sample_from_probs(probs, torch.arange(n), torch.full((n, 1), 3), S.DRAFT_SALT)[:, 0]
    counts = torch.bincount(tokens, minlength=5).double() / n
    assert counts[1] == 0 and counts[4] == 0
    for tok in (0, 2, 3):
        p = probs[0, 0, tok].item()
        assert abs(counts[tok].item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    unnormalized = S.sample_from_probs(probs * 7, torch.arange(n), torch.full((n, 1), 3), S.DRAFT_SALT)[:, 0]
    assert torch.equal(unnormalized, tokens)


def _ref_processed(logits: list[float], t: float, k: int, top_p: float, min_p: float) -> list[float]:
    """A slow one-row reference, in float64."""
    z = [x / t for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if k > 0:
        order = order[:k]
    w = {i: math.exp(z[i] - z[order[0]]) for i in order}
    total = sum(w.values())
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += w[i] / total
        if mass >= top_p:
            break
    kept = [i for i in kept if w[i] >= min_p * w[order[0]]]
    total = sum(w[i] for i in kept)
    return [w[i] / total if i in kept else 0.0 for i in range(len(z))]


def test_processed_probs_hand_case():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(5, 1, 4)  # p = [0.5, 0.3, 0.15, 0.05]
    p = S.processed_probs(
        logits,
        temperature=torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0]),
        top_k=torch.tensor([0, 1, 0, 0, 3]),
        top_p=torch.tensor([1.0, 1.0, 0.75, 1e-6, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.5]),
    )[:, 0]
    expected = [[0.5, 0.3, 0.15, 0.05], [1, 0, 0, 0], [0.625, 0.375, 0, 0], [1, 0, 0, 0], [0.625, 0.375, 0, 0]]
    torch.testing.assert_close(p, torch.tensor(expected), atol=1e-6, rtol=0)


def test_processed_probs_matches_reference_per_row():
    gen = torch.Generator().manual_seed(0)
    rows = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (1.0, 0, 1.0, 0.1),
            (0.5, 8, 0.9, 0.05), (2.0, 30, 0.5, 0.2), (1.0, 1, 1.0, 0.0), (0.9, 100, 0.95, 0.0)]
    logits = torch.randn(len(rows), 3, 20, generator=gen) * 2
    t, k, top_p, min_p = (torch.tensor(col) for col in zip(*rows))
    p = S.processed_probs(logits, t, k, top_p, min_p)  # [R, 3, V]
    assert torch.allclose(p.sum(-1), torch.ones(len(rows), 3))
    for r, params in enumerate(rows):
        for i in range(3):
            ref = torch.tensor(_ref_processed(logits[r, i].tolist(), *params))
            torch.testing.assert_close(p[r, i], ref, atol=2e-6, rtol=0)


def test_processed_probs_greedy_row_is_finite():
    p = S.processed_probs(torch.randn(2, 2, 7), torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long),
                          torch.ones(2), torch.zeros(2))
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(top_p=float("nan")), "top_p must be in (0, 1], got nan"),
    (dict(top_k=-1), "top_k must be >= 0 (0 disables it), got -1"),
    (dict(top_k=2.5), "top_k must be >= 0 (0 disables it), got 2.5"),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    (dict(min_p=1.1), "min_p must be in [0, 1], got 1.1"),
    (dict(seed=1 << 64), "seed must be None or a 64-bit signed integer"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=5000), "max_tokens must be <= 4096 (the server limit), got 5000"),
    (dict(stop=["x"]), "stop must be a tuple of non-empty strings"),
    (dict(stop=("",)), "stop must be a tuple of non-empty strings"),
    (dict(stop_token_ids=(1, -2)), "stop_token_ids must be a tuple of ints >= 0"),
    (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
])
def test_validate_names_the_bad_field(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs).validate(max_tokens_limit=4096)
    assert str(e.value).startswith(message)


def test_validate_accepts_good_params_and_greedy_threshold():
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, top_k=50, min_p=1, seed=-3, max_tokens=4096,
                   stop=("\n",), stop_token_ids=(0, 2), ignore_eos=True).validate(max_tokens_limit=4096)
    SamplingParams(max_tokens=10**6).validate()  # no limit given
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=5e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy and not SamplingParams().is_greedy


def test_processed_probs_row_paths_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 50, generator=g, dtype=torch.float64)
    t = torch.tensor([0.7, 1.3, 0.9], dtype=torch.float64)
    k, top_p, min_p = torch.tensor([0, 5, 0]), torch.tensor([1.0, 1.0, 0.8]), torch.tensor([0.0, 0.0, 0.0])
    mixed = S.processed_probs(logits, t, k, top_p, min_p, filtered_rows=[1, 2])
    full = S.processed_probs(logits, t, k, top_p, min_p)  # every row through the sort
    assert torch.allclose(mixed, full, atol=1e-12)
    assert torch.equal(mixed[0], torch.softmax(logits[0].float() / t[0].float(), -1))  # no sort for this row
    for i, rows in ((0, []), (1, [0]), (2, [0])):  # each row alone gives the bits it had in the batch
        alone = S.processed_probs(logits[i:i + 1], t[i:i + 1], k[i:i + 1], top_p[i:i + 1], min_p[i:i + 1],
                                  filtered_rows=rows)
        assert torch.equal(alone[0], mixed[i])
    assert (mixed[1] > 0).sum(-1).tolist() == [5, 5]
