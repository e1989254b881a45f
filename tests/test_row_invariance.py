"""The deterministic mode's ops, row by row: a row's hidden state, K/V, logits and sampled token are bit-equal whether
it runs alone or among M = 7, 8, 16, 64 rows, and a prompt prefilled in one chunk leaves the cache and the next-token
logits that decoding it token by token does. The default path is shown not to be (so these tests can fail)."""

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine.kv_cache import batch_metadata, positions_of
from dspark_serve.engine.rejection import coupled_tokens
from dspark_serve.engine.runner.target_runner import TargetRunner
from dspark_serve.kernels.config import KernelConfig

BLOCK = 4
SIZES = (1, 7, 8, 16, 64)


def _runner(dtype, deterministic):
    target, _ = build_pair(seed=11, dtype=dtype)
    return TargetRunner(target, KernelConfig(triton=False), deterministic), target


def _probe(runner, target, m: int, probe_first: bool, dev: str = "cpu"):
    """The probe sequence's row (position 20, its context prefilled) in a step of m rows whose other m - 1 are a
    prompt chunk of another sequence -> (hidden, logits, the probe's K/V of every layer)."""
    g = torch.Generator().manual_seed(1)
    cache = target.allocate_kv_cache(64, BLOCK)
    ctx = torch.randint(0, 255, (21,), generator=g).to(dev)
    probe_blocks = list(range(6))
    meta = batch_metadata([probe_blocks], [0], [20], BLOCK, torch.device(dev))
    runner.forward(ctx[:20], positions_of([0], [20], dev), meta, cache)
    filler = torch.randint(0, 255, (m - 1,), generator=g).to(dev)
    filler_blocks = list(range(6, 6 + -(-m // BLOCK)))
    seqs = [(probe_blocks, 20, ctx[20:]), (filler_blocks, 0, filler)]
    if not probe_first:
        seqs.reverse()
    seqs = [s for s in seqs if len(s[2])]
    meta = batch_metadata([s[0] for s in seqs], [s[1] for s in seqs], [len(s[2]) for s in seqs], BLOCK, dev)
    ids = torch.cat([s[2] for s in seqs])
    hidden, _ = runner.forward(ids, positions_of([s[1] for s in seqs], [len(s[2]) for s in seqs], dev), meta,
                               cache)
    row = 0 if probe_first else m - 1
    logits = runner.compute_logits(hidden)[row]
    slot = probe_blocks[20 // BLOCK] * BLOCK + 20 % BLOCK
    return hidden[row], logits, cache[:, :, slot // BLOCK, slot % BLOCK].clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_is_bit_equal_at_every_batch_size(dtype):
    check_row_invariance(*_runner(dtype, True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_path_is_not_row_invariant(dtype):
    """The batched path a row takes without the mode: its result changes with the batch (fp32: M = 1 runs another
    product than M > 1; bf16: at M = 64 the prompt chunk's attention and products)."""
    runner, target = _runner(dtype, False)
    alone = _probe(runner, target, 1, True)
    differ = [m for m in SIZES[1:] if not torch.equal(_probe(runner, target, m, True)[1], alone[1])]
    assert differ, "the default path gave the probe row bit-equal logits at every batch size"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_equals_decoding_token_by_token(dtype):
    check_prefill_equals_decoding(*_runner(dtype, True))


def check_prefill_equals_decoding(runner, target, dev: str = "cpu"):
    """One 23-token prompt prefilled whole, token by token and in chunks of 5, 16, 2: the same cache and last
    logits."""
    prompt = torch.randint(0, 255, (23,), generator=torch.Generator().manual_seed(2)).to(dev)
    caches, last = [], []
    for chunks in ([23], [1] * 23, [5, 16, 2]):
        cache = target.allocate_kv_cache(8, BLOCK)
        start = 0
        for n in chunks:
            meta = batch_metadata([list(range(6))], [start], [n], BLOCK, dev)
            hidden, _ = runner.forward(prompt[start:start + n], positions_of([start], [n], dev), meta, cache)
            start += n
        caches.append(cache)
        last.append(runner.compute_logits(hidden[-1:]))
    for chunks, cache, logits in zip(("one token a chunk", "5, 16, 2"), caches[1:], last[1:]):
        assert torch.equal(cache, caches[0]) and torch.equal(logits, last[0]), chunks


def check_row_invariance(runner, target, dev: str = "cpu"):
    alone = _probe(runner, target, 1, True, dev)
    for m in SIZES[1:]:
        for first in (True, False):
            got = _probe(runner, target, m, first, dev)
            for name, a, b in zip(("hidden", "logits", "kv"), alone, got):
                assert torch.equal(a, b), (m, first, name, (a.float() - b.float()).abs().max().item())


def test_coupled_tokens_are_row_invariant():
    """A sampled slot's token depends on its own logits, parameters, seed and position only: the same at every
    number of rows and slots, with greedy, filtered and plain rows beside it."""
    g = torch.Generator().manual_seed(3)
    vocab = 256
    probe = torch.randn(1, 1, vocab, generator=g) * 3

    def tokens(m: int, slots: int, at: int) -> int:
        logits = torch.randn(m, slots, vocab, generator=g) * 3
        logits[at, slots - 1] = probe[0, 0]
        temp = torch.rand(m, generator=g) + 0.5
        top_k = torch.randint(0, 20, (m,), generator=g)
        greedy = torch.rand(m, generator=g) < 0.3
        temp[at], top_k[at], greedy[at] = 0.9, 0, False
        seeds = torch.randint(0, 1 << 40, (m,), generator=g)
        seeds[at] = 77
        pos = torch.randint(0, 100, (m, 1), generator=g) + torch.arange(slots)
        pos[at] = torch.arange(slots) + 40 - (slots - 1)
        filtered = [i for i in range(m) if top_k[i] > 0]
        ids = coupled_tokens(logits, greedy, temp, top_k, torch.ones(m), torch.zeros(m), seeds, pos, filtered)
        return int(ids[at, slots - 1])

    alone = tokens(1, 1, 0)
    for m in SIZES[1:]:
        for slots in (1, 8):
            assert tokens(m, slots, m // 2) == alone, (m, slots)


@pytest.mark.parametrize("top_k,rows", [(0, 4000), (3, 1500)])
def test_coupled_tokens_are_samples_of_p(top_k, rows):
    """Over many (seed, position) keys a sampled slot's coupled token follows softmax(logits / T), renormalized over
    the top k when filtered (chi-square below 24.3: p = 0.001 at 7 degrees of freedom, looser at the filter's 2)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    temp = 0.8
    p = (logits / temp).softmax(-1)
    if top_k:
        p[top_k:] = 0
        p /= p.sum()
    ids = coupled_tokens(logits.expand(rows, 1, -1), torch.zeros(rows, dtype=torch.bool), torch.full((rows,), temp),
                         torch.full((rows,), top_k), torch.ones(rows), torch.zeros(rows), torch.arange(rows) * 7919,
                         torch.arange(rows)[:, None] % 97, list(range(rows)) if top_k else [])
    counts = torch.bincount(ids[:, 0], minlength=8).float()
    expected = p * rows
    seen = expected > 0
    assert counts[~seen].sum() == 0
    chi2 = float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())
    assert chi2 < 24.3, (chi2, counts.tolist(), expected.tolist())
