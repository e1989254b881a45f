"""How many drafts each request verifies: DeepSpec's confidence threshold, the survival threshold, and the token cap
that keeps the likeliest slots, always as per-row prefixes."""

import pytest
import torch

from dspark_serve.engine.drafter import DraftProposal
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.engine.verify_budget import _cap_tokens, num_to_verify


def _reqs(n: int, drafts: int = 4) -> list[Request]:
    return [Request(str(i), [1, 2], SamplingParams(max_tokens=50), seed=i, num_speculative_tokens=drafts)
            for i in range(n)]


def test_cap_keeps_the_likeliest_slots_as_prefixes():
    survival = torch.tensor([[0.9, 0.8, 0.3, 0.1], [0.95, 0.2, 0.1, 0.05], [0.5, 0.5, 0.5, 0.4]])
    assert _cap_tokens([4, 4, 4], survival, 5) == [2, 1, 2]  # 0.95 0.9 0.8 0.5 0.5
    assert _cap_tokens([4, 4, 4], survival, 100) == [4, 4, 4]
    assert _cap_tokens([1, 4, 0], survival, 3) == [1, 2, 0]  # 0.95, 0.9, then 0.2 (row 0 allows one draft)
    tied = torch.ones(2, 4)  # saturated confidences: earlier drafts first, never a gap inside a row
    assert _cap_tokens([4, 4], tied, 3) == [2, 1]
    assert _cap_tokens([3, 2, 4], None, 5) == [2, 2, 1]  # no confidence head: draft position first


def test_num_to_verify_applies_the_cap_only_when_it_binds():
    spec = SpeculativeConfig(dspark_max_verify_tokens=6)
    reqs = _reqs(3)
    logits = torch.tensor([[3.0, 2.0, -1.0, -2.0], [4.0, -3.0, -3.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    prop = DraftProposal(tokens=torch.zeros(3, 4, dtype=torch.int64), probs=None, confidence_logits=logits)
    n = num_to_verify(reqs, prop, spec, 4)
    assert sum(n) == 6 and n == [3, 1, 2]
    assert num_to_verify(reqs[:1], prop, spec, 4) == [4]  # one request wants 4 <= 6: untouched


def _deepspec_prefix(conf: list[float], threshold: float, block: int) -> int:
    """DeepSpec's rule over one block's recorded confidences: t <= 0 keeps the block, else it ends before the
    first position whose own confidence is below t."""
    if threshold <= 0.0:
        return block
    for k, c in enumerate(conf[:block]):
        if c < threshold:
            return k
    return block


# (threshold, confidence logits [R, N]) per step: seeded logits, and rows built for the edges
_G = torch.Generator().manual_seed(7)
_STEPS = [(t, torch.randn(6, 7, generator=_G) * 2.5 + 1.0) for t in (0.05, 0.2, 0.35, 0.5, 0.7, 0.9)] + [
    (0.6, torch.tensor([[-2.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0],  # the first position below: no draft
                        [3.0] * 7,  # all above: every draft
                        [0.0, 0.0, 0.0, -0.1, 5.0, 5.0, 5.0],  # c = 0.5 < 0.6 at once
                        [2.0, 2.0, 2.0, 2.0, 2.0, 2.0, -3.0],  # survival falls below 0.6 long before the cut
                        [4.0, -1.0, 4.0, 4.0, 4.0, 4.0, 4.0]])),  # confident again after the cut: still cut
    (0.5, torch.tensor([[0.0] * 7, [0.0, 0.0, -1e-3, 0.0, 0.0, 0.0, 0.0]])),  # c == t is confident
    (0.0, torch.tensor([[-30.0] * 7, [1.0] * 7])),  # threshold 0: every draft, however unconfident
    (1.0, torch.tensor([[30.0, 30.0, 5.0, 30.0, 30.0, 30.0, 30.0], [5.0] * 7])),  # 1: only saturated c_k == 1
]


@pytest.mark.parametrize("step", range(len(_STEPS)))
def test_confidence_threshold_verifies_deepspec_prefix(step):
    threshold, logits = _STEPS[step]
    reqs = _reqs(len(logits), drafts=7)
    prop = DraftProposal(tokens=torch.zeros(logits.shape, dtype=torch.int64), probs=None, confidence_logits=logits)
    recorded = torch.sigmoid(logits).tolist()  # the c_k DeepSpec compares, fp32 like its eval
    expected = [_deepspec_prefix(c, threshold, 7) for c in recorded]
    assert num_to_verify(reqs, prop, SpeculativeConfig(dspark_confidence_threshold=threshold), 7) == expected
    own = [(threshold, 0.0, 0.45, 1.0)[i % 4] for i in range(len(logits))]  # per-request overrides mean the same
    for r, t in zip(reqs, own):
        r.confidence_threshold = t
    assert num_to_verify(reqs, prop, SpeculativeConfig(dspark_confidence_threshold=0.3), 7) == \
        [_deepspec_prefix(c, t, 7) for c, t in zip(recorded, own)]
    caps = [min(i, 7) for i in range(len(logits))]  # a request's own cap, then the rule
    for r, c in zip(reqs, caps):
        r.num_speculative_tokens, r.confidence_threshold = c, None
    assert num_to_verify(reqs, prop, SpeculativeConfig(), 7) == caps
    assert num_to_verify(reqs, prop, SpeculativeConfig(dspark_confidence_threshold=threshold), 7) == \
        [min(a, b) for a, b in zip(caps, expected)]


def test_survival_threshold_verifies_while_the_product_holds():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.5, 3.0, 3.0], [0.0, 3.0, 3.0, 3.0]])
    # c_k: .73 .73 .73 .73 / .95 .62 .95 .95 / .5 .95 .95 .95; survival: .73 .53 .39 .29 / .95 .59 .56 .54 / .5 ..
    prop = DraftProposal(tokens=torch.zeros(3, 4, dtype=torch.int64), probs=None, confidence_logits=logits)
    assert num_to_verify(_reqs(3), prop, SpeculativeConfig(dspark_survival_threshold=0.5), 4) == [2, 4, 1]
    assert num_to_verify(_reqs(3), prop, SpeculativeConfig(dspark_confidence_threshold=0.7), 4) == [4, 1, 0]
    both = SpeculativeConfig(dspark_confidence_threshold=0.7, dspark_survival_threshold=0.5)
    assert num_to_verify(_reqs(3), prop, both, 4) == [2, 1, 0]  # each rule cuts; the shorter prefix wins
