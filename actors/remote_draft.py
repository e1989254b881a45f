"""RemoteDraft: the draft side as the verifier's step loop sees it when the draft lives in another actor."""

from __future__ import annotations

from torch import Tensor

from dspark_serve.engine.drafter import DraftInput, DraftProposal, DraftUnavailable
from dspark_serve.engine.kv_cache import BlockAllocator

from .channel import VerifierEnd


class RemoteDraft:
    """An engine.drafter.Drafter, as engine.DraftSide is; the draft cache's block ids are bookkept here and travel
    in each DraftInput, the cache itself lives with the draft."""

    def __init__(self, end: VerifierEnd, num_speculative_tokens: int, query_len: int, num_blocks: int,
                 block_size: int) -> None:
        self.end, self.num_speculative_tokens, self.query_len = end, num_speculative_tokens, query_len
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.device = end.device  # with NCCL the step pipeline asks for the next draft ahead (engine/step_pipeline.py)
        self.can_chain = False  # the draft cannot read an accept on the verifier's device

    def propose(self, inp: DraftInput) -> DraftProposal:
        try:
            return self.end.propose(inp)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as a RuntimeError
            raise DraftUnavailable(f"the draft actor stopped answering: {e}") from e

    def propose_chained(self, packed: Tensor, anchor_pos: list[int], n: list[int], tables: list[list[int]],
                        temperature: list[float], seeds: list[int], feats: list[Tensor]) -> DraftProposal | None:
        """Never staged here (can_chain is False): the accept it would read is on the verifier's device."""
        return None
