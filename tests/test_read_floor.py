"""bench/bench_read_floor.py's read kernels under the Triton interpreter: each reads every byte it is given (each
program's XOR equals torch's over its words: the streaming read with a tail past a whole block, the GEMV's row
pattern from the row and the tile-major layout), so their times are floors."""

import sys

import pytest
import torch

from bench_scripts import BENCH
from interpreter import INTERPRETED, rerun_under_interpreter


def _bench():
    sys.path.insert(0, str(BENCH))
    return __import__("bench_read_floor")


@pytest.mark.skipif(INTERPRETED, reason="the child process runs the kernel tests")
def test_under_interpreter():
    rerun_under_interpreter(__file__)


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (test_under_interpreter)")
@pytest.mark.parametrize("words,block,iters", [(4096, 1024, 2), (3000, 1024, 1), (5000, 1024, 4)])
def test_every_program_reads_its_words(words, block, iters):
    rf = _bench()
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (words,), dtype=torch.int32)
    programs = -(-words // (block * iters))
    out = torch.zeros(programs, dtype=torch.int32)
    rf.read(src, out, block, iters, 4)
    padded = torch.cat([src, src.new_zeros(programs * block * iters - words)]).view(programs, -1)
    assert [int(v) for v in out] == [int(rf._xor_all(row)) for row in padded]


@pytest.mark.skipif(not INTERPRETED, reason="runs under TRITON_INTERPRET=1 (test_under_interpreter)")
@pytest.mark.parametrize("tiled", [False, True])
def test_the_row_pattern_reads_each_programs_rows_and_chunks(tiled):
    rf = _bench()
    n, k, rows, split = 48, 512, 16, 2
    chunks, per = k // 128, k // 128 // split
    q = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, chunks, 16), dtype=torch.int32)
    sc = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, chunks, 2), dtype=torch.int32)
    tile = (lambda t: t.view(n // 16, 16, chunks, -1).permute(0, 2, 1, 3).contiguous()) if tiled else (lambda t: t)
    out = torch.zeros(n // rows * split, dtype=torch.int32)
    rf._rows_kernel[(n // rows, split)](tile(q), tile(sc), out, n, k // 8, k // 64, per, chunks, ROWS=rows,
                                        TILED=tiled)
    for p in range(n // rows):
        for s in range(split):
            part = (q[p * rows:(p + 1) * rows, s * per:(s + 1) * per].reshape(-1),
                    sc[p * rows:(p + 1) * rows, s * per:(s + 1) * per].reshape(-1))
            want = int(rf._xor_all(part[0])) ^ int(rf._xor_all(part[1]))
            assert int(out[p * split + s]) == want, (p, s)
