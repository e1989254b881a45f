"""`pip install .` puts one namespace, dspark_serve, into site-packages, and it imports from there."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_install_puts_only_the_namespace_at_top_level(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(ROOT)], check=True, cwd=tmp_path)
    top = sorted(p.name for p in site.iterdir() if p.name != "bin")
    assert top[0] == "dspark_serve" and len(top) == 2 and top[1].startswith("dspark_serve-"), top
    pkgs = sorted(p.name for p in (site / "dspark_serve").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert {"models", "kernels", "engine", "actors", "cluster", "protos"} <= set(pkgs)
    code = ("import dspark_serve.models.qwen, dspark_serve.kernels.attention, dspark_serve.cluster.commands.cli as c; "
            "print(c.__file__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout
    assert out.startswith(str(site))
    assert (site / "bin" / "dspark-serve").is_file()
    models = site / "dspark_serve" / "models"
    assert {p.name for p in (models / "checkpoints" / "qwen2.5-coder-0.5b-dspark").iterdir()} \
        >= {"config.json", "model.safetensors"}
    assert (models / "token_maps" / "qwen2.5-coder-0.5b-instruct-32768.pt").is_file()


def test_cpu_install_needs_no_triton():
    """CPU torch brings no triton: the engine, actors and Serve app import with triton unavailable."""
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] == 'triton':
            raise ImportError('triton blocked')
sys.meta_path.insert(0, Block())
import dspark_serve.engine.llm, dspark_serve.actors.draft_actor, dspark_serve.cluster.serve_app
from dspark_serve.kernels import nvfp4
import torch
packed, scale, scale_2 = nvfp4.quantize(torch.randn(4, 32))
print(nvfp4.dequantize(packed, scale, scale_2).shape)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([4, 32])"
