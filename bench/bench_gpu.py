"""The GPU step benchmark: copy bandwidth, plain decode against the weight-bytes floor, a 1 + 7 verify
step against a plain step, and the DSpark draft block against the verify step, on random weights at Qwen3-8B and
Qwen3-0.6B shapes. Each row times the engine's own TargetSide / DraftSide calls (host metadata included), with
CUDA graphs (static shapes) and eagerly. Prints a table and writes JSON.

usage: python bench/bench_gpu.py [--models 8b 0.6b] [--batch 1 8 32 64] [--context 512] [--json OUT]
       python bench/bench_gpu.py --tiny --device cpu     # the same code path on tiny shapes (a CI smoke test)
The real-pair end-to-end numbers are bench/bench_pair.py; two GPUs through the actors are bench/bench_two_gpus.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark_serve.engine.draft_side import DraftSide
from dspark_serve.engine.drafter import DraftInput
from dspark_serve.engine.request import Request
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.engine.target_side import TargetSide
from dspark_serve.kernels import config as kernel_config
from dspark_serve.kernels.config import KernelConfig
from dspark_serve.models.config import ModelConfig
from dspark_serve.models.draft_config import DraftConfig
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.qwen import QwenForCausalLM

SHAPES = {  # name: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied)
    "8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    "0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
    "tiny": (64, 2, 4, 2, 16, 128, 512, False),
}
DRAFT_LAYERS = {"8b": 5, "0.6b": 2, "tiny": 1}
BLOCK = 16


def target_config(name: str, dtype: torch.dtype) -> ModelConfig:
    h, n, heads, kv, hd, inter, vocab, tied = SHAPES[name]
    return ModelConfig(arch="qwen3", vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_layers=n,
                       num_heads=heads, num_kv_heads=kv, head_dim=hd, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position=40960, tie_word_embeddings=tied, attention_bias=False, dtype=dtype)


def random_module(make, device: str, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device(device):  # built on the device: an 8B model initialised on the host takes minutes
        module = make().to(dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, device: str, iters: int) -> float:
    fn(), fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    n = (1 << 30) if device.startswith("cuda") else (64 << 20)
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    ms = time_ms(lambda: b.copy_(a), device, 20)
    return 2 * n / ms / 1e6


def requests(batch: int, context: int, n_draft: int) -> list[Request]:
    reqs = []
    for i in range(batch):
        r = Request(str(i), [1] * context, SamplingParams(temperature=0.0, max_tokens=64), seed=i,
                    num_speculative_tokens=n_draft)
        r.num_computed = context
        reqs.append(r)
    return reqs


def blocks_of(side, _pools={}):
    """A block pool over a side's cache (the engine's KVCacheManager owns it when serving)."""
    from dspark_serve.engine.kv_cache import BlockAllocator

    if id(side) not in _pools:
        _pools[id(side)] = (side, BlockAllocator(side.num_blocks, side.block_size))
    return _pools[id(side)][1]


def verify_step(side: TargetSide, reqs: list, drafts: int):
    """One verify step of every row's anchor and `drafts` drafts (plain decoding: 0), all verified."""
    from dspark_serve.engine.draft_split import DraftSlots

    n = side.graphs.n if side.graphs is not None else 7
    slots = DraftSlots([drafts] * len(reqs), [False] * len(reqs), drafts * len(reqs), [[1.0] * n] * len(reqs),
                       [0.0] * len(reqs))
    return side.verify(reqs, slots, torch.full((len(reqs), n), 5, device=side.device) if drafts else None, None)


def parse_dispatch(spec: str) -> KernelConfig:
    """"PDL=1,DENSE_GEMV=0" -> the installed KernelConfig with those fields (names case-insensitive)."""
    items = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"--dispatch: {item!r} is not NAME=VALUE for a KernelConfig field")
        items[key] = value
    try:
        return kernel_config.active().with_overrides(items)
    except ValueError as e:
        raise SystemExit(f"--dispatch: {e}") from None


def bench_target(name: str, batches: list[int], context: int, device: str, dtype: torch.dtype, iters: int,
                 gbps: float, variants: list[str] | None = None, repeat: int = 1) -> list[dict]:
    """Graphs and eager; with variants (KernelConfig field settings), graphs only, each in turn, `repeat` rounds."""
    cfg = target_config(name, dtype)
    model = random_module(lambda: QwenForCausalLM(cfg), device, dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    floor_ms = weight_bytes / gbps / 1e6
    need = max(batches) * -(-(context + 16) // BLOCK)
    rows = []
    runs = [(True, v) for _ in range(repeat) for v in variants] if variants else [(True, None), (False, None)]
    saved = kernel_config.active()
    for static, variant in runs:
        if variant is not None:  # every variant starts from the defaults: the others' fields do not carry over
            kernel_config.install(saved)
            kernel_config.install(parse_dispatch(variant))
        side = TargetSide(model, need, BLOCK)
        if static:
            side.use_static_shapes(7, max_model_len=context + 64)
        for batch in batches:
            reqs = requests(batch, context, 7)
            for r in reqs:
                r.target_blocks = blocks_of(side).allocate(context + 16)
            plain = time_ms(lambda: verify_step(side, reqs, 0), device, iters)
            verify = time_ms(lambda: verify_step(side, reqs, 7), device, iters)
            for r in reqs:
                blocks_of(side).free(r.target_blocks)
            rows.append({"model": name, "graphs": static, "batch": batch, "context": context, "plain_ms": plain,
                         "plain_tok_s": batch / plain * 1e3, "floor_ms": floor_ms, "pct_of_floor": floor_ms / plain,
                         "verify_ms": verify, "verify_over_plain": verify / plain, "dispatch": variant})
        side = None  # its graphs go now: a garbage collection during the next capture would invalidate it
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    kernel_config.install(saved)
    del model
    return rows


def draft_module(name: str, fmt: str, device: str, dtype: torch.dtype) -> DSparkDraft:
    """A random DSpark draft at the shape's draft size; fmt "nvfp4..." swaps fc, the projections and markov_w2."""
    tcfg = target_config(name, dtype)
    n_layers = DRAFT_LAYERS[name]
    layers = replace(tcfg, num_layers=n_layers, tie_word_embeddings=False)
    ids = tuple(round(1 + i * (tcfg.num_layers - 4) / max(1, n_layers - 1)) for i in range(n_layers))
    dcfg = DraftConfig(layers=layers, format="deepspec", block_size=7, target_layer_ids=ids,
                       mask_token_id=tcfg.vocab_size - 1, anchor_first=True, target_hidden_size=tcfg.hidden_size,
                       draft_vocab_size=tcfg.vocab_size, markov_rank=256 if name != "tiny" else 16,
                       enable_confidence_head=True)
    draft = random_module(lambda: DSparkDraft(dcfg), device, dtype).eval()
    if fmt.startswith("nvfp4"):
        for mod_name, mod in list(draft.named_modules()):
            if isinstance(mod, torch.nn.Linear) and (mod_name == "fc" or "_proj" in mod_name
                                                     or mod_name.endswith("markov_w2")):
                parent, _, child = mod_name.rpartition(".")
                setattr(draft.get_submodule(parent) if parent else draft, child, NVFP4Linear.from_linear(mod))
    return draft


def draft_side(draft: DSparkDraft, batch: int, context: int, topk: int, static: bool,
               quantize_lm_head: bool = False, token_map: str | None = None) -> tuple[DraftSide, DraftInput]:
    """The draft's side for `batch` requests at `context` tokens, and one step's input (no new context rows)."""
    spec = SpeculativeConfig(dspark_draft_topk=topk, dspark_quantize_lm_head=quantize_lm_head,
                             dspark_token_map=token_map)
    side = DraftSide(draft, batch * -(-(context + 16) // BLOCK), BLOCK, spec, draft.embed_tokens.num_embeddings)
    if static:
        side.use_static_shapes(context + 64)
    tables = [blocks_of(side).allocate(context + 16) for _ in range(batch)]
    width = max(len(t) for t in tables)
    inp = DraftInput(anchors=torch.full((batch,), 5), anchor_pos=torch.full((batch,), context),
                     ctx_start=torch.full((batch,), context), ctx_len=torch.zeros(batch, dtype=torch.int64),
                     features=None, block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                     temperature=torch.zeros(batch), seeds=torch.arange(batch))
    return side, inp


def bench_draft(name: str, batches: list[int], context: int, device: str, dtype: torch.dtype, iters: int,
                topks: list[int], verify_ms: dict[int, float], token_map: str | None = None) -> list[dict]:
    """Formats: bf16; nvfp4 (the lm_head, shared with the target, in bf16); nvfp4+head (a 4-bit copy of it); with
    `token_map` also nvfp4+map and nvfp4+head+map (the draft scores only the map's tokens)."""
    rows = []
    for fmt in ("bf16", "nvfp4", "nvfp4+head") + (("nvfp4+map", "nvfp4+head+map") if token_map else ()):
        draft = draft_module(name, fmt, device, dtype)
        for topk, static, batch in [(t, s, b) for t in topks for s in (True, False) for b in batches]:
            side, inp = draft_side(draft, batch, context, topk, static, "+head" in fmt,
                                   token_map if fmt.endswith("+map") else None)
            ms = time_ms(lambda: side.propose(inp), device, iters)
            v = verify_ms.get(batch)
            rows.append({"model": name, "draft_layers": DRAFT_LAYERS[name], "format": fmt, "topk": topk,
                         "graphs": static, "batch": batch, "draft_ms": ms, "verify_ms": v,
                         "draft_over_verify": ms / v if v else None})
        del draft
    return rows


def profile_table(label: str, run, device: str, top: int, steps: int = 20) -> list[dict]:
    """Device time per kernel of `run()` (torch.profiler over graph replays; on CPU, self time per op) -> rows,
    printed."""
    for _ in range(3):
        run()
    sync(device)
    cuda = device.startswith("cuda")
    acts = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            run()
        sync(device)
    key = "device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
    rows = [{"kernel": e.key, "us_per_step": getattr(e, key) / steps, "calls_per_step": e.count / steps}
            for e in events]
    print(f"{label}: {sum(r['us_per_step'] for r in rows):.1f} us per step in all")
    for r in rows[:top]:
        print(f"{r['us_per_step']:9.1f} us/step {r['calls_per_step']:6.1f} calls/step  {r['kernel'][:90]}")
    return rows


def kernel_table(name: str, context: int, device: str, dtype: torch.dtype, top: int, tokens: int = 1) -> list[dict]:
    """The batch-1 target step over `tokens` new tokens (1: plain, 8: verify 1 + 7), per kernel."""
    model = random_module(lambda: QwenForCausalLM(target_config(name, dtype)), device, dtype).eval()
    side = TargetSide(model, -(-(context + 16) // BLOCK) + 1, BLOCK)
    side.use_static_shapes(tokens - 1, max_model_len=context + 64)
    reqs = requests(1, context, 7)
    reqs[0].target_blocks = blocks_of(side).allocate(context + 16)
    step = "plain" if tokens == 1 else f"{tokens}-token"
    return profile_table(f"{name} {step} step, batch 1", lambda: verify_step(side, reqs, tokens - 1),
                         device, top)


def draft_kernel_table(name: str, context: int, device: str, dtype: torch.dtype, top: int, topk: int) -> list[dict]:
    """The NVFP4 draft block with a 4-bit lm_head at batch 1 (CUDA graphs), per kernel."""
    side, inp = draft_side(draft_module(name, "nvfp4", device, dtype), 1, context, topk, True, True)
    return profile_table(f"{name} NVFP4 draft block (4-bit lm_head), top-k {topk}, batch 1", lambda: side.propose(inp),
                         device, top)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["8b", "0.6b"], choices=list(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--topk", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, few iterations (smoke test)")
    ap.add_argument("--dispatch", nargs="+", metavar="SPEC",
                    help="target rows with CUDA graphs only, once per KernelConfig setting, e.g. "
                         "'PDL=0' 'PDL=1' (alternating, --repeat rounds)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--no-draft", action="store_true", help="skip the draft block rows")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also profile the plain batch-1 step per kernel and print the N costliest")
    ap.add_argument("--kernels-tokens", type=int, nargs="+", default=[1], metavar="Q",
                    help="the profiled steps' new tokens (8: verify 1 + 7)")
    ap.add_argument("--draft-kernels", type=int, default=0, metavar="N",
                    help="also profile the NVFP4 draft block at batch 1 (first --topk) and print the N costliest")
    ap.add_argument("--token-map", type=int, default=0, metavar="K",
                    help="also time NVFP4 drafts that score only K tokens (speculative_config.dspark_token_map)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    kernel_config.install(KernelConfig.from_env(args.device))  # DSPARK_<FIELD> for A/B runs
    if args.tiny:
        args.models, args.batch, args.context, args.topk, args.iters = ["tiny"], [1, 3], 40, [8], 2
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    gbps = copy_bandwidth(args.device)
    result = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "copy_GBps": gbps, "target": [], "draft": []}
    print(f"copy bandwidth {gbps:.0f} GB/s", flush=True)
    for name in args.models:
        rows = bench_target(name, args.batch, args.context, args.device, dtype, args.iters, gbps, args.dispatch,
                            args.repeat)
        result["target"] += rows
        verify = {r["batch"]: r["verify_ms"] for r in rows if r["graphs"]}
        if not args.no_draft:
            vocab = target_config(name, dtype).vocab_size
            with tempfile.TemporaryDirectory() as tmp:
                token_map = None
                if args.token_map:
                    if not 0 < args.token_map <= vocab:
                        raise SystemExit(f"--token-map must be in [1, {vocab}] for {name}, got {args.token_map}")
                    token_map = f"{tmp}/map.pt"
                    torch.save(torch.arange(args.token_map), token_map)  # which tokens does not change the time
                result["draft"] += bench_draft(name, args.batch, args.context, args.device, dtype, args.iters,
                                               args.topk, verify, token_map)
    print(f"{'model':>5} {'graphs':>6} {'batch':>5} {'plain ms':>9} {'tok/s':>9} {'floor ms':>9} {'%floor':>7} "
          f"{'verify ms':>10} {'v/p':>5}")
    for r in result["target"]:
        print(f"{r['model']:>5} {str(r['graphs']):>6} {r['batch']:>5} {r['plain_ms']:>9.3f} {r['plain_tok_s']:>9.1f} "
              f"{r['floor_ms']:>9.3f} {100 * r['pct_of_floor']:>6.1f}% {r['verify_ms']:>10.3f} "
              f"{r['verify_over_plain']:>5.2f}  {r['dispatch'] or ''}")
    print(f"{'model':>5} {'fmt':>10} {'topk':>4} {'graphs':>6} {'batch':>5} {'draft ms':>9} {'draft/verify':>12}")
    for r in result["draft"]:
        ratio = f"{r['draft_over_verify']:.3f}" if r["draft_over_verify"] is not None else "-"
        print(f"{r['model']:>5} {r['format']:>10} {r['topk']:>4} {str(r['graphs']):>6} {r['batch']:>5} "
              f"{r['draft_ms']:>9.3f} {ratio:>12}")
    if args.kernels:
        result["kernels"] = {name if q == 1 else f"{name} q{q}":
                             kernel_table(name, args.context, args.device, dtype, args.kernels, tokens=q)
                             for name in args.models for q in args.kernels_tokens}
    if args.draft_kernels:
        result["draft_kernels"] = {name: draft_kernel_table(name, args.context, args.device, dtype, args.draft_kernels,
                                                            args.topk[0]) for name in args.models}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
