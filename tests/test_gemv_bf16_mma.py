"""The register-fed mma dense GEMV (kernels/gemv_bf16_mma.py) without a GPU: compiled for sm_90 (ptxas checks the
PTX; the K loop has no shared memory and the expected mma count; PDL's order of launch, weight loads, wait) and its
configs and routing. tests/gpu/test_gemv_bf16_mma_gpu.py runs it on an H200."""

import pytest
import torch
import torch.nn.functional as F

from bench_scripts import load_bench
from dspark_serve.kernels import gemv_bf16_mma as gm
from dspark_serve.kernels.gemv_bf16 import linear

sass_loop = load_bench("sass_loop")


@pytest.mark.parametrize("m,n,k,cfg,swiglu,bias", [
    (8, 6144, 4096, (1, 4, 2, 0), False, False), (16, 1152, 896, (2, 2, 1, 128), False, True),
    (1, 24576, 4096, (1, 4, 2, 256), True, False), (9, 896, 4864, (1, 8, 2, 0), False, False)])
def test_kernel_compiles_for_sm90(m, n, k, cfg, swiglu, bias):
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    cfg = gm.MmaDenseConfig(*cfg)
    (fn, args, kw), = sass_loop.record_launches(gm, ("_gemv_mma_dense_kernel",),
                                                lambda: gm._launch(x, w, b, cfg, swiglu))
    assert kw["TWO_B"] == (m > 8) and kw["SWIGLU"] == swiglu and kw["EVEN"] == ((k // (32 * cfg.vec)) % cfg.warps == 0)
    kernel = sass_loop.compile_sm90(fn, args, kw, {"PDL": True})
    prof = sass_loop.profile("dense mma", kernel, 16 * 16 * cfg.vec * cfg.tiles * cfg.warps, cfg.warps)
    want = 2 * cfg.vec * cfg.tiles * (2 if m > 8 else 1)                  # per chunk: 2 per 16-byte vector and B
    assert kernel.asm["sass"].count("HMMA") == want and prof.by_class["mma"] >= want - 1
    assert prof.by_class["shared"] == 0 and kernel.metadata.shared <= 4 * 32 * 8 * cfg.warps   # the warp sum only
    ptx = kernel.asm["ptx"]
    trigger, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    first_load, first_store = ptx.find("ld.global"), ptx.find("st.global")
    assert 0 <= trigger < first_load < wait < first_store               # weights before the wait, no store before
    assert (ptx.count("ld.global.nc.L2::128B") > 0) == (cfg.l2_fetch == 128)


@pytest.mark.parametrize("swiglu", [False, True])
def test_tile_major_puts_each_value_where_a_lane_reads_it(swiglu):
    """The kernel's tile-major addresses (tile j, chunk c, half h at 2048 bytes, vector v at 512, lane g * 4 + t at
    16) hold row 16j + 8h + g (SwiGLU: gate row 8j + g, its up row for h = 1) at K 128c + 32v + 8t + e, the K
    slots of the row-major kernel; the inverse permutation gives w back."""
    n, k = 64, 384
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    t = gm.tile_major(w, swiglu)
    blocks = t.reshape(n // 16, k // 128, 2, 4, 8, 4, 8)                   # (tile, chunk, h, v, g, t, e)
    back = blocks.permute(2, 0, 4, 1, 3, 5, 6) if swiglu else blocks.permute(0, 2, 4, 1, 3, 5, 6)
    assert t.shape == (n // 16, k // 128, 2048) and torch.equal(back.reshape(n, k), w)
    flat = t.reshape(-1)
    for j, c, h, v, g, tt in [(0, 0, 0, 0, 0, 0), (3, 2, 1, 3, 7, 3), (1, 1, 0, 2, 5, 1), (2, 0, 1, 1, 3, 2)]:
        lane_byte = ((j * (k // 128) + c) * 2048 * 2 + h * 2048 + v * 512 + (g * 4 + tt) * 16)
        row = (h * n // 2 + 8 * j + g) if swiglu else 16 * j + 8 * h + g
        got = flat[lane_byte // 2: lane_byte // 2 + 8]
        assert torch.equal(got, w[row, 128 * c + 32 * v + 8 * tt: 128 * c + 32 * v + 8 * tt + 8])
    with pytest.raises(ValueError, match="K % 128 == 0"):
        gm.tile_major(w[:, :100])


def test_tile_major_kernel_compiles_for_sm90():
    """The tile-major variant loads as many 16-byte vectors and issues as many mmas as the row-major one."""
    x, w = torch.randn(8, 1024).bfloat16(), torch.randn(4096, 1024).bfloat16()
    counts = []
    for ww in (w, gm.tile_major(w)):
        (fn, args, kw), = sass_loop.record_launches(gm, ("_gemv_mma_dense_kernel",),
                                                    lambda: gm._launch(x, ww, None, gm.MmaDenseConfig(1, 8, 4), False))
        kernel = sass_loop.compile_sm90(fn, args, kw, {"PDL": True})
        counts.append((kw["TILED"], kernel.asm["sass"].count("HMMA"), kernel.asm["sass"].count("LDG.E.128")))
    assert counts[0][0] is False and counts[1][0] is True and counts[0][1:] == counts[1][1:] and min(counts[0][1:]) > 0


def test_default_configs():
    cfg = gm.default_mma_dense_config
    assert cfg(8, 6144, 4096) == gm.MmaDenseConfig(2, 4, 4, 0)              # 8B qkv
    assert cfg(8, 24576, 4096) == gm.MmaDenseConfig(2, 2, 4, 0)             # 8B gate/up (and its SwiGLU)
    assert cfg(8, 4096, 12288) == cfg(8, 896, 4864) == gm.MmaDenseConfig(1, 8, 4, 0)   # down
    assert cfg(8, 9728, 896) == gm.MmaDenseConfig(1, 2, 4, 0)               # 0.5B gate/up: 7 chunks
    assert cfg(8, 151936, 896) == gm.MmaDenseConfig(1, 1, 4, 128)           # lm_head
    assert cfg(8, 1152, 800).vec == 1                                       # K % 64 != 0


def test_cpu_operands_keep_the_reference():
    x, w = torch.randn(8, 256).bfloat16(), torch.randn(64, 256).bfloat16()
    assert not gm.mma_dense_ok(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))
    with pytest.raises(ValueError, match="sm_90 CUDA"):
        gm.gemv_mma_dense(x, w)
    with pytest.raises(ValueError, match="bad MmaDenseConfig"):
        gm._launch(x, w, None, gm.MmaDenseConfig(3, 4, 2), False)


def test_tiled_copies_need_cuda_bf16_weights():
    """Tile-major copies on a CPU model (or fp32, or shapes the kernel cannot tile) are never kept: fuse() stays
    free of extra memory there; KernelConfig.dense_tiled's default keeps them only for CUDA bf16 weights."""
    from dspark_serve.engine.runner.fused_layers import FusedMLP, keep_tile_major, tiled_copy
    from dspark_serve.kernels.config import KernelConfig
    from dspark_serve.models.layers import MLP
    fused = FusedMLP.of(MLP(256, 512).to(torch.bfloat16), tiled=True)
    assert fused.gate_up is not None and fused.tiled == (None, None)
    assert tiled_copy(torch.randn(64, 256)) is None and tiled_copy(None) is None
    assert tiled_copy(torch.randn(64, 256).bfloat16()) is None
    layers = torch.nn.ModuleList([MLP(256, 512).to(torch.bfloat16)])
    assert not keep_tile_major(layers, KernelConfig(dense_tiled=None))  # no CUDA weights
    assert keep_tile_major(layers, KernelConfig(dense_tiled=True))
    assert not keep_tile_major(layers, KernelConfig(dense_tiled=False))
