"""The top-k Markov walk: the reference against a dense walk over a -inf-filled vocab (the spec's formulation),
and the Triton kernel against the reference under the CPU interpreter (reruns itself with TRITON_INTERPRET=1)."""

import pytest
import torch

from dspark_serve.engine.sampling import DRAFT_SALT, keyed_gumbel, keyed_gumbel_at
from dspark_serve.kernels.markov_walk_ref import markov_walk_ref

from interpreter import INTERPRETED, rerun_under_interpreter

V_IN, V, RANK, H = 96, 80, 8, 16


def _case(num: int, n: int, k: int, seed: int, reduced: bool = False, conf: bool = True, sampled: bool = True):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(num, n, V, generator=g) * 3
    values, cand = base.topk(k, dim=-1)
    w2 = torch.randn(V, RANK, generator=g)
    w1 = torch.randn(V_IN, RANK, generator=g)
    d2t = (torch.randint(0, V_IN - V + 1, (V,), generator=g).sort().values if reduced else None)
    anchor = torch.randint(0, V_IN, (num,), generator=g)
    conf_base = torch.randn(num, n, generator=g) if conf else None
    conf_w = torch.randn(RANK, generator=g) if conf else None
    seeds, anchor_pos = torch.randint(0, 2**40, (num,), generator=g), torch.randint(0, 500, (num,), generator=g)
    positions = anchor_pos[:, None] + 1 + torch.arange(n)
    temperature = torch.rand(num, generator=g) + 0.3
    is_sampled = torch.arange(num) % 2 == 1 if sampled else torch.zeros(num, dtype=torch.bool)
    noise = keyed_gumbel_at(seeds, positions, cand, DRAFT_SALT) if sampled else None
    walk_args = (values, cand, w2[cand], w1, anchor, 0.7, d2t, conf_base, conf_w, noise, temperature, is_sampled)
    dense_args = (base, w2, w1, anchor, 0.7, d2t, k, seeds, positions, temperature, is_sampled, sampled)
    return walk_args, dense_args


def _dense_walk(base, w2, w1, anchor, scale, d2t, k, seeds, positions, temperature, is_sampled, sampled):
    """L = U + scale * W2 @ W1[prev], -inf outside topk(U, k); dense argmax (of L / T + noise on sampled rows)."""
    keep = torch.zeros_like(base, dtype=torch.bool).scatter_(-1, base.topk(k, dim=-1).indices, True)
    prev, out = anchor, []
    for j in range(base.shape[1]):
        logits = (base[:, j] + scale * w1[prev] @ w2.T).masked_fill(~keep[:, j], float("-inf"))  # [R, V]
        pick = logits.argmax(-1)
        if sampled:
            noise = keyed_gumbel(seeds, positions[:, j:j + 1], V, DRAFT_SALT)[:, 0]
            pick = torch.where(is_sampled, (logits / temperature[:, None] + noise).argmax(-1), pick)
        prev = pick + d2t[pick] if d2t is not None else pick
        out.append(prev)
    return torch.stack(out, 1)


@pytest.mark.parametrize("reduced", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_reference_walk_equals_the_dense_walk(reduced, sampled):
    walk_args, dense_args = _case(6, 5, 12, seed=1 + reduced + 2 * sampled, reduced=reduced, sampled=sampled)
    tokens, logits, conf = markov_walk_ref(*walk_args)
    assert tokens.tolist() == _dense_walk(*dense_args).tolist()
    values, cand, rows, w1, anchor, scale = walk_args[:6]
    prev = torch.cat([anchor[:, None], tokens[:, :-1]], 1)  # the chain: each step's W1 row comes from prev
    torch.testing.assert_close(logits, values + scale * torch.einsum("bnkr,bnr->bnk", rows, w1[prev]))
    torch.testing.assert_close(conf, walk_args[7] + w1[prev] @ walk_args[8])


def test_k_equal_to_vocab_is_the_unrestricted_walk():
    walk_args, dense_args = _case(4, 6, V, seed=9, sampled=True)
    assert markov_walk_ref(*walk_args)[0].tolist() == _dense_walk(*dense_args).tolist()


if not INTERPRETED:
    def test_markov_walk_kernel_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    from dspark_serve.kernels.markov_walk import markov_walk

    @pytest.mark.parametrize("num,n,k", [(1, 7, 64), (5, 3, 12), (3, 8, 80)])
    @pytest.mark.parametrize("reduced,conf,sampled", [(False, True, False), (True, True, True), (False, False, True)])
    def test_kernel_matches_reference(num, n, k, reduced, conf, sampled):
        walk_args, _ = _case(num, n, k, seed=num * 10 + k, reduced=reduced, conf=conf, sampled=sampled)
        got, ref = markov_walk(*walk_args), markov_walk_ref(*walk_args)
        assert got[0].tolist() == ref[0].tolist()
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
        if conf:
            torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-5)
        else:
            assert got[2] is None

    def test_kernel_bf16_rows():
        walk_args, _ = _case(2, 7, 16, seed=3)
        rows = walk_args[2].bfloat16()
        args = (*walk_args[:2], rows, walk_args[3].bfloat16(), *walk_args[4:])
        got, ref = markov_walk(*args), markov_walk_ref(*args)
        assert got[0].tolist() == ref[0].tolist()
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)


def test_the_draft_ranks_its_head_in_its_dtype_and_scales_only_the_candidates():
    """A bf16 draft with logit_scale 1.7: its top-k walk (the head ranked in bf16, the K values scaled) proposes what
    the reference walk over topk(U) of the fp32 scaled logits proposes: the same tokens, candidates and confidences."""
    import dataclasses

    from engine_pairs import build_pair
    from dspark_serve.engine.llm import LLM

    target, draft = build_pair(seed=6, vocab=256, block_size=4, markov_rank=8)
    draft.config = dataclasses.replace(draft.config, logit_scale=1.7)
    side = LLM(target.to(torch.bfloat16), draft.to(torch.bfloat16), {"dspark_draft_topk": 16}, device="cpu",
               block_size=8, num_kv_blocks=32).draft
    m, g = side.model, torch.Generator().manual_seed(1)
    hidden = torch.randn(5, side.num_speculative_tokens, m.fc.weight.shape[0], generator=g).to(torch.bfloat16)
    anchor, pos = torch.randint(0, 256, (5,), generator=g), torch.arange(5) * 7
    temperature, seeds = torch.tensor([0.0, 0.0, 0.9, 0.0, 1.2]), torch.arange(5) + 40
    head = m.head_logits(hidden)
    assert head.dtype == torch.bfloat16
    got = side.markov_walk(hidden, head, anchor, temperature, seeds, pos, True)
    values, cand = m.base_logits(hidden).topk(16, dim=-1)  # fp32, scaled, then ranked
    assert torch.equal(got.cand_ids.sort(-1).values, cand.sort(-1).values)  # bf16 has ties: compare as sets
    w2 = m.markov_head.markov_w2.weight[got.cand_ids]
    w1 = m.markov_head.markov_w1.weight
    proj, h = m.confidence_head.proj, hidden.shape[-1]
    conf_base = torch.nn.functional.linear(hidden.float(), proj.weight[:, :h].float(), proj.bias.float())[..., 0]
    greedy = temperature < 1e-5
    noise = keyed_gumbel_at(seeds, pos[:, None] + 1 + torch.arange(hidden.shape[1]), got.cand_ids, DRAFT_SALT)
    want = markov_walk_ref(m.base_logits(hidden).gather(-1, got.cand_ids), got.cand_ids, w2, w1, anchor, 1.7, None,
                           conf_base, proj.weight[0, h:].float(), noise, torch.where(greedy, 1.0, temperature),
                           ~greedy)
    assert torch.equal(got.tokens, want[0]) and torch.equal(got.confidence_logits, want[2])
    torch.testing.assert_close(got.cand_probs[2], torch.softmax(want[1][2] / 0.9, -1))  # q of a sampled row
