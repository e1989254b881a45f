"""Convert a llama.cpp GGUF (arch qwen2 or qwen3) into an HF folder our loader reads: dequantized
model.safetensors, config.json, generation_config.json, a tokenizer.json rebuilt from the metadata and a
tokenizer_config.json with the special tokens and the chat template."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import CheckpointError
from .tokenizer import QWEN_SPLIT

_ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LAYER_WEIGHTS = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


def _fields(reader: Any) -> dict[str, Any]:
    """Scalar metadata by key; the 150k-entry vocabulary arrays are read once, by `_tokenizer`."""
    return {name: field.contents() for name, field in reader.fields.items() if name not in _VOCAB_ARRAYS}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m[2] in _BLOCK:
        return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.{m[3]}"
    return None


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    shape = [int(n) for n in reversed(tensor.shape)]  # GGUF lists dims fastest-first
    # Copy: F32 tensors come back as read-only views of the memory-mapped file.
    return np.array(dequantize(tensor.data, tensor.tensor_type).reshape(shape), dtype=np.float32)


def _check_tensors(names: set[str], arch: str, layers: int, where: str) -> None:
    wanted = ["token_embd.weight", "output_norm.weight"]
    per_layer = list(_LAYER_WEIGHTS) + (["attn_q_norm", "attn_k_norm"] if arch == "qwen3" else [])
    wanted += [f"blk.{i}.{k}.weight" for i in range(layers) for k in per_layer]
    if arch == "qwen2":
        wanted += [f"blk.{i}.attn_{p}.bias" for i in range(layers) for p in "qkv"]
    missing = [n for n in wanted if n not in names]
    if missing:
        raise CheckpointError(f"{where}: {len(missing)} tensors missing for a {arch} GGUF, e.g. {missing[:4]}")


def _config(meta: dict[str, Any], arch: str, vocab_size: int, tied: bool, dtype: torch.dtype) -> dict[str, Any]:
    a = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    cfg = {
        "architectures": [_ARCHS[arch]], "model_type": arch, "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")), "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": int(a("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(a("context_length", 32768)),
        # Stored as float32: print it back at that precision (1e-06, not 9.999999974752427e-07).
        "rms_norm_eps": float(str(np.float32(a("attention.layer_norm_rms_epsilon", 1e-6)))),
        "rope_theta": float(a("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "tie_word_embeddings": tied, "attention_bias": arch == "qwen2", "use_sliding_window": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            cfg[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    return cfg


def _tokenizer(reader: Any) -> Any:
    """Byte-level BPE with the Qwen split, as in Qwen's own tokenizer.json; control tokens become special."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    f = reader.fields
    if "tokenizer.ggml.tokens" not in f or "tokenizer.ggml.merges" not in f:
        raise CheckpointError("GGUF has no tokenizer.ggml.tokens / tokenizer.ggml.merges (not a BPE vocabulary)")
    model = f["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in f else None
    if model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model: expected 'gpt2' (byte-level BPE), got {model!r}")
    tokens: list[str] = f["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in f["tokenizer.ggml.merges"].contents()]
    types = f["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in f else [1] * len(tokens)
    tok = Tokenizer(BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added tokens in id order keep their ids: each is already in the BPE vocabulary.
    for token, kind in zip(tokens, types):
        if kind in (_CONTROL, _USER_DEFINED):
            tok.add_special_tokens([AddedToken(token, special=kind == _CONTROL, normalized=False)])
    return tok


def _tokenizer_config(meta: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Special tokens by name and the GGUF's chat template. A token the GGUF does not name is written as null, so
    transformers does not put its tokenizer class's default (Qwen2's eos "<|endoftext|>") in its place."""
    cfg: dict[str, Any] = {}
    for name, gguf_key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        cfg[f"{name}_token"] = None if token_id is None else tokenizer.id_to_token(int(token_id))
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = str(meta["tokenizer.chat_template"])
    return cfg


def _progress(done: int, total: int, enabled: bool) -> None:
    """A rewritten line on a terminal; about every tenth tensor, one line each, in a log."""
    if not enabled:
        return
    if sys.stderr.isatty():
        print(f"\r[{done}/{total}] tensors dequantized", end="\n" if done == total else "", file=sys.stderr, flush=True)
    elif done == total or done % max(1, total // 10) == 0:
        print(f"[{done}/{total}] tensors dequantized", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                 progress: bool = True) -> Path:
    """Dequantize every tensor of a qwen2/qwen3 GGUF and write an HF checkpoint folder; returns out_dir."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    gguf_path, out = Path(gguf_path), Path(out_dir)
    try:
        reader = GGUFReader(str(gguf_path))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{gguf_path}: not a readable GGUF ({e})") from e
    meta = _fields(reader)
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise CheckpointError(f"{gguf_path}: GGUF architecture {arch!r} is not supported (expected one of {sorted(_ARCHS)})")
    _check_tensors({t.name for t in reader.tensors}, arch, int(meta[f"{arch}.block_count"]), str(gguf_path))
    state: dict[str, torch.Tensor] = {}
    for k, t in enumerate(reader.tensors, 1):
        name = _hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{gguf_path}: unexpected tensor {t.name!r} for arch {arch}")
        state[name] = torch.from_numpy(_dequantize(t)).to(dtype)
        _progress(k, len(reader.tensors), progress)
    # A tied model may still ship a separately quantized output.weight: keep both, as the file does.
    tied = "lm_head.weight" not in state
    cfg = _config(meta, arch, state["model.embed_tokens.weight"].shape[0], tied, dtype)
    tokenizer = _tokenizer(reader)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf_path.name})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    end_of_text = tokenizer.token_to_id("<|endoftext|>")  # Qwen's own generation config stops on both
    if "eos_token_id" in gen and end_of_text is not None and end_of_text != gen["eos_token_id"]:
        gen["eos_token_id"] = [gen["eos_token_id"], end_of_text]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(meta, tokenizer), indent=2,
                                                          ensure_ascii=False) + "\n", encoding="utf-8")
    return out
