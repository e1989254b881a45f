"""The decode-step Triton kernels compile for sm_90 (the H200) here, without a GPU, exactly as their wrappers
launch them.

The CPU interpreter runs a kernel as Python and type-checks nothing the compiler does, so a kernel can pass every
interpreter test and fail to build on the GPU: the q/k RoPE kernel once loaded a cache slot through a bf16
placeholder pointer in a branch its plain mode never takes, and added that float to a pointer. Here each wrapper
runs on CPU tensors with its kernel replaced by a recorder; every recorded launch (argument dtypes, constexprs,
options) is then compiled through ptxas (bundled with Triton), with the CUDA-only choices (libdevice, bf16 tl.dot)
switched on.
"""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dspark_serve.kernels import fused_ops, paged_attention_triton as pat
from dspark_serve.kernels.attention import AttentionMetadata

_PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32",
        torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv"}


def _type(v) -> str:
    if isinstance(v, torch.Tensor):
        return _PTR[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__}")


def compile_launches(monkeypatch, module, names: tuple[str, ...], call) -> dict[str, int]:
    """Run call() with the kernels module.<name> recording their launches, then compile each launch for sm_90;
    -> launches per kernel."""
    fns, launches = {n: getattr(module, n) for n in names}, []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, args, kw))
    for n in names:
        monkeypatch.setattr(module, n, Recorder(n))
    call()
    monkeypatch.undo()
    for name, args, kw in launches:
        fn = fns[name]
        arg_names = fn.arg_names
        constexprs = {k: v for k, v in kw.items() if k in arg_names}
        options = {k: v for k, v in kw.items() if k not in arg_names}
        if "LIBDEVICE" in constexprs:
            constexprs["LIBDEVICE"] = True  # what a CUDA tensor selects
        if "DOT_F32" in constexprs:
            constexprs["DOT_F32"] = args[0].dtype == torch.float32
        signature = {n: _type(v) for n, v in zip(arg_names, args)}
        signature.update({n: "constexpr" for n in constexprs})
        src = ASTSource(fn=fn, signature=signature,
                        constexprs={(arg_names.index(k),): v for k, v in constexprs.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert kernel.asm["cubin"]
    return {n: sum(name == n for name, _, _ in launches) for n in names}


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
@pytest.mark.parametrize("d,group,q_len", [(64, 7, 8), (128, 4, 1)])
def test_paged_attention_compiles(monkeypatch, splits, causal, d, group, q_len):
    reqs, kv, bs = 2, 2, 16
    q = torch.randn(reqs * q_len, kv * group, d).bfloat16()
    k_cache = v_cache = torch.zeros(9, bs, kv, d).bfloat16()
    meta = AttentionMetadata(cu_seqlens_q=torch.arange(reqs + 1) * q_len, seq_lens=torch.tensor([40, 64]),
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
    assert compile_launches(monkeypatch, fused_ops, ("_rms_norm_kernel",),
                            lambda: fused_ops.rms_norm(x, w, 1e-6, res if residual else None)) == {"_rms_norm_kernel": 1}
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
