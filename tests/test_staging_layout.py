"""The staging buffers' named layouts: pack writes the fields in order, views cut the buffer the same way."""

import pytest
import torch

from dspark_serve.engine.runner.prompt_graphs import prompt_layout
from dspark_serve.engine.runner.staging import Layout
from dspark_serve.engine.runner.target_graphs import verify_floats, verify_layout


def test_pack_and_views_agree():
    layout = Layout(ids=3, slots=3, last=1, table=2)
    assert layout.size == 9 and layout.offsets == {"ids": 0, "slots": 3, "last": 6, "table": 7}
    packed = layout.pack(table=[8, 9], ids=[1, 2, 3], last=[7], slots=[4, 5, 6])  # keywords in any order
    assert packed == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    buf = torch.tensor(packed)
    v = layout.views(buf)
    assert v["slots"].tolist() == [4, 5, 6] and layout.view(buf, "table").tolist() == [8, 9]
    v["last"].fill_(0)
    assert buf[6] == 0  # views write into the buffer
    with pytest.raises(ValueError, match="staging field slots takes 3 values, got 2"):
        layout.pack(ids=[1, 2, 3], slots=[4, 5], last=[7], table=[8, 9])


def test_step_layouts_hold_what_the_graphs_read():
    b, t, n, w = 2, 6, 3, 3
    assert verify_layout(b, t, n, w).size == 4 * b + 1 + 3 * t + (b + 1) + 2 * b + b * (1 + n) + b * w
    assert list(verify_layout(b, t, n, w).lengths) == ["anchors", "starts", "caps", "pinned", "budget", "src",
                                                      "positions", "slots", "cu", "seq_lens", "num", "idx",
                                                      "block_table"]
    assert list(verify_floats(b, n).lengths) == ["ratios", "thresholds"] and verify_floats(b, n).size == b * n + b
    assert prompt_layout(32, 2).size == 2 * 32 + 1 + 2
