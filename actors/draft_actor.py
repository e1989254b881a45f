"""DraftActor: the draft model and its cache on its own device, answering one proposal per step over the channel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dspark_serve.engine.draft_side import DraftSide
from dspark_serve.engine.llm import context_limit
from dspark_serve.kernels.config import install as install_kernels
from dspark_serve.models.draft_config import DraftConfig
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.target_loader import load_target_heads

from .channel import DraftEnd
from .placement_env import actor_device, set_cpu_threads

if TYPE_CHECKING:  # the annotation only: actors do not import the cluster layer
    from .pair_config import PairConfig


class DraftActor:
    def __init__(self, cfg: PairConfig) -> None:
        engine = cfg.engine
        self.device = actor_device(engine.device)
        self.cpu_threads, self.channel_timeout_s = cfg.cpu_threads, cfg.channel_timeout_s
        set_cpu_threads(self.device, self.cpu_threads)
        install_kernels(engine.kernel_config(self.device))  # before the draft is prepared, as the LLM does
        dtype = engine.torch_dtype()
        heads = load_target_heads(engine.target, dtype=dtype)
        model = load_draft(engine.draft, target=heads, dtype=dtype).to(self.device)
        self.side = DraftSide(model, engine.kv_blocks, engine.block_size, engine.speculative_config,
                              heads.config.vocab_size)
        if self.device.type == "cuda" and not engine.enforce_eager:
            self.side.use_static_shapes(context_limit(engine.max_model_len, heads.config.max_position))
            self.side.warm_up(engine.max_num_seqs)  # every batch bucket's graphs now, not during requests
        self.config: DraftConfig = model.config
        self.feature_dtype = dtype or heads.config.dtype
        self.end: DraftEnd | None = None

    def connect(self, host: str, port: int, backend: str) -> bool:
        self.end = DraftEnd(host, port, backend, self.device if backend == "nccl" else torch.device("cpu"),
                            self.config.context_dim, self.feature_dtype, self.channel_timeout_s)
        return True

    def serve(self) -> str:
        """Blocks until the verifier sends STOP."""
        set_cpu_threads(self.device, self.cpu_threads)  # a threaded actor's method: set in this thread
        self.end.serve(self.side.propose)
        self.end.close()
        return "stopped"

    def info(self) -> dict:
        import ray

        return {"device": str(self.device), "num_speculative_tokens": self.side.num_speculative_tokens,
                "num_blocks": self.side.num_blocks, "node_id": ray.get_runtime_context().get_node_id()}
