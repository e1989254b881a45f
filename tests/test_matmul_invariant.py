"""The batch-invariant matmul under the CPU interpreter: equal to F.linear up to rounding, and a row's result
bit-equal at M = 1, 7, 8, 16, 64 wherever it sits in the batch. Reruns itself with TRITON_INTERPRET=1."""

from dataclasses import replace

import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter


def test_tiles_are_chosen_by_the_weight_s_shape():
    """config_for: K split in whole BLOCK_K steps until one row tile's programs reach the target, at least two steps
    a piece; wide weights and programs = 0 keep K whole."""
    from dspark_serve.kernels.matmul_invariant import config_for

    assert config_for(896, 4864, 128).k_split == 1024          # 28 tiles: 5 pieces (4 x 1024 + 768) -> 140 programs
    assert config_for(896, 896, 128).k_split == 384            # 7 steps: at most 3 pieces
    assert config_for(896, 4864, 128, 16).k_split == 1664      # 56 tiles of 16: 3 pieces of 13 steps or fewer
    assert config_for(9728, 896, 128).k_split == 0             # 304 tiles: K whole
    assert config_for(896, 4864, 0).k_split == 0
    assert config_for(896, 200, 512).k_split == 0              # 2 steps: one piece
    assert config_for(896, 4864, 128, 16).block_n == 16


if not INTERPRETED:
    def test_matmul_invariant_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    import torch.nn.functional as F

    from dspark_serve.kernels.matmul_invariant import CONFIG, config_for, matmul_invariant

    SIZES = (1, 7, 8, 16, 64)
    SPLIT = replace(CONFIG, k_split=128)  # K = 200 / 300 in 2 / 3 pieces, summed by the second kernel
    CHOSEN = config_for(72, 300, 8, 16, replace(CONFIG, block_k=32))  # 5 tiles of 16: K in pieces of 160 and 140

    @pytest.mark.parametrize("n,k,bias,config", [(40, 200, True, CONFIG), (96, 128, False, CONFIG),
                                                 (40, 200, True, SPLIT), (24, 300, False, SPLIT)])
    def test_matches_linear(n, k, bias, config):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(9, k, generator=g), torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if bias else None
        torch.testing.assert_close(matmul_invariant(x, w, b, config=config), F.linear(x, w, b), rtol=1e-5, atol=1e-4)

    @pytest.mark.parametrize("dtype,config", [(torch.float32, CONFIG), (torch.bfloat16, CONFIG),
                                              (torch.bfloat16, SPLIT), (torch.bfloat16, CHOSEN)])
    def test_a_row_is_bit_equal_in_every_batch(dtype, config):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 300, generator=g).to(dtype)
        w, b = torch.randn(72, 300, generator=g).to(dtype), torch.randn(72, generator=g).to(dtype)
        alone = torch.cat([matmul_invariant(x[i:i + 1], w, b, config=config) for i in range(64)])  # [64, 72]
        for m in SIZES[1:]:
            for start in (0, 64 - m):                                                    # rows at other tile lanes
                got = matmul_invariant(x[start:start + m], w, b, config=config)
                assert torch.equal(got, alone[start:start + m]), (dtype, m, start)

    def test_bad_shapes_name_them():
        with pytest.raises(ValueError, match="x \\[M, K\\]"):
            matmul_invariant(torch.zeros(2, 3), torch.zeros(4, 5))
        with pytest.raises(ValueError, match="bias"):
            matmul_invariant(torch.zeros(2, 3), torch.zeros(4, 3), torch.zeros(3))

