"""The draft's top-k candidates on a GPU: torch.topk against the two-launch Triton top-k (kernels/topk.py) over
the base logits [R, 151936] fp32, each timed in a CUDA graph. Usage: python bench/bench_topk.py [--json out.json]"""

import argparse
import json

import torch

from bench_nvfp4 import graph_time_us
from dspark_serve.kernels import topk as tk


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 7, 8, 56])
    p.add_argument("--ks", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", default="bench_topk.json")
    args = p.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}: top-k over [R, {args.vocab}] fp32, us per call in a CUDA graph")
    for r in args.rows:
        x = torch.randn(r, args.vocab, device="cuda") * 4
        for k in args.ks:
            got, want = tk.topk(x, k), x.topk(k, dim=-1)
            assert torch.equal(got[0], want.values), (r, k)
            torch_us = graph_time_us([lambda: x.topk(k, dim=-1)])
            triton_us = graph_time_us([lambda: tk.topk(x, k)])
            rows.append({"rows": r, "k": k, "torch_us": torch_us, "triton_us": triton_us,
                         "chunk": tk.chunk_for(k, args.vocab)[0]})
            print(f"R={r:3d} k={k:3d}  torch.topk {torch_us:7.2f} us  triton {triton_us:7.2f} us  "
                  f"x{torch_us / triton_us:4.2f}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vocab": args.vocab,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
