"""ModelOpt NVFP4 (W4A16, group 16) checkpoints: read `quantization_config`, quantize a state dict or a whole
bf16 draft checkpoint (`dspark-serve quantize SRC DST`), and swap NVFP4Linear into a loaded model.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from dspark_serve.kernels import nvfp4

from .nvfp4_linear import NVFP4Linear

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
# Draft weights worth 4 bits: fc, attention/MLP projections, lm_head, both Markov factors (markov_w1, a table
# read by row, loads dense; a rank below 16 stays unquantized); not the embedding, norms or heads.
DEFAULT_INCLUDE = ("fc", "layers.*_proj", "lm_head", "markov_head.markov_w1", "markov_head.markov_w2")


def _check_group(entry: dict, where: str) -> None:
    group = entry.get("group_size", 16)
    if group != 16:
        raise ValueError(f"{where}: NVFP4 group_size must be 16, got {group}")


def nvfp4_layer_names(config: dict, keys: Iterable[str] | None = None) -> set[str] | None:
    """Module names stored as NVFP4, or None when the checkpoint is not NVFP4-quantized.

    Accepts config.json (`quantization_config`) or hf_quant_config.json (`quantization`). A global quant_algo
    lists no names, so its set comes from `keys` (every `<name>.weight_scale`) minus `exclude_modules`.
    """
    qc = config.get("quantization_config") or config.get("quantization")
    if not qc:
        return None
    algo = qc.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = qc.get("quantized_layers") or {}
        names = set()
        for name, entry in layers.items():
            if entry.get("quant_algo") not in NVFP4_ALGOS:
                raise ValueError(f"quantized_layers[{name!r}]: expected quant_algo in {NVFP4_ALGOS}, "
                                 f"got {entry.get('quant_algo')!r}")
            _check_group(entry, f"quantized_layers[{name!r}]")
            names.add(name)
        return names
    if algo not in NVFP4_ALGOS:
        raise ValueError(f"quantization_config.quant_algo: expected one of {NVFP4_ALGOS + ('MIXED_PRECISION',)}, "
                         f"got {algo!r}")
    _check_group(qc, "quantization_config")
    if keys is None:
        raise ValueError(f"quant_algo {algo} names no layers: pass the checkpoint keys to find them")
    exclude = qc.get("exclude_modules") or []
    found = {k.removesuffix(".weight_scale") for k in keys if k.endswith(".weight_scale")}
    return {n for n in found if not any(fnmatch.fnmatch(n, pat) for pat in exclude)}


def default_layer_names(state_dict: dict[str, Tensor], include: Iterable[str] = DEFAULT_INCLUDE) -> set[str]:
    """Names of 2-D `<name>.weight` tensors that match a pattern in `include` and have K % 16 == 0."""
    names = set()
    for key, t in state_dict.items():
        name = key.removesuffix(".weight")
        if key.endswith(".weight") and t.dim() == 2 and t.shape[1] % 16 == 0 and t.is_floating_point() \
                and any(fnmatch.fnmatch(name, pat) for pat in include):
            names.add(name)
    return names


def quantize_state_dict(state_dict: dict[str, Tensor], names: Iterable[str],
                        device: torch.device | str | None = None) -> dict[str, Tensor]:
    """`<name>.weight` -> ModelOpt `<name>.weight` uint8, `.weight_scale` fp8, `.weight_scale_2` fp32, on CPU."""
    out = dict(state_dict)
    for name in sorted(names):
        w = state_dict.get(f"{name}.weight")
        if w is None or w.dim() != 2:
            raise ValueError(f"{name}.weight: expected a 2-D float weight, got {None if w is None else tuple(w.shape)}")
        packed, scale, scale_2 = nvfp4.quantize(w.to(device) if device is not None else w)
        out[f"{name}.weight"], out[f"{name}.weight_scale"] = packed.cpu(), scale.cpu()
        out[f"{name}.weight_scale_2"] = scale_2.cpu()
    return out


def quantization_config(names: Iterable[str]) -> dict:
    layers = {n: {"quant_algo": "W4A16_NVFP4", "group_size": 16} for n in sorted(names)}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers}


def quantize_checkpoint(src_dir: str | Path, dst_dir: str | Path, include: Iterable[str] = DEFAULT_INCLUDE,
                        device: torch.device | str | None = None) -> set[str]:
    """Writes dst_dir/model.safetensors + config.json (with quantization_config); returns the quantized names."""
    from safetensors.torch import load_file, save_file
    src, dst = Path(src_dir), Path(dst_dir)
    files = sorted(src.glob("*.safetensors"))
    if not files or not (src / "config.json").exists():
        raise FileNotFoundError(f"{src}: expected config.json and *.safetensors")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(f))
    names = default_layer_names(state, include)
    if not names:
        raise ValueError(f"{src}: no 2-D weight matches {list(include)}")
    out = quantize_state_dict(state, names, device)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json",
                                                                          "resume.pt"):
            shutil.copy2(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(names)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return names


def swap_in_nvfp4(module: nn.Module, state_dict: dict[str, Tensor], names: Iterable[str]) -> nn.Module:
    """Replaces each nn.Linear named in `names` by an NVFP4Linear holding the state dict's tensors."""
    for name in sorted(names):
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child, None)
        if not isinstance(old, (nn.Linear, NVFP4Linear)):
            raise ValueError(f"{name}: expected an nn.Linear to replace, found {type(old).__name__}")
        keys = [f"{name}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")]
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(f"{name}: NVFP4 checkpoint lacks {missing}")
        bias = state_dict.get(f"{name}.bias")
        new = NVFP4Linear.from_tensors(*(state_dict[k] for k in keys), bias=bias)
        if (new.in_features, new.out_features) != (old.in_features, old.out_features):
            raise ValueError(f"{name}: NVFP4 weight is [{new.out_features}, {new.in_features}], "
                             f"the module expects [{old.out_features}, {old.in_features}]")
        setattr(parent, child, new)
    return module


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dspark-serve quantize",
                                description="Write a ModelOpt W4A16 NVFP4 checkpoint from a bf16 draft checkpoint.")
    p.add_argument("src", help="directory with config.json and *.safetensors")
    p.add_argument("dst", help="output directory")
    p.add_argument("--include", nargs="+", default=list(DEFAULT_INCLUDE),
                   help="fnmatch patterns of module names to quantize (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    names = quantize_checkpoint(args.src, args.dst, args.include, args.device)
    print(f"quantized {len(names)} linears to NVFP4 -> {args.dst}")
    return 0
