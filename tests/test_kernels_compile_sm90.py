"""The decode-step Triton kernels compile for sm_90 (the H200) here, without a GPU, exactly as their wrappers
launch them.

The CPU interpreter runs a kernel as Python and type-checks nothing the compiler does, so a kernel can pass every
interpreter test and fail to build on the GPU: the q/k RoPE kernel once loaded a cache slot through a bf16
placeholder pointer in a branch its plain mode never takes, and added that float to a pointer. Here each wrapper
runs on CPU tensors with its kernel replaced by a recorder; every recorded launch (argument dtypes, constexprs,
options) is then compiled through ptxas (bundled with Triton), with the CUDA-only choices (libdevice, bf16 tl.dot)
switched on.
"""

from dataclasses import replace

import pytest
import torch

from bench_scripts import load_bench
from dspark_serve.kernels import fused_ops, paged_attention_triton as pat
from dspark_serve.kernels.attention import AttentionMetadata

sass_loop = load_bench("sass_loop")


def compile_launches(monkeypatch, module, names: tuple[str, ...], call, cuda: dict | None = None) -> dict[str, int]:
    """Run call() with the kernels module.<name> recording their launches, then compile each launch for sm_90 with
    Triton's own argument specialization; -> launches per kernel. cuda: constexprs as a CUDA tensor sets them."""
    launches = sass_loop.record_launches(module, names, call)
    for fn, args, kw in launches:
        fixed = {"LIBDEVICE": True, **(cuda or {})}                  # what a CUDA tensor selects
        if "DOT_F32" in kw:
            fixed["DOT_F32"] = args[0].dtype == torch.float32
        kernel = sass_loop.compile_sm90(fn, args, kw, fixed)
        assert kernel.asm["cubin"]
    return {n: sum(fn is getattr(module, n) for fn, _, _ in launches) for n in names}


@pytest.mark.parametrize("store", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_qk_norm_rotary_compiles(monkeypatch, store, norm, d):
    t, h, kv = 3, 14, 2
    q, k, v = (torch.randn(t, n, d).bfloat16() for n in (h, kv, kv))
    cos = sin = torch.randn(t, 1, d).bfloat16()
    w = (torch.ones(d).bfloat16(), torch.ones(d).bfloat16()) if norm else (None, None)
    cache = (v, torch.zeros(4, 16, kv, d).bfloat16(), torch.zeros(4, 16, kv, d).bfloat16(),
             torch.tensor([0, 5, -1])) if store else None
    kernel = "_qk_norm_rotary_kernel"
    assert compile_launches(monkeypatch, fused_ops, (kernel,),
                            lambda: fused_ops.qk_norm_rotary(q, k, cos, sin, *w, 1e-6, cache)) == {kernel: 1}


@pytest.mark.parametrize("splits", [1, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,group,q_len", [(64, 7, 8), (128, 4, 1), (64, 7, 48)])  # 48: a prompt chunk
def test_paged_attention_compiles(monkeypatch, splits, causal, d, group, q_len):
    reqs, kv, bs = 2, 2, 16
    q = torch.randn(reqs * q_len, kv * group, d).bfloat16()
    k_cache = v_cache = torch.zeros(9, bs, kv, d).bfloat16()
    meta = AttentionMetadata(cu_seqlens_q=torch.arange(reqs + 1) * q_len, seq_lens=torch.tensor([max(40, q_len), 64]),
                             slot_mapping=torch.zeros(reqs * q_len, dtype=torch.int64),
                             block_table=torch.arange(8).view(2, 4), max_query_len=q_len, max_seq_len=64,
                             causal=causal, all_slots_valid=True)
    cfg = pat.AttentionConfig(block_m=64 if q_len * group > 16 else 16, block_n=32, num_splits=splits)
    calls = compile_launches(monkeypatch, pat, ("_paged_attention_kernel", "_combine_kernel"),
                             lambda: pat.paged_attention_triton(q, k_cache, v_cache, meta, d ** -0.5, cfg))
    assert calls == {"_paged_attention_kernel": 1, "_combine_kernel": int(splits > 1)}


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_and_silu_compile(monkeypatch, residual):
    x, res, w = torch.randn(3, 896).bfloat16(), torch.randn(3, 896).bfloat16(), torch.ones(896).bfloat16()
    call = lambda: fused_ops.rms_norm(x, w, 1e-6, res if residual else None)  # noqa: E731
    assert compile_launches(monkeypatch, fused_ops, ("_rms_norm_kernel",), call) == {"_rms_norm_kernel": 1}
    gate_up = torch.randn(3, 2 * 4864).bfloat16()
    assert compile_launches(monkeypatch, fused_ops, ("_silu_mul_kernel",),
                            lambda: fused_ops.silu_mul(gate_up)) == {"_silu_mul_kernel": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_distill_loss_compiles(monkeypatch, dtype):
    from dspark_serve.kernels import distill_loss as dl
    z = torch.randn(4, 3000).to(dtype).requires_grad_(True)
    t = torch.randn(2, 3000).to(dtype)
    row, labels = torch.tensor([0, 1, 1, 0]), torch.tensor([5, 6, 7, 2999])
    names = ("_distill_fwd_kernel", "_distill_bwd_kernel")

    def call():
        ce, l1, _ = dl.distill_rows(z, t, row, labels)
        (ce.sum() + l1.sum()).backward()
    assert compile_launches(monkeypatch, dl, names, call) == {n: 1 for n in names}


@pytest.mark.parametrize("m", [1, 7, 16, 56])
@pytest.mark.parametrize("prmt", [False, True])
def test_w4a16_gemv_compiles(monkeypatch, m, prmt):
    """The GEMV paths: tensor cores with the integer or the inline-PTX (prmt) decode (16, 32 or 64 rows of x per
    program), and the word kernel (M <= 16); ptxas checks the PTX of e2m1_prmt here."""
    from dspark_serve.kernels import w4a16_gemv as g
    from dspark_serve.kernels import w4a16_gemv_words as gw
    n, k = 96, 512
    x, packed = torch.randn(m, k).bfloat16(), torch.zeros(n, k // 2, dtype=torch.uint8)
    scale, scale_2 = torch.ones(n, k // 16).to(torch.float8_e4m3fn), torch.ones(())
    cfg = g.GemvConfig(64, 256, 2, True, num_warps=4, join=False, prmt=prmt)
    kernel = "_w4a16_gemv_kernel"
    assert compile_launches(monkeypatch, g, (kernel,), lambda: g.w4a16_gemv(x, packed, scale, scale_2, cfg),
                            {"PRMT": prmt}) == {kernel: 1}
    if m > 16:
        return
    words, cfg = "_gemv_words_kernel", g.words_config(n, k, 8, 512, 2)
    assert compile_launches(monkeypatch, gw, (words,),
                            lambda: g.w4a16_gemv(x, packed, scale, scale_2, cfg)) == {words: 1}


def test_sass_loop_counts_the_hot_loop(kernel_config):
    """bench/sass_loop.py finds each GEMV path's inner loop; the PTX-table decode needs fewer instructions per
    weight word than the integer decode it replaces (static counts from ptxas, not timings), and its block scales,
    read as 4-byte bf16 pairs, arrive through the cp.async pipeline (no global load waits inside the loop)."""
    kernel_config(gemv_prmt=True)
    rows = {p.name: p for p in sass_loop.gemv_profiles(16, 4096, 1024)}
    assert set(rows) == {"tensor cores, prmt [64, 256] 4w (default)", "tensor cores [64, 256] 4w", "words [8, 512] 2w",
                         "mma [128, 128] 4w (sm_90 default)"}
    assert all(p.instructions > 0 and p.by_class["load"] + p.by_class["shared"] > 0 for p in rows.values())
    tc, prmt = rows["tensor cores [64, 256] 4w"], rows["tensor cores, prmt [64, 256] 4w (default)"]
    assert tc.by_class["mma"] > 0 and prmt.by_class["mma"] > 0
    assert prmt.per_word < 0.6 * tc.per_word
    assert prmt.by_class["load"] == 0 and prmt.by_class["async copy"] > 0
    mma = rows["mma [128, 128] 4w (sm_90 default)"]                   # registers only, fewest instructions
    assert mma.by_class["shared"] == 0 and mma.per_word < 0.8 * prmt.per_word


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemv_compiles(monkeypatch, m, bias):
    """The target's dense GEMV: CUDA cores at M = 1, tensor cores above; with and without a bias."""
    from dspark_serve.kernels import gemv_bf16 as g
    w, b = torch.randn(96, 512).bfloat16(), torch.randn(96).bfloat16() if bias else None
    x = torch.randn(m, 512).bfloat16()
    assert compile_launches(monkeypatch, g, ("_gemv_kernel",), lambda: g.gemv(x, w, b),
                            {"DOT_F32": False}) == {"_gemv_kernel": 1}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_invariant_matmul_compiles(monkeypatch, bias, out_dtype):
    """The deterministic mode's matmul on the tensor cores (bf16 tl.dot, not the interpreter's row sums); the fp32
    output is the lm_head's logits."""
    from dspark_serve.kernels import matmul_invariant as mi
    w, b = torch.randn(96, 300).bfloat16(), torch.randn(96).bfloat16() if bias else None
    x = torch.randn(5, 300).bfloat16()
    assert compile_launches(monkeypatch, mi, ("_matmul_kernel",), lambda: mi.matmul_invariant(x, w, b, out_dtype),
                            {"ROW_SUM": False, "DOT_F32": False}) == {"_matmul_kernel": 1}
    w, x = torch.randn(96, 1300).bfloat16(), torch.randn(5, 1300).bfloat16()  # K in two pieces, then their sum
    split = replace(mi.CONFIG, k_split=1024)
    assert compile_launches(monkeypatch, mi, ("_matmul_kernel", "_sum_splits_kernel"),
                            lambda: mi.matmul_invariant(x, w, b, out_dtype, split),
                            {"ROW_SUM": False, "DOT_F32": False}) == {"_matmul_kernel": 1, "_sum_splits_kernel": 1}


def _first(ptx: str, *ops: str) -> int:
    found = [i for op in ops if (i := ptx.find(op)) >= 0]
    return min(found) if found else len(ptx)


def test_decode_kernels_wait_first_with_pdl(monkeypatch):
    """With programmatic dependent launch (kernels/pdl.py, on for sm_90 CUDA tensors) every kernel of the decode
    layer waits for its predecessor (griddepcontrol.wait) before its first global load or store, then lets its
    successor launch; the one-row GEMV lets it launch first and loads its first weight tile before it waits (no
    store before the wait). Without PDL neither instruction is there."""
    from dspark_serve.kernels import gemv_bf16 as g
    x, res, w = torch.randn(1, 512).bfloat16(), torch.randn(1, 512).bfloat16(), torch.ones(512).bfloat16()
    x2 = torch.randn(1, 2048).bfloat16()
    q, k = torch.randn(1, 8, 64).bfloat16(), torch.randn(1, 2, 64).bfloat16()
    cos = torch.randn(1, 1, 64).bfloat16()
    cache = (k, torch.zeros(4, 16, 2, 64).bfloat16(), torch.zeros(4, 16, 2, 64).bfloat16(), torch.tensor([3]))
    meta = AttentionMetadata(cu_seqlens_q=torch.tensor([0, 1]), seq_lens=torch.tensor([40]),
                             slot_mapping=torch.zeros(1, dtype=torch.int64), block_table=torch.arange(4).view(1, 4),
                             max_query_len=1, max_seq_len=40, causal=True, all_slots_valid=True)
    launches = []
    for module, names, call in (
            (fused_ops, ("_rms_norm_kernel",), lambda: fused_ops.rms_norm(x, w, 1e-6, res)),
            (fused_ops, ("_qk_norm_rotary_kernel",), lambda: fused_ops.qk_norm_rotary(q, k, cos, cos, w[:64],
                                                                                      w[:64], 1e-6, cache)),
            (pat, ("_paged_attention_kernel", "_combine_kernel"),
             lambda: pat.paged_attention_triton(q, *cache[1:3], meta, 0.125, pat.AttentionConfig(16, 16, 2))),
            (fused_ops, ("_silu_mul_kernel",), lambda: fused_ops.silu_mul(torch.cat((x, x), 1))),
            (g, ("_gemv_kernel",), lambda: g.gemv(x, torch.randn(96, 512).bfloat16())),
            (g, ("_gemv_kernel",), lambda: g.gemv(x, torch.randn(96, 512).bfloat16(), swiglu=True)),
            # K a multiple of the K tile (the masks without the K tail), plain and SwiGLU
            (g, ("_gemv_kernel",), lambda: g.gemv(x2, torch.randn(96, 2048).bfloat16())),
            (g, ("_gemv_kernel",), lambda: g.gemv(torch.randn(8, 2048).bfloat16(), torch.randn(96, 2048).bfloat16())),
            (g, ("_gemv_kernel",), lambda: g.gemv(x2, torch.randn(96, 2048).bfloat16(), swiglu=True)),
            # the layer's RMSNorm fused in (the residual written after the wait)
            (g, ("_gemv_kernel",), lambda: g.gemv(x2, torch.randn(96, 2048).bfloat16(),
                                                  norm=(torch.ones(2048).bfloat16(), 1e-6, x2.clone()))),
            (g, ("_gemv_kernel",), lambda: g.gemv(x, torch.randn(96, 512).bfloat16(), swiglu=True,
                                                  norm=(w, 1e-6, None)))):
        launches += sass_loop.record_launches(module, names, call)
    assert len(launches) == 12
    for fn, args, kw in launches:
        for on in (True, False):
            ptx = sass_loop.compile_sm90(fn, args, kw, {"LIBDEVICE": True, "DOT_F32": False, "PDL": on}).asm["ptx"]
            wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
            if not on:
                assert wait == trigger == -1, fn.__name__
                continue
            first_load, first_store = _first(ptx, "ld.global", "cp.async"), _first(ptx, "st.global", "atom.")
            if fn.__name__ == "_gemv_kernel":
                assert 0 <= trigger < first_load < wait < first_store
            else:
                assert 0 <= wait < trigger < min(first_load, first_store), fn.__name__

