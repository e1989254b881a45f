"""Load a DFlash/DSpark draft from any supported format into DSparkDraft, sharing the target's embed/lm_head."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from dspark_serve.kernels import nvfp4

from .config import CheckpointError, read_json
from .draft_config import DraftConfig
from .dspark import DSparkDraft
from .nvfp4_linear import NVFP4Linear
from .quantize import nvfp4_layer_names, swap_in_nvfp4
from .qwen import QwenForCausalLM
from .weights import assign, read_state_dict

_VLLM_RENAMES = (("midlayer.", "layers.0."), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_DROPPED = ("t2d", "mask_embedding")
_NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def _canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    for old, new in _VLLM_RENAMES:
        name = name.replace(old, new) if name.startswith(old) else name
    return "d2t" if name == "draft_id_to_target_id" else name


def canonical_layer_names(names: set[str]) -> set[str]:
    """Module names from a quantization_config (vLLM or DeepSpec spelling) -> DeepSpec module names."""
    out = set()
    for name in map(_canonical_name, names):
        if name.endswith(".qkv_proj"):
            out |= {name.replace("qkv_proj", f"{p}_proj") for p in "qkv"}
        elif name.endswith(".gate_up_proj"):
            out |= {name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
        else:
            out.add(name)
    return out


def canonical_names(state: dict[str, Tensor], cfg: DraftConfig) -> dict[str, Tensor]:
    """vLLM-style names (`model.` prefix, stacked qkv/gate_up, renames) -> DeepSpec names."""
    out: dict[str, Tensor] = {}
    lc = cfg.layers
    for name, t in state.items():
        name = _canonical_name(name)
        if name.split(".")[0] in _DROPPED:
            continue
        # NVFP4 stacked projections: packed weight / weight_scale split by rows; the per-tensor scalars
        # (weight_scale_2, input_scale) are shared by every part.
        if ".qkv_proj." in name:
            chunks = [t] * 3 if t.dim() == 0 else t.split([lc.q_size, lc.kv_size, lc.kv_size])
            for part, chunk in zip(("q", "k", "v"), chunks):
                out[name.replace("qkv_proj", f"{part}_proj")] = chunk
        elif ".gate_up_proj." in name:
            gate, up = (t, t) if t.dim() == 0 else t.chunk(2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def load_draft(path: str | Path, target: QwenForCausalLM | None = None, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> DSparkDraft:
    """Every tensor is loaded or shared with `target`; nothing is left at its random init.

    ModelOpt NVFP4 checkpoints (`quantization_config` in config.json, or hf_quant_config.json) load their
    quantized linears as NVFP4Linear; every other tensor is loaded as usual.
    """
    where = str(path)
    cfg = DraftConfig.from_dir(path)
    state = canonical_names(read_state_dict(path), cfg)
    d2t = state.pop("d2t", None)
    target_vocab = target.config.vocab_size if target is not None else cfg.layers.vocab_size
    _check_vocab(cfg, state, d2t, target_vocab, where)
    names, nvfp4_state = _take_nvfp4(path, state, where)
    input_vocab = state["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in state else target_vocab
    with torch.device("meta"):
        model = DSparkDraft(cfg, input_vocab=input_vocab)
    model = model.to_empty(device="cpu")
    model.rotary.reset()
    shared = ("embed_tokens.weight", "lm_head.weight") if target is not None else ()
    names = _dequantize_embeddings(model, names, nvfp4_state, state)
    _check_linears(model, names, nvfp4_state, where)
    assign(model, state, where, optional=shared + tuple(f"{n}.weight" for n in names),
           dtype=dtype or cfg.layers.dtype)
    model.d2t = d2t.to(torch.int64) if d2t is not None else torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if names:
        try:
            swap_in_nvfp4(model, nvfp4_state, names)
        except ValueError as e:
            raise CheckpointError(f"{where}: NVFP4 layer {e}") from e
    model = model.to(device)  # before sharing: moving the draft must never move the target's modules
    if target is not None:
        _share(model, target, state, names)
    return model.eval()


def _take_nvfp4(path: str | Path, state: dict[str, Tensor], where: str) -> tuple[set[str], dict[str, Tensor]]:
    """Pops the NVFP4 tensors of the quantized linears out of `state`; returns (their names, their tensors)."""
    config = read_json(Path(path) / "config.json")
    hf_quant = Path(path) / "hf_quant_config.json"
    if not (config.get("quantization_config") or config.get("quantization")) and hf_quant.is_file():
        config = read_json(hf_quant)
    try:
        names = nvfp4_layer_names(config, keys=state.keys())
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    if not names:
        return set(), {}
    names = canonical_layer_names(names)
    nvfp4_state: dict[str, Tensor] = {}
    for name in sorted(names):
        for suffix in _NVFP4_SUFFIXES:
            t = state.pop(f"{name}.{suffix}", None)
            if t is not None and suffix != "input_scale":   # W4A16: activations stay unquantized
                nvfp4_state[f"{name}.{suffix}"] = t
        if f"{name}.bias" in state:
            nvfp4_state[f"{name}.bias"] = state[f"{name}.bias"]
    return names, nvfp4_state


def _dequantize_embeddings(model: DSparkDraft, names: set[str], nvfp4_state: dict[str, Tensor],
                           state: dict[str, Tensor]) -> set[str]:
    """NVFP4 tables read by row (markov_w1: one prev token's row per step) are stored 4-bit and loaded dense:
    their `.weight` goes back into `state`; -> the names still to load as NVFP4Linear."""
    rest = set()
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        keys = [f"{name}.{s}" for s in ("weight", "weight_scale", "weight_scale_2")]
        if isinstance(module, nn.Embedding) and all(k in nvfp4_state for k in keys):
            state[f"{name}.weight"] = nvfp4.dequantize(*(nvfp4_state.pop(k) for k in keys))
        else:
            rest.add(name)
    return rest


def _check_linears(model: DSparkDraft, names: set[str], nvfp4_state: dict[str, Tensor], where: str) -> None:
    """Every NVFP4 name must be a Linear of the draft and come with a packed uint8 weight."""
    for name in sorted(names):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, (nn.Linear, NVFP4Linear)):
            found = "nothing" if module is None else type(module).__name__
            raise CheckpointError(f"{where}: quantization_config names {name!r} as an NVFP4 layer, but the draft "
                                  f"has {found} there (expected a Linear)")
        packed = nvfp4_state.get(f"{name}.weight")
        if packed is not None and packed.dtype != torch.uint8:
            raise CheckpointError(f"{where}: quantization_config lists {name!r} as NVFP4 but {name}.weight is "
                                  f"{packed.dtype}, expected packed uint8")


def _check_vocab(cfg: DraftConfig, state: dict[str, Tensor], d2t: Tensor | None, target_vocab: int,
                 where: str) -> None:
    if cfg.draft_vocab_size < target_vocab:
        if "lm_head.weight" not in state:
            raise CheckpointError(f"{where}: reduced draft vocab ({cfg.draft_vocab_size} < target {target_vocab}) "
                                  "needs lm_head.weight in the checkpoint")
        if d2t is None:
            raise CheckpointError(f"{where}: reduced draft vocab ({cfg.draft_vocab_size} < target {target_vocab}) "
                                  "needs d2t (draft_id_to_target_id) in the checkpoint")
    if d2t is not None and tuple(d2t.shape) != (cfg.draft_vocab_size,):
        raise CheckpointError(f"{where}: tensor d2t has shape {tuple(d2t.shape)}, expected ({cfg.draft_vocab_size},)")
    w1 = state.get("markov_head.markov_w1.weight")
    input_vocab = w1.shape[0] if w1 is not None else cfg.layers.vocab_size
    if input_vocab > target_vocab and "embed_tokens.weight" not in state:
        raise CheckpointError(f"{where}: draft input vocab {input_vocab} is larger than the target's {target_vocab} "
                              "and the checkpoint has no embed_tokens.weight")


def _share(model: DSparkDraft, target: QwenForCausalLM, state: dict[str, Tensor],
           nvfp4: set[str] = frozenset()) -> None:
    """Alias the target's embedding / lm_head when the draft omits them or holds bitwise-equal copies.

    An NVFP4 lm_head is the draft's own quantized copy: it is kept, never replaced by the target's.
    """
    pairs = (("embed_tokens", target.model.embed_tokens), ("lm_head", target.lm_head))
    for name, theirs in pairs:
        if name in nvfp4:
            continue
        ours: nn.Module = getattr(model, name)
        mine = state.get(f"{name}.weight")
        if mine is None or (mine.shape == theirs.weight.shape and torch.equal(mine.to(theirs.weight.dtype),
                                                                             theirs.weight.detach().cpu())):
            if ours.weight.shape != theirs.weight.shape:
                raise CheckpointError(f"{name}: target's shape {tuple(theirs.weight.shape)} cannot stand in for the "
                                      f"draft's {tuple(ours.weight.shape)}")
            setattr(model, name, theirs)
