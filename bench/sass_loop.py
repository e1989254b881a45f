"""The decode GEMV kernels' hot loops in sm_90 SASS, compiled here without a GPU: instructions per packed weight word.

At M <= 16 an NVFP4 GEMV should be bound by HBM, not by instruction issue. An H200 issues at most
132 SMs x 4 schedulers x 1.98 GHz = 1.05e12 warp instructions/s; at 4.2 TB/s one 32-bit word of codes plus its
half byte of fp8 scale (4.5 B) arrives every 1 / 0.93e12 s, so a thread may spend about 36 instructions per word
before issue, not memory, sets the pace (less in practice: latency, address math, the epilogue). This script
compiles each kernel exactly as its wrapper launches it (same arguments, constexprs, options and Triton's own
argument specialization), finds the innermost loop in the SASS and counts its instructions per word of weights.
These are static counts, not timings: they say which kernel can reach the bandwidth, and where its instructions go.

    python bench/sass_loop.py [--n 151936 --k 4096] [--m 1 7 16] [--json out.json]
"""

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

ISSUE_BUDGET = 132 * 4 * 1.98e9 * 32 / (4.2e12 / 4.5)   # thread instructions per word at 4.2 TB/s, ~36


def record_launches(module, names: tuple[str, ...], call) -> list[tuple]:
    """Run call() with the Triton kernels module.<name> replaced by recorders -> [(fn, args, kwargs)] per launch."""
    fns, launches = {n: getattr(module, n) for n in names}, []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((fns[self.name], args, kw))
    saved = dict(fns)
    try:
        for n in names:
            setattr(module, n, Recorder(n))
        call()
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)
    return launches


def compile_sm90(fn, args: tuple, kw: dict, cuda_constexprs: dict | None = None):
    """One recorded launch compiled for sm_90 with Triton's own argument specialization (16-byte aligned pointers
    and multiples of 16 marked divisible, integers equal to 1 made constants; do_not_specialize honoured).
    cuda_constexprs overrides constexprs whose value the wrapper picks from the device (e.g. LIBDEVICE)."""
    arg_names = fn.arg_names
    constexprs = {k: v for k, v in kw.items() if k in arg_names}
    constexprs.update({k: v for k, v in (cuda_constexprs or {}).items() if k in constexprs})
    options = {k: v for k, v in kw.items() if k not in arg_names}
    dns = {fn.arg_names[p.num] for p in fn.params if p.do_not_specialize}
    signature, attrs = {}, {}
    for i, (name, value) in enumerate(zip(arg_names, args)):
        kind, key = native_specialize_impl(CUDABackend, value, False, name not in dns, True)
        if kind == "constexpr":
            constexprs[name] = value
        else:
            signature[name] = kind
            if key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    signature.update({n: "constexpr" for n in constexprs})
    src = ASTSource(fn=fn, signature={n: signature[n] for n in arg_names},
                    constexprs={(arg_names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


_OP = re.compile(r"^\s*(?:[0-9a-f-]{2}:[0-9a-f-]:[0-9a-f-]:[-Y]:\d+\s+)?(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_]*)")


def hot_loop(sass: str) -> list[str]:
    """The opcodes of the innermost loop: the body between a label and the last backward branch to it (of several
    loops, the one with the most instructions)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*\.?(L\w+):", ln))}
    best = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+\`?\(?\.?(L\w+)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [o.group(1) for ln in lines[labels[m.group(1)] + 1:i + 1] if (o := _OP.match(ln))]
            if len(body) > len(best):
                best = body
    return best


_CLASSES = {"fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP"), "fp16x2": ("HFMA2", "HMUL2", "HADD2"),
            "int": ("LOP3", "SHF", "IMAD", "IADD3", "PRMT", "LEA", "ISETP", "SEL", "VIADD", "IABS", "SGXT", "BMSK"),
            "mma": ("HMMA", "HGMMA"), "load": ("LDG",),
            "async copy": ("LDGSTS",), "shared": ("LDS", "STS", "LDSM", "BAR"), "shuffle": ("SHFL",),
            "convert": ("F2F", "I2F", "F2I", "F2FP")}


@dataclass
class LoopProfile:
    name: str
    instructions: int
    words: float            # 32-bit weight words per thread per loop iteration
    by_class: dict
    registers: int

    @property
    def per_word(self) -> float:
        return self.instructions / self.words


def registers(kernel) -> int:
    """Registers per thread, from `cuobjdump -res-usage` (bundled with Triton) on the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True)
    m = re.search(r"REG:(\d+)", out.stdout)
    return int(m.group(1)) if m else -1


def profile(name: str, kernel, words_per_iteration: int, num_warps: int) -> LoopProfile:
    ops = hot_loop(kernel.asm["sass"])
    counts = collections.Counter(ops)
    by_class = {c: sum(counts[o] for o in opcodes) for c, opcodes in _CLASSES.items()}
    by_class["other"] = len(ops) - sum(by_class.values())
    return LoopProfile(name, len(ops), words_per_iteration / (32 * num_warps), by_class, registers(kernel))


def gemv_profiles(m: int, n: int, k: int) -> list[LoopProfile]:
    """Every M <= 16 GEMV path of kernels/ at [m, k] x [n, k]: the sm_90 default (the mma kernel where the shape fits),
    the default without it, plus the other paths."""
    from dspark_serve.kernels import w4a16_gemv as g, w4a16_gemv_words as gw
    x = torch.empty(m, k, dtype=torch.bfloat16)
    packed = torch.empty(n, k // 2, dtype=torch.uint8)
    scale, scale_2 = torch.empty(n, k // 16, dtype=torch.float8_e4m3fn), torch.ones(())
    default = g.default_gemv_config(m, n, k)
    configs = {"default": default}
    if default.words:
        configs["tensor cores"] = g.GemvConfig(64, 256, 1, True, num_warps=4, join=False)
    else:
        configs["words"] = g.words_config(n, k, 8, 512, 2)
    for label, cfg in list(configs.items()):
        if cfg.use_dot:   # the other decode of the tensor-core path
            configs[label + ", other decode"] = dataclasses.replace(cfg, prmt=not cfg.prmt)
    out = []
    if g.mma_fits(n, k):
        from dspark_serve.kernels import w4a16_gemv_mma as gm
        cfg = g.default_gemv_config(m, n, k, mma_ok=True)
        (fn, args, kw), = record_launches(gm, ("_gemv_mma_kernel",), lambda: g.gemv_mma(
            x, packed, scale, scale_2, cfg.block_n // (16 * cfg.num_warps), cfg.num_warps, cfg.split_k, cfg.l2_ahead))
        kernel = compile_sm90(fn, args, kw)
        out.append(profile(f"mma [{cfg.block_n}, 128] {cfg.num_warps}w (sm_90 default)", kernel,
                           16 * 16 * kw["TILES"] * kw["WARPS"], kw["WARPS"]))
    for label, cfg in configs.items():
        names = ("_w4a16_gemv_kernel",) if not cfg.words else ("_gemv_words_kernel",)
        module = gw if cfg.words else g
        (fn, args, kw), = record_launches(module, names, lambda: g.w4a16_gemv(x, packed, scale, scale_2, cfg))
        kernel = compile_sm90(fn, args, kw, {"DOT_F32": False, "PRMT": cfg.use_dot and cfg.prmt})
        kind = "words" if cfg.words else "cuda cores"
        if not cfg.words and kw["USE_DOT"]:
            kind = "tensor cores, prmt" if cfg.prmt else "tensor cores"
        name = f"{kind} [{cfg.block_n}, {cfg.block_k}] {cfg.num_warps}w" + (" (default)" if label == "default" else "")
        out.append(profile(name, kernel, kw["BLOCK_N"] * kw["BLOCK_K"] // 8, kw["num_warps"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=151936)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--m", type=int, nargs="+", default=[1, 7, 16])
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    print(f"[{a.n}, {a.k}] weight; issue budget ~{ISSUE_BUDGET:.0f} thread instructions per word at 4.2 TB/s")
    print(f"{'M':>3} {'kernel':<38} {'instr/word':>10} {'regs':>5}  by class per word")
    for m in a.m:
        for prof in gemv_profiles(m, a.n, a.k):
            cls = ", ".join(f"{c} {v / prof.words:.1f}" for c, v in prof.by_class.items() if v)
            print(f"{m:>3} {prof.name:<38} {prof.per_word:>10.1f} {prof.registers:>5}  {cls}")
            rows.append(dict(m=m, n=a.n, k=a.k, kernel=prof.name, instructions=prof.instructions, words=prof.words,
                             per_word=prof.per_word, registers=prof.registers, by_class=prof.by_class))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(issue_budget=ISSUE_BUDGET, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
