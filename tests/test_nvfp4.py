"""NVFP4 format, reference quantize/dequantize, checkpoint round trip and the NVFP4Linear swap (CPU)."""

import json

import pytest
import torch
from torch import nn

from dspark_serve.kernels import nvfp4, nvfp4_ref
from dspark_serve.models import quantize as q
from dspark_serve.models.nvfp4_linear import NVFP4Linear


def _unit_scales(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(n, k // 16).to(torch.float8_e4m3fn), torch.tensor(1.0)


@pytest.mark.parametrize("byte,expected", [(0x22, [1.0, 1.0]), (0xAA, [-1.0, -1.0]), (0x31, [0.5, 1.5])])
def test_decode_bytes(byte, expected):
    packed = torch.full((1, 8), byte, dtype=torch.uint8)
    w = nvfp4.dequantize(packed, *_unit_scales(1, 16))
    assert w.tolist() == [expected * 8]


def test_e2m1_rounds_half_to_even_on_bounds():
    x = torch.tensor([0.25, 0.26, 0.74, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.01, 9.0, -0.1, -5.0])
    got = nvfp4_ref.e2m1_decode(nvfp4_ref.e2m1_codes(x))
    assert got.tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -0.0, -4.0]
    assert nvfp4_ref.e2m1_codes(torch.tensor([-0.1])).item() == 8   # ModelOpt keeps the sign of a zero


def test_quantize_hand_case():
    w = torch.zeros(1, 16)
    w[0, :6] = torch.tensor([0.5, 1.5, 1.0, 1.0, -1.0, -1.0])
    w[0, 15] = 6.0                                   # amax 6: block scale 448, weight_scale_2 6/2688
    packed, scale, scale_2 = nvfp4.quantize(w)
    assert packed.tolist() == [[0x31, 0x22, 0xAA, 0, 0, 0, 0, 0x70]]
    assert scale.float().tolist() == [[448.0]] and scale_2.item() == pytest.approx(6 / 2688)
    assert torch.equal(nvfp4.dequantize(packed, scale, scale_2), w)


@pytest.mark.parametrize("shape", [(8, 16), (33, 96), (128, 512)])
def test_quantize_roundtrip_error(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape)
    packed, scale, scale_2 = nvfp4.quantize(w)
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == torch.uint8
    assert scale.shape == (shape[0], shape[1] // 16) and scale.dtype == torch.float8_e4m3fn
    assert scale_2.dtype == torch.float32 and scale_2.numel() == 1
    back = nvfp4.dequantize(packed, scale, scale_2)
    assert (back - w).norm() / w.norm() < 0.12       # E2M1 with 16-blocks: ~9 % on Gaussian data
    assert torch.equal(nvfp4.dequantize(*nvfp4.quantize(back)), back)   # dequantized values are fixed points


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 20))
    with pytest.raises(ValueError, match="weight_scale"):
        nvfp4.dequantize(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2).to(torch.float8_e4m3fn),
                         torch.tensor(1.0))


def test_layer_names_from_configs():
    assert q.nvfp4_layer_names({"architectures": ["X"]}) is None
    mixed = {"quantization_config": q.quantization_config({"fc", "lm_head"})}
    assert q.nvfp4_layer_names(mixed) == {"fc", "lm_head"}
    hf = {"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    keys = ["fc.weight", "fc.weight_scale", "lm_head.weight_scale", "norm.weight"]
    assert q.nvfp4_layer_names(hf, keys) == {"fc"}
    with pytest.raises(ValueError, match="group_size must be 16, got 32"):
        q.nvfp4_layer_names({"quantization_config": {"quant_algo": "NVFP4", "group_size": 32}}, keys)
    with pytest.raises(ValueError, match="FP8"):
        q.nvfp4_layer_names({"quantization_config": {"quant_algo": "FP8"}})


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 32, bias=False)
        self.norm = nn.LayerNorm(32)
        self.lm_head = nn.Linear(32, 48, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.fc(x)))


def test_checkpoint_roundtrip_and_swap(tmp_path):
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    model = _Tiny()
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps({"architectures": ["Tiny"]}))
    assert q.main([str(src), str(dst), "--device", "cpu"]) == 0
    state = load_file(dst / "model.safetensors")
    names = q.nvfp4_layer_names(json.loads((dst / "config.json").read_text()), state.keys())
    assert names == {"fc", "lm_head"} and state["norm.weight"].dtype == torch.bfloat16
    for name in names:   # quantize -> save -> load -> dequantize equals dequantize of the in-memory result
        ref = nvfp4.quantize(model.get_submodule(name).weight.detach().to(torch.bfloat16))
        got = [state[f"{name}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2")]
        assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b) for a, b in zip(got, ref))
        assert torch.equal(nvfp4.dequantize(*got), nvfp4.dequantize(*ref))
    x = torch.randn(3, 64)
    dense = model(x)
    q.swap_in_nvfp4(model, state, names)
    assert isinstance(model.fc, NVFP4Linear) and isinstance(model.lm_head, NVFP4Linear)
    out = model(x)
    assert (out - dense).norm() / dense.norm() < 0.2
    deq = nn.functional.linear(model.norm(nn.functional.linear(x, model.fc.dequantized_weight())),
                               model.lm_head.dequantized_weight())
    torch.testing.assert_close(out, deq)
    with pytest.raises(ValueError, match="lacks"):
        q.swap_in_nvfp4(_Tiny(), {}, {"fc"})


def test_nvfp4_linear_cpu_weight_cache_follows_buffer_writes():
    torch.manual_seed(0)
    a, b = torch.randn(8, 32), torch.randn(8, 32)
    layer = NVFP4Linear.from_linear(torch.nn.Linear(32, 8, bias=False).requires_grad_(False).float())
    x = torch.randn(3, 32)
    packed, scale, scale_2 = nvfp4.quantize(a)
    layer.weight.copy_(packed), layer.weight_scale.copy_(scale), layer.weight_scale_2.copy_(scale_2)
    assert torch.equal(layer(x), x @ nvfp4.dequantize(packed, scale, scale_2).T)
    packed, scale, scale_2 = nvfp4.quantize(b)  # in-place writes must not leave a stale dequantized weight
    layer.weight.copy_(packed), layer.weight_scale.copy_(scale), layer.weight_scale_2.copy_(scale_2)
    assert torch.equal(layer(x), x @ nvfp4.dequantize(packed, scale, scale_2).T)
    assert torch.equal(layer(x.double()), x.double() @ nvfp4.dequantize(packed, scale, scale_2, torch.float64).T)


def test_nvfp4_linear_built_under_inference_mode_runs_outside_it():
    """Buffers made under inference_mode have no version counter; the CPU cache must not need one."""
    torch.manual_seed(0)
    with torch.inference_mode():
        layer = NVFP4Linear.from_linear(torch.nn.Linear(32, 8, bias=False).float())
    x = torch.randn(3, 32)
    want = x @ nvfp4.dequantize(layer.weight, layer.weight_scale, layer.weight_scale_2).T
    assert torch.equal(layer(x), want) and torch.equal(layer(x), want)


def test_kept_dense_copy_gives_the_dequant_path_bit_for_bit():
    """NVFP4Linear.keep_dense: the M > 16 GEMM on the kept bf16 temporary equals dequantizing it per call, and
    keep_dense_up_to keeps nothing over its byte limit."""
    from dspark_serve.kernels.w4a16_gemm import dense_unit_matmul, w4a16_dequant_matmul
    from dspark_serve.engine.runner.draft_runner import keep_dense_up_to
    from dspark_serve.models.nvfp4_linear import NVFP4Linear
    torch.manual_seed(0)
    layers = [NVFP4Linear.from_linear(torch.nn.Linear(64, n)) for n in (48, 32)]
    assert keep_dense_up_to(layers, 2 * 64 * 80 - 1) == 0 and getattr(layers[0], "_dense", None) is None
    assert keep_dense_up_to(layers + [torch.nn.Linear(4, 4)], 2 * 64 * 80) == 2 * 64 * 80
    x = torch.randn(40, 64).bfloat16()
    for lay in layers:
        assert lay._dense.dtype == torch.bfloat16 and lay._dense.shape == (lay.out_features, 64)
        want = w4a16_dequant_matmul(x, lay.weight, lay.weight_scale, lay.weight_scale_2)
        assert torch.equal(dense_unit_matmul(x, lay._dense, lay.weight_scale_2), want)
        lay.keep_dense(False)
        assert lay._dense is None


def test_nvfp4_stack_shares_the_layers_storage():
    """NVFP4Stack: one [sum N, K] weight whose rows are the layers' own buffers (views), each row scaled by its
    layer's weight_scale_2; off the mma path (here: CPU) it is the layers' outputs concatenated."""
    from dspark_serve.engine.runner.nvfp4_stack import NVFP4Stack
    torch.manual_seed(0)
    layers = [NVFP4Linear.from_linear(torch.nn.Linear(64, n).requires_grad_(False)) for n in (48, 16, 16)]
    for i, lay in enumerate(layers):
        lay.weight_scale_2.mul_(2.0 ** i)  # distinct per-layer scales
    x = torch.randn(5, 64)
    want = torch.cat([lay(x) for lay in layers], -1)
    stack = NVFP4Stack(layers)
    assert stack.weight.shape == (80, 32) and stack.weight_scale.shape == (80, 4) and stack.out_features == 80
    for lay, start in zip(layers, (0, 48, 64)):
        assert lay.weight.data_ptr() == stack.weight[start].data_ptr()
        assert lay.weight_scale.data_ptr() == stack.weight_scale[start].data_ptr()
        assert torch.equal(stack.row_scale[start:start + lay.out_features], lay.weight_scale_2.expand(lay.out_features))
    assert torch.equal(stack(x), want) and torch.equal(torch.cat([lay(x) for lay in layers], -1), want)
    with pytest.raises(ValueError, match="one in_features"):
        NVFP4Stack([NVFP4Linear(64, 16), NVFP4Linear(32, 16)])
    mixed = [NVFP4Linear(64, 16, bias=True), NVFP4Linear(64, 16)]
    ptrs = [m.weight.data_ptr() for m in mixed]
    with pytest.raises(ValueError, match="bias"):
        NVFP4Stack(mixed)
    assert [m.weight.data_ptr() for m in mixed] == ptrs  # refused before any buffer was re-pointed
