"""KernelConfig: one typed config for the kernel and graph choices; only `from_env` reads the environment."""

import ast
from pathlib import Path

import pytest
import torch

from dspark_serve.kernels import config
from dspark_serve.kernels.config import KernelConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("kernels", "models", "engine", "actors", "cluster", "train", "protos")


def test_from_env_reads_one_variable_per_field():
    cfg = KernelConfig.from_env(environ={"DSPARK_PDL": "0", "DSPARK_DENSE_TILED": "auto", "DSPARK_TRITON": "1",
                                         "DSPARK_PROMPT_GRAPH_WORK": "2e9", "DSPARK_OTHER": "x"})
    assert (cfg.pdl, cfg.dense_tiled, cfg.triton, cfg.prompt_graph_work) == (False, None, True, 2e9)
    assert cfg.dense_gemv and cfg.gemv_prmt  # untouched fields keep their defaults
    with pytest.raises(ValueError, match="pdl takes"):
        KernelConfig.from_env(environ={"DSPARK_PDL": "maybe"})


def test_json_and_overrides_are_checked():
    assert KernelConfig.from_json('{"pdl": false, "DENSE_MMA": "0"}') == KernelConfig(pdl=False, dense_mma=False)
    assert KernelConfig.from_json(None) == KernelConfig.for_device("cpu") == KernelConfig()
    with pytest.raises(ValueError, match="unknown kernel config field 'pld'; known: .*'pdl'"):
        KernelConfig.from_json('{"pld": false}')
    with pytest.raises(ValueError, match="not valid JSON"):
        KernelConfig.from_json("{pdl")
    with pytest.raises(ValueError, match="must be a JSON object"):
        KernelConfig.from_json("[1]")
    with pytest.raises(ValueError, match="gemv_mma must be true or false"):
        KernelConfig(gemv_mma=1).validate()
    with pytest.raises(ValueError, match="dense_tiled_max_fraction"):
        KernelConfig(dense_tiled_max_fraction=2.0).validate()


def test_using_installs_for_a_block_and_use_triton_follows_it():
    x = torch.zeros(2)
    before = config.active()
    with torch.inference_mode(), config.using(KernelConfig(triton=False)):
        assert not config.use_triton(x)
        with config.using(KernelConfig(triton=True)):
            assert config.use_triton(x) == config.HAVE_TRITON
    with config.using(KernelConfig(triton=True)):
        assert not config.use_triton(x)  # autograd takes the references
    assert config.active() is before
    with torch.inference_mode():
        assert not config.use_triton(x)  # the default: CPU tensors take the references


def _environ_reads(tree: ast.AST) -> list[int]:
    """Lines of os.environ / os.getenv uses in a module."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
    return lines


def test_only_from_env_reads_the_environment_for_kernel_choices():
    """No kernel, model or engine module reads the environment (but models/fetch.py for its cache directory); in
    kernels/config.py only from_env does."""
    readers = {}
    for folder in ("kernels", "models", "engine"):
        for path in sorted((ROOT / folder).glob("*.py")):
            lines = _environ_reads(ast.parse(path.read_text()))
            if lines:
                readers[f"{folder}/{path.name}"] = lines
    src = (ROOT / "kernels/config.py").read_text()
    tree = ast.parse(src)
    from_env = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "from_env")
    inside = set(range(from_env.lineno, from_env.end_lineno + 1))
    assert set(readers.pop("kernels/config.py", [])) <= inside
    readers.pop("models/fetch.py", None)  # DSPARK_CACHE: where downloads go, not a kernel choice
    assert readers == {}
    for folder in PACKAGE:  # and no module anywhere names a DSPARK_ kernel switch
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "DSPARK_" not in text or path.name == "config.py" or all(
                name in ("DSPARK_CACHE", "DSPARK_API_KEY") for name in _dspark_names(text)), path


def _dspark_names(text: str) -> set[str]:
    import re
    return set(re.findall(r"DSPARK_[A-Z_]+", text))
