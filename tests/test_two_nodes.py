"""The pair across two Ray nodes on one machine (ray.cluster_utils.Cluster): the verifier on one, the draft on the
other, the step channel over TCP between them. Greedy output equals the in-process engine's; removing the
draft's node mid-stream is a draft death: the streams finish plainly with the same tokens, and speculation is
back once a node that can hold the draft joins."""

import asyncio
import threading
import time

import pytest

from dspark_serve.actors.frames import Add, Step
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.random_init import random_pair

ray = pytest.importorskip("ray")
PROMPTS = [[5, 6, 7], [100, 3, 42, 9], [11] * 6, [250, 1]]
TOKENS = 200


def _read_until_done(client, wanted: set[str], tokens: dict, steps: int | None = None) -> dict:
    """Read step frames until every wanted request finished (or `steps` frames); -> finish stats by id."""
    done = {}
    while wanted - done.keys() and steps != 0:
        frame = client.recv()
        assert isinstance(frame, Step), frame
        for out in frame.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = out.stats
        steps = None if steps is None else steps - 1
    return done


def test_pair_on_two_nodes_survives_losing_the_draft_node(tmp_path):
    from ray.cluster_utils import Cluster

    from dspark_serve.cluster.config import PairConfig
    from dspark_serve.engine.engine_config import EngineConfig
    from dspark_serve.cluster.pair import create_pair
    from dspark_serve.cluster.supervisor import PairSupervisor

    target, draft = random_pair(tmp_path, agree=0.005, block_size=6)
    local = LLM(str(target), str(draft), device="cpu", block_size=8, num_kv_blocks=512)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    refs = [o.token_ids for o in local.generate(PROMPTS, params)]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"target_node": 1}})
    draft_node = cluster.add_node(num_cpus=2, resources={"draft_node": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    loop = asyncio.new_event_loop()
    try:
        cfg = PairConfig(EngineConfig(target=str(target), draft=str(draft), device="cpu", block_size=8,
                                      num_kv_blocks=512),
                         target_resources=(("target_node", 1.0),), draft_resources=(("draft_node", 1.0),),
                         channel_timeout_s=10.0, keepalive_s=2.0, cpu_threads=1)
        pair = create_pair(cfg)
        assert pair.draft is not None and pair.backend == "gloo"
        draft_info = ray.get(pair.draft.info.remote())
        assert draft_info["node_id"] == draft_node.node_id != ray.get(pair.verifier.node_id.remote())
        supervisor = PairSupervisor(cfg, pair, _nothing, _nothing)
        threading.Thread(target=loop.run_until_complete, args=(supervisor.run(),), daemon=True).start()
        client = pair.stream_client()
        body = {"temperature": 0.0, "max_tokens": TOKENS, "ignore_eos": True}
        for i, p in enumerate(PROMPTS):
            client.send(Add(f"a{i}", p, body))
        tokens: dict = {}
        done = _read_until_done(client, {f"a{i}" for i in range(4)}, tokens)
        assert [tokens[f"a{i}"] for i in range(4)] == refs
        assert all(s["tau"] > 1.5 for s in done.values())

        for i, p in enumerate(PROMPTS):
            client.send(Add(f"b{i}", p, body))
        tokens = {}
        _read_until_done(client, set(), tokens, steps=3)  # under way
        cluster.remove_node(draft_node)
        _read_until_done(client, {f"b{i}" for i in range(4)}, tokens)
        assert [tokens[f"b{i}"] for i in range(4)] == refs
        assert ray.get(pair.verifier.stats.remote())["speculating"] is False

        new_node = cluster.add_node(num_cpus=2, resources={"draft_node": 1})
        end = time.monotonic() + 60
        while not ray.get(pair.verifier.stats.remote())["speculating"] and time.monotonic() < end:
            time.sleep(0.2)
        assert ray.get(pair.verifier.stats.remote())["speculating"]
        assert ray.get(pair.draft.info.remote())["node_id"] == new_node.node_id
        client.send(Add("c", PROMPTS[0], body))
        tokens = {}
        done = _read_until_done(client, {"c"}, tokens)
        assert tokens["c"] == refs[0] and done["c"]["tau"] > 1.5
        client.close()
        supervisor.stop()
        pair.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


async def _nothing(*_):
    return None
