"""The speculation policy's host time per step, without a model: a wave of c requests whose drafts are accepted at
random (each request's length in tokens fixed, so the wave's tail thins out step by step), each step the policy's
view, the step's budget and the budget of the step launched ahead, what was verified and accepted, and the step's
wall time. The step costs are a device's table (default: the H100 table in bench/h100_bench_adaptive_map_rounds.json).

usage: python bench/bench_policy.py [--levels 8 64 128] [--waves 20] [--costs JSON] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from dspark_serve.engine.core.policy import SpecPolicy, cap_drafts
from dspark_serve.engine.core.step_costs import StepCosts
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams

COSTS = Path(__file__).resolve().parent / "h100_bench_adaptive_map_rounds.json"
N, TOKENS = 7, 128


def wave(policy: SpecPolicy, c: int, rng: np.random.Generator) -> tuple[float, int]:
    """One wave of c requests to its end -> (seconds in the policy, steps)."""
    reqs = [Request(f"r{i}", [1], SamplingParams(max_tokens=TOKENS), 0, N) for i in range(c)]
    left = {r: TOKENS for r in reqs}
    spent, steps = 0.0, 0
    while reqs:
        conf = rng.uniform(0.3, 0.95, (len(reqs), N))
        accepted = [int(a) for a in rng.integers(0, N + 1, len(reqs))]
        t0 = time.perf_counter()
        view = policy.view(reqs)
        caps = [cap_drafts(N, N, left[r]) for r in reqs]
        view.budget(reqs, caps, [False] * len(reqs))
        ahead = [cap_drafts(N, N, left[r] - 1 - a) for r, a in zip(reqs, accepted)]
        view.budget(reqs, ahead, [False] * len(reqs))
        policy.observe(list(reqs), caps, [min(a, k) for a, k in zip(accepted, caps)], conf.tolist())
        policy.timed(len(reqs), len(reqs) * (N + 1), True, 6.0, emitted=sum(accepted) + len(reqs))
        policy.stepped(drafted=True)
        spent += time.perf_counter() - t0
        steps += 1
        for r, a in zip(list(reqs), accepted):
            left[r] -= a + 1
            if left[r] <= 0:
                reqs.remove(r)
                t0 = time.perf_counter()
                policy.forget(r)
                spent += time.perf_counter() - t0
    return spent, steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[8, 64, 128])
    ap.add_argument("--waves", type=int, default=20)
    ap.add_argument("--costs", default=str(COSTS), help="a JSON file holding step_costs (or the costs themselves)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    raw = json.loads(Path(args.costs).read_text())
    costs = StepCosts.from_dict(raw.get("step_costs", raw))
    result = {"costs": args.costs, "levels": []}
    for c in args.levels:
        policy, rng = SpecPolicy(N, True, costs=costs), np.random.default_rng(c)
        per_step, steps = [], []
        for _ in range(args.waves):
            spent, n = wave(policy, c, rng)
            per_step.append(spent / n * 1e6)
            steps.append(n)
        row = {"concurrency": c, "us_per_step_median": statistics.median(per_step), "us_per_step_min": min(per_step),
               "steps_per_wave": statistics.median(steps)}
        result["levels"].append(row)
        print(f"c={c:>4}: the policy's host time {row['us_per_step_median']:.1f} us a step (median of {args.waves} "
              f"waves; best {row['us_per_step_min']:.1f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
