"""RemoteDraft: the draft side as the verifier's step loop sees it when the draft lives in another actor."""

from __future__ import annotations

from dspark_serve.engine.drafter import DraftInput, DraftProposal, DraftUnavailable

from .channel import VerifierEnd


class RemoteDraft:
    """An engine.drafter.Drafter, as engine.DraftSide is; the draft cache's block ids are the verifier's
    KVCacheManager's and travel in each DraftInput, the cache itself lives with the draft."""

    def __init__(self, end: VerifierEnd, num_speculative_tokens: int, query_len: int, num_blocks: int,
                 block_size: int, has_confidence: bool = True) -> None:
        self.end, self.num_speculative_tokens, self.query_len = end, num_speculative_tokens, query_len
        self.has_confidence = has_confidence
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = end.device  # with NCCL the executor asks for the next draft ahead (engine/core/pipeline.py)

    def propose(self, inp: DraftInput) -> DraftProposal:
        try:
            return self.end.propose(inp)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as a RuntimeError
            raise DraftUnavailable(f"the draft actor stopped answering: {e}") from e

