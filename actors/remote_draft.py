"""RemoteDraft: the draft side as the verifier's step loop sees it when the draft lives in another actor."""

from __future__ import annotations

from dspark_serve.engine.draft_side import DraftInput, DraftProposal, DraftUnavailable
from dspark_serve.engine.kv_cache import BlockAllocator

from .channel import VerifierEnd


class RemoteDraft:
    """Same surface as engine.DraftSide for the scheduler and spec_step; the draft cache's block ids are
    bookkept here and travel in each DraftInput, the cache itself lives with the draft."""

    def __init__(self, end: VerifierEnd, num_speculative_tokens: int, query_len: int, num_blocks: int,
                 block_size: int) -> None:
        self.end, self.num_speculative_tokens, self.query_len = end, num_speculative_tokens, query_len
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.device = end.device
        # As DraftSide: the next step's draft is asked for right after this step's accept, so that the step launched
        # ahead (its verify) runs on the device while the host does this step's bookkeeping (engine/spec_step.py)
        self.draft_ahead = self.device.type == "cuda"
        self.ahead = None

    def propose(self, inp: DraftInput) -> DraftProposal:
        try:
            return self.end.propose(inp)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as a RuntimeError
            raise DraftUnavailable(f"the draft actor stopped answering: {e}") from e
