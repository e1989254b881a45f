"""The draft trainer's step on a GPU (random weights at the demo pair's shapes, synthetic sequences): ms per
optimizer step and sequence tokens/s of the fused path (per-sequence block attention, each target position's
logits once in bf16, the fused distillation kernel) against the reference path (the dense block mask, target
logits per block row in fp32, the loss in PyTorch), measured in one run, and where the fused step's time goes.

    python bench/bench_train.py [--layers 2 3] [--markov-rank 8 16] [--json $OUT/bench_train.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import random_target  # noqa: E402

from dspark_serve.kernels.distill_loss_ref import distill_rows_ref  # noqa: E402
from dspark_serve.train.anchors import build_blocks, pack, sample_anchors  # noqa: E402
from dspark_serve.train.block_forward import block_forward, block_logits  # noqa: E402
from dspark_serve.train.block_forward_ref import block_forward_dense  # noqa: E402
from dspark_serve.train.draft_init import freeze_shared, new_draft  # noqa: E402
from dspark_serve.train.loss import dspark_loss, position_weights  # noqa: E402
from dspark_serve.train.trainer import cache_target_features, train_step  # noqa: E402

MASK_ID, LAYER_IDS = 151669, (2, 12, 20)


def sequences(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p, r = int(torch.randint(30, 90, (1,), generator=g)), int(torch.randint(120, 257, (1,), generator=g))
        out.append((torch.randint(0, 151000, (p + r,), generator=g), torch.arange(p + r) >= p))
    return out


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def autocast(dev: torch.device):
    return torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()


def reference_step(draft, target, seqs, cached, num_anchors, gen):
    """The trainer before the fused path: dense mask, target logits gathered per block row, PyTorch loss."""
    cfg, dev = draft.config, draft.hidden_norm.weight.device
    packed = pack(seqs)
    blocks = build_blocks(packed, [sample_anchors(m, num_anchors, gen) for _, m in seqs], cfg.block_size,
                          cfg.mask_token_id)
    feats, last = torch.cat([f for f, _ in cached]), torch.cat([h for _, h in cached])
    with autocast(dev):
        hidden = block_forward_dense(draft, feats, packed.seq.to(dev), packed.pos.to(dev), blocks.ids.to(dev),
                                     blocks.seq.to(dev), blocks.anchors.to(dev))
        logits = draft.base_logits(hidden)
        embed = draft.markov_embed(blocks.prev_ids.to(dev))
        logits = logits + draft.markov_bias(embed)
        conf = draft.confidence_logit(hidden, embed)
    with torch.no_grad():
        t = target.compute_logits(last[blocks.target_index.to(dev)])  # [N, B, V] fp32
    n, b, v = logits.shape
    w = position_weights(blocks.eval_mask.to(dev))
    ce, l1, _ = distill_rows_ref(logits.reshape(-1, v), t.reshape(-1, v), torch.arange(n * b, device=dev),
                                 blocks.labels.to(dev).reshape(-1).clamp(min=0))
    c_star = (1 - l1.detach().view_as(w) / 2).clamp(0, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(conf.float(), c_star, reduction="none")
    return (0.1 * (w * ce.view_as(w)).sum() + 0.9 * (w * l1.view_as(w)).sum() + (w * bce).sum()) / w.sum()


def time_steps(fn, params, steps: int) -> tuple[float, float]:
    opt = torch.optim.AdamW(params, lr=1e-4)
    dev = params[0].device
    for i in range(steps + 2):
        if i == 2:
            sync(dev)
            t0 = time.perf_counter()
        loss = fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3 / steps, float(loss)


def phases(draft, target, seqs, cached, num_anchors, gen) -> dict[str, float]:
    """ms of each part of one fused step, synchronized between parts."""
    cfg, dev = draft.config, draft.hidden_norm.weight.device
    marks, t = {}, [time.perf_counter()]

    def mark(name):
        sync(dev)
        t.append(time.perf_counter())
        marks[name] = (t[-1] - t[-2]) * 1e3
    packed = pack(seqs)
    blocks = build_blocks(packed, [sample_anchors(m, num_anchors, gen) for _, m in seqs], cfg.block_size,
                          cfg.mask_token_id)
    feats, last = torch.cat([f for f, _ in cached]), torch.cat([h for _, h in cached])
    mark("pack + anchors")
    with autocast(dev):
        hidden = block_forward(draft, feats, packed.seq.to(dev), packed.pos.to(dev), blocks.ids.to(dev),
                               blocks.seq.to(dev), blocks.anchors.to(dev))
        mark("block forward")
        logits, conf = block_logits(draft, hidden, blocks.prev_ids.to(dev))
        mark("draft logits")
    with torch.no_grad():
        rows, index = torch.unique(blocks.target_index.to(dev), return_inverse=True)
        tl = target.lm_head(last[rows])
    mark("target logits")
    parts = dspark_loss(logits, tl, blocks.labels.to(dev), blocks.eval_mask.to(dev), conf, target_index=index)
    mark("loss")
    parts.total.backward()
    mark("backward")
    draft.zero_grad(set_to_none=True)
    marks["rows"] = float(blocks.ids.numel())
    return marks


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--markov-rank", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-anchors", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (fp32, keep --batch-size and anchors small)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    target = random_target(args.device, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    seqs = sequences(4 * args.batch_size)
    cache = cache_target_features(target, seqs, LAYER_IDS, args.batch_size)
    rows = []
    for layers in args.layers:
        for rank in args.markov_rank:
            draft = new_draft(target, layers, 7, rank, LAYER_IDS, MASK_ID, intermediate_size=args.intermediate)
            params = freeze_shared(draft)
            gen = torch.Generator().manual_seed(0)
            batches = [list(range(i, i + args.batch_size)) for i in range(0, len(seqs), args.batch_size)]
            k = iter(range(10 ** 9))

            def batch():
                idx = batches[next(k) % len(batches)]
                return [seqs[i] for i in idx], [cache[i] for i in idx]

            def fused():
                s, c = batch()
                return train_step(draft, target, s, args.num_anchors, generator=gen, cached=c).total

            def reference():
                s, c = batch()
                return reference_step(draft, target, s, c, args.num_anchors, gen)
            tokens = sum(int(s[0].shape[0]) for s in seqs) / len(batches)
            cuda = dev.type == "cuda"
            peak = lambda: torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else 0.0  # noqa: E731
            cuda and torch.cuda.reset_peak_memory_stats()
            ms_f, loss_f = time_steps(fused, params, args.steps)
            peak_f = peak()
            cuda and torch.cuda.reset_peak_memory_stats()
            ms_r, loss_r = time_steps(reference, params, args.steps)
            peak_r = peak()
            s, c = batch()
            ph = phases(draft, target, s, c, args.num_anchors, gen)
            row = {"layers": layers, "markov_rank": rank, "fused_ms": ms_f, "reference_ms": ms_r,
                   "speedup": ms_r / ms_f, "fused_tok_s": tokens / ms_f * 1e3, "reference_tok_s": tokens / ms_r * 1e3,
                   "fused_peak_GiB": peak_f, "reference_peak_GiB": peak_r, "phases_ms": ph,
                   "last_loss": [loss_f, loss_r]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del draft, params
            cuda and torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"\n{name}  batch {args.batch_size} x {args.num_anchors} anchors, block 7")
    print("layers rank | fused ms  ref ms  speedup | fused tok/s  ref tok/s | peak GiB fused/ref | fused phases ms")
    for r in rows:
        ph = " ".join(f"{k}={v:.1f}" for k, v in r["phases_ms"].items() if k != "rows")
        print(f"{r['layers']:6d} {r['markov_rank']:4d} | {r['fused_ms']:8.1f} {r['reference_ms']:7.1f} "
              f"{r['speedup']:6.2f}x | {r['fused_tok_s']:11.0f} {r['reference_tok_s']:10.0f} | "
              f"{r['fused_peak_GiB']:5.1f} / {r['reference_peak_GiB']:5.1f} | {ph}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
