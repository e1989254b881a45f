"""How many drafts each request verifies: the token cap keeps the likeliest slots, always as per-row prefixes."""

import torch

from dspark_serve.engine.draft_side import DraftProposal
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
