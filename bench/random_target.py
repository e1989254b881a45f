"""A random-weight Qwen2.5-0.5B-shaped target with the demo target's real tokenizer and chat template, for GPU runs
that need text and timing but not the real weights (no GGUF to stage).

  here:  python bench/random_target.py pack [~/.cache/dspark-serve/qwen2.5-coder-0.5b-instruct] .work/tok
         (the tokenizer files, xz-compressed: 1.4 MB to carry)
  there: python3 bench/random_target.py build .work/tok /tmp/rt
"""

from __future__ import annotations

import lzma
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
FILES = ("tokenizer_config.json", "generation_config.json")


def pack(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json.xz").write_bytes(lzma.compress((src / "tokenizer.json").read_bytes()))
    for f in FILES:
        shutil.copy(src / f, out / f)


def build(packed: Path, out: Path) -> None:
    import torch
    from bench_step import random_target

    from dspark_serve.models.random_init import save_target

    save_target(random_target("cuda" if torch.cuda.is_available() else "cpu", torch.bfloat16), out)
    (out / "tokenizer.json").write_bytes(lzma.decompress((packed / "tokenizer.json.xz").read_bytes()))
    for f in FILES:
        shutil.copy(packed / f, out / f)
    print("random target at", out)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] in ("pack", "build"):
        (pack if sys.argv[1] == "pack" else build)(Path(sys.argv[2]).expanduser(), Path(sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "pack":
        pack(Path("~/.cache/dspark-serve/qwen2.5-coder-0.5b-instruct").expanduser(), Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
