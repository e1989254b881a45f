"""Speculative decoding at batch 1 with the draft on one GPU and the verifier on another (two Ray
actors, the NCCL step channel) against both co-located in one process on one GPU, and against the service's
`--colocate` actor (the draft inside the verifier actor), measured in one run; plus the per-step coordination time
(the channel's wall time minus the draft's compute, as the verifier sees it).

usage: python bench/bench_two_gpus.py [--target DIR] [--prompts 4] [--tokens 256] [--json OUT]
       python bench/bench_two_gpus.py --device cpu --tokens 8 --prompts 1   # the same path on CPU (gloo)
Without --target it writes a random Qwen2.5-0.5B-shaped target (bench_step's) to a temp dir and pairs it with the
shipped drafter: random weights accept almost nothing, so this compares per-step cost, not tau.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, replace

import ray
import torch

from dspark_serve.cluster.config import PairConfig
from dspark_serve.cluster.commands.demo import gpu_spec_config
from dspark_serve.cluster.pair import create_pair
from dspark_serve.engine.engine_config import EngineConfig
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.demo import DEMO_DRAFTER
from dspark_serve.models.random_init import save_target

from bench_step import random_target

KV = dict(max_model_len=1024, num_kv_blocks=256, max_num_seqs=4)


def run_pair(cfg: PairConfig, prompts: list[list[int]], params: dict) -> dict:
    """Prompts one after another through the verifier actor; -> tok/s, steps, coordination ms per step."""
    pair = create_pair(cfg)
    client = pair.stream_client()
    try:
        def one(i: int, prompt: list[int]) -> dict:
            tokens, _, stats = client.run({f"r{i}": (prompt, params)})[f"r{i}"]
            return {"token_ids": tokens, "stats": stats}
        one(-1, prompts[0])  # warm-up: captures the graphs the timed prompts meet
        t0 = time.perf_counter()
        outs = [one(i, p) for i, p in enumerate(prompts)]
        dt = time.perf_counter() - t0
    finally:
        client.close()
        pair.shutdown()
    return summary(outs, dt)


def summary(outs: list[dict], seconds: float) -> dict:
    """outs: RequestOutputs as dicts (the verifier actor's wire shape)."""
    total = lambda key: sum(o["stats"][key] for o in outs)  # noqa: E731
    steps = total("steps")
    return {"tok_s": sum(len(o["token_ids"]) for o in outs) / seconds, "steps": steps,
            "tau": (total("accepted") + steps) / steps, "ms_per_step": seconds * 1e3 / steps,
            "coordination_ms_per_step": total("transfer_ms") / steps}


def run_colocated(target: str, device: str, prompts: list[list[int]], params: dict) -> dict:
    llm = LLM(target, str(DEMO_DRAFTER), gpu_spec_config(DEMO_DRAFTER), device=device, **KV)
    sp = SamplingParams(**params)
    llm.generate(prompts[:1], sp)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [llm.generate([p], sp)[0] for p in prompts]
    if device == "cuda":
        torch.cuda.synchronize()
    return summary([asdict(o) for o in outs], time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    target = args.target
    if target is None:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        target = str(save_target(random_target("cpu", dtype), f"{tmp.name}/target"))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 151000, (200,), generator=g).tolist() for _ in range(args.prompts)]
    params = {"temperature": 0.0, "max_tokens": args.tokens, "ignore_eos": True}
    cpu = args.device == "cpu"
    ray.init(address="local", include_dashboard=False, log_to_driver=False, **({
        "_node_ip_address": "127.0.0.1", "runtime_env": {"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}}} if cpu else {}))
    gpus = ray.cluster_resources().get("GPU", 0)
    engine = EngineConfig.from_options(dict(target=target, draft=str(DEMO_DRAFTER),
                                            speculative_config=gpu_spec_config(DEMO_DRAFTER), device=args.device, **KV))
    cfg = PairConfig(engine, channel_host="127.0.0.1" if cpu else None)
    result: dict = {"device": torch.cuda.get_device_name() if not cpu else "cpu", "gpus": gpus,
                    "tokens": args.tokens, "prompts": args.prompts, "speculative_config": gpu_spec_config(DEMO_DRAFTER),
                    "target": args.target or "random Qwen2.5-0.5B shape"}
    result["split"] = run_pair(replace(cfg, colocate=False), prompts, params)  # a GPU per actor when there are two
    result["colocated_actor"] = run_pair(replace(cfg, colocate=True), prompts, params)
    ray.shutdown()
    result["colocated"] = run_colocated(target, args.device, prompts, params)
    result["split_over_colocated"] = result["split"]["tok_s"] / result["colocated"]["tok_s"]
    tmp.cleanup()
    print(f"{'setup':<34} {'tok/s':>8} {'ms/step':>8} {'tau':>5} {'coordination ms/step':>21}")
    for name, key in (("draft and verifier actors (split)", "split"), ("--colocate: one actor", "colocated_actor"),
                      ("co-located, one process", "colocated")):
        r = result[key]
        print(f"{name:<34} {r['tok_s']:>8.1f} {r['ms_per_step']:>8.3f} {r['tau']:>5.2f} "
              f"{r['coordination_ms_per_step']:>21.3f}")
    print(f"split / co-located: {result['split_over_colocated']:.2f}x ({gpus:g} GPUs in the Ray cluster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
