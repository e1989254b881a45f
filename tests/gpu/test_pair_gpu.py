"""Draft and verifier as Ray actors on two GPUs with the NCCL step channel: greedy output equals the local engine."""

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_pair_on_two_gpus_equals_local_engine(tmp_path):
    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.engine.engine_config import EngineConfig
    from dspark_serve.cluster.pair import create_pair
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.random_init import random_pair

    target, draft = random_pair(tmp_path, agree=0.002, block_size=6)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        pair = create_pair(PairConfig(EngineConfig(target=str(target), draft=str(draft), device="cuda",
                                                   num_kv_blocks=256, block_size=8)))
        assert pair.backend == "nccl"
        local = LLM(str(target), str(draft), {"enable_adaptive_verification": False}, device="cuda", block_size=8,
                    num_kv_blocks=256)
        client = pair.stream_client()
        for i, prompt in enumerate([[1, 2, 3], [9, 8, 7, 6, 5], [42] * 11, [100, 200]]):
            params = {"temperature": 0.0, "max_tokens": 48}
            tokens, _, stats = client.run({f"r{i}": (prompt, params)})[f"r{i}"]
            ref = local.generate([prompt], SamplingParams(**params))[0]
            assert tokens == ref.token_ids
            assert stats["tau"] > 2.0 and stats["transfer_ms"] > 0
        client.close()
        pair.shutdown()
    finally:
        ray.shutdown()
