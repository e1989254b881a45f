"""`dspark-serve serve --deterministic` in bfloat16: 12 concurrent streams through the real service (speculative)
give every request the tokens the in-process engine gives it alone, plainly, in the same mode; greedy and seeded."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from engine_pairs import random_prompts
from service import ServerProcess

from dspark_serve.cluster.grpc_client import DSparkClient
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair

KINDS = {"greedy": lambda i: dict(temperature=0.0), "seeded": lambda i: dict(temperature=1.0, seed=200 + i)}


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=4, vocab=256)


@pytest.mark.parametrize("kind", list(KINDS))
def test_served_streams_equal_plain_alone(pair_dirs, kind):
    prompts = random_prompts(21, 12)
    llm = LLM(str(pair_dirs[0]), None, device="cpu", dtype="bfloat16", block_size=8, deterministic=True)
    alone = [llm.generate([p], SamplingParams(max_tokens=10, ignore_eos=True, **KINDS[kind](i)))[0].token_ids
             for i, p in enumerate(prompts)]
    srv = ServerProcess(*pair_dirs, "--dtype", "bfloat16", "--deterministic")
    try:
        client = DSparkClient(srv.address)
        with ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda i: client.generate(prompts[i], max_tokens=10, ignore_eos=True, timeout=120,
                                                           **KINDS[kind](i)), range(12)))
        assert [o["token_ids"] for o in outs] == alone
        assert sum(o["stats"]["drafted"] for o in outs) > 0  # the server speculated
    finally:
        srv.kill()
