"""E2M1 decode for the tensor-core GEMV on sm_90: packed NVFP4 bytes and their block scales (as bf16) -> exact bf16
weights, 12 instructions per 2 bytes (4 codes), as inline PTX.

Each bf16 E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6) is a normal number or zero whose two bytes come from two
8-entry byte tables, so `prmt` (byte permute, 3-bit selectors) looks up four codes at once: one lookup for the high
bytes, one for the low bytes, one more `prmt` to pair them into bf16x2, and the sign bit moved by a `prmt` of the
word and one `lop3`. `mul.rn.bf16x2` applies the block scale: code x fp8 scale has at most 6 significant bits and
lies in [2**-10, 2688] (or is 0), so the product is exact in bf16 and the tensor cores see exactly dequant(w) / scale_2.

`emulate` runs the PTX text itself on the CPU (an interpreter of the few instructions it uses), so the CPU tests check this exact
string against the reference dequantization; the GPU tests check it on the device.
"""

import re

import torch
import triton
import triton.language as tl

_TH = (0x3F3F3F00, 0x40404040)      # high bytes of bf16 E2M1 magnitudes, code 0..7
_TL = (0xC0800000, 0xC0804000)      # low bytes

# In: $2 = 2 packed bytes (codes 0, 1 in the low, high nibble of byte 0; codes 2, 3 in byte 1), $3 = their bf16x2
# scales. Out: $0 = [code 0, code 2] (low nibbles), $1 = [code 1, code 3] (high nibbles), each times its scale.
# Two bytes is what a thread holds of a bf16 tensor-core operand (two consecutive K), so no repacking is needed.
PTX = tl.constexpr(f"""{{
.reg .b32 th0, th1, tl0, tl1, m, h, l, t, s, v;
mov.b32 th0, {_TH[0]:#010x};
mov.b32 th1, {_TH[1]:#010x};
mov.b32 tl0, {_TL[0]:#010x};
mov.b32 tl1, {_TL[1]:#010x};
and.b32 m, $2, 0x7777;
prmt.b32 h, th0, th1, m;
prmt.b32 l, tl0, tl1, m;
shl.b32 t, $2, 4;
prmt.b32 v, l, h, 0x6240;
prmt.b32 s, t, t, 0x1000;
lop3.b32 v, v, s, 0x80008000, 0xF8;
mul.rn.bf16x2 $0, v, $3;
prmt.b32 v, l, h, 0x7351;
prmt.b32 s, $2, $2, 0x1000;
lop3.b32 v, v, s, 0x80008000, 0xF8;
mul.rn.bf16x2 $1, v, $3;
}}""")


@triton.jit
def e2m1_scaled_bf16(packed, scale):
    """packed uint8 [...] and its per-byte bf16 scale [...] (same shape) -> (low-nibble, high-nibble) weights,
    bf16 [...] each, exactly code * scale. CUDA only (inline PTX); the interpreter cannot run it."""
    return tl.inline_asm_elementwise(PTX, "=r,=r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=2)


def _prmt(a: int, b: int, c: int) -> int:
    pool = (a | (b << 32)).to_bytes(8, "little")
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> (((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1))) & 1) << i for i in range(32))


def _mul_bf16x2(a: int, b: int) -> int:
    x = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16)
    f = x.view(torch.bfloat16).float()
    p = (f[:2] * f[2:]).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return int(p[0]) | int(p[1]) << 16


def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


def _f32_bits(f: torch.Tensor) -> int:
    return int(f.view(torch.int32)) & 0xFFFFFFFF


def _bf16_bits(f: torch.Tensor) -> int:
    return int(f.to(torch.bfloat16).view(torch.int16)) & 0xFFFF


def emulate(ptx, inputs: list[int], n_out: int) -> list[int]:
    """Run straight-line PTX over 32-bit values (the instructions PTX above uses) -> the n_out output registers."""
    regs = {f"${i}": v for i, v in enumerate([0] * n_out + list(inputs))}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok[2:], 16) if tok.startswith("0f") else int(tok, 0) & 0xFFFFFFFF   # 0fXXXXXXXX: f32 bits
    for line in str(getattr(ptx, "value", ptx)).splitlines():
        line = line.split("//")[0].strip().rstrip(";")
        if not line or line[0] in "{}." or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        v = [val(s) for s in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = (v[0] << v[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "lop3.b32":
            r = _lop3(*v)
        elif op == "mul.rn.bf16x2":
            r = _mul_bf16x2(*v)
        elif op == "mul.rn.f32":
            r = _f32_bits(_f32(v[0]) * _f32(v[1]))
        elif op == "cvt.rn.bf16x2.f32":                  # a to the high half, b to the low half
            r = _bf16_bits(_f32(v[0])) << 16 | _bf16_bits(_f32(v[1]))
        else:
            raise ValueError(f"emulate: no {op}")
        regs[dst] = r
    return [regs[f"${i}"] for i in range(n_out)]


def instructions(ptx=PTX) -> int:
    """Instructions in the PTX body, the table moves (hoisted out of loops by ptxas) not counted."""
    return sum(1 for ln in ptx.value.splitlines() if re.match(r"\s*[a-z]", ln) and not ln.strip().startswith("mov.b32"))
