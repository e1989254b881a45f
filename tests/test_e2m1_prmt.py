"""The inline-PTX E2M1 decode of the tensor-core GEMV (kernels/e2m1_prmt.py), run by its emulator on the CPU.

The emulator executes the PTX string the kernel compiles (ptxas accepts it: tests/test_kernels_compile_sm90.py), so
these tests check that exact text: every byte value, both nibbles, against the reference decode times the scale.
"""

import torch

from dspark_serve.kernels import e2m1_prmt, nvfp4_ref


def _bf16_bits(v: float) -> int:
    return int(torch.tensor([v]).bfloat16().view(torch.int16)) & 0xFFFF


def _bf16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


def test_prmt_decode_every_byte_and_fp8_scale_class():
    codes = nvfp4_ref.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    scales = [448.0, 1.0, 0.875, 13.0, 2.0 ** -6, 2.0 ** -9, 7 * 2.0 ** -9, 0.0]    # max, normal, fp8 subnormal, 0
    for byte in range(256):
        other = (byte * 37 + 11) % 256
        s0, s1 = scales[byte % 8], scales[(byte // 8) % 8]
        lo, hi = e2m1_prmt.emulate(e2m1_prmt.PTX, [byte | other << 8, _bf16_bits(s0) | _bf16_bits(s1) << 16], 2)
        got = [_bf16(lo & 0xFFFF), _bf16(lo >> 16), _bf16(hi & 0xFFFF), _bf16(hi >> 16)]
        want = [codes[byte & 15] * s0, codes[other & 15] * s1, codes[byte >> 4] * s0, codes[other >> 4] * s1]
        assert got == want, (hex(byte), hex(other), got, want)


def test_negative_zero_keeps_its_sign():
    lo, hi = e2m1_prmt.emulate(e2m1_prmt.PTX, [0x88, _bf16_bits(1.0) * 0x10001], 2)
    assert lo & 0xFFFF == 0x8000 and hi & 0xFFFF == 0x8000           # codes 8 (-0) in both nibbles


def test_instruction_count():
    assert e2m1_prmt.instructions() == 12                            # per 2 bytes, table moves hoisted
