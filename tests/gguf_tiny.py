"""Test helper: write a tiny qwen2 GGUF (real byte-level BPE, Q8_0/F16/F32 tensors, qkv biases, a ChatML chat
template) and wheels of its parts."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, ROWS = 64, 2, 4, 2, 128, 320
SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
CORPUS = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
          "The quick brown fox jumps over the lazy dog. Hello, world! I'm here; it's 2024.\n") * 4
CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
    {% if message.role not in ("system", "user", "assistant") %}
        {{- raise_exception("roles are system, user and assistant, got " + message.role) }}
    {% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""


def _bpe() -> tuple[list[str], list[str]]:
    """Train a ~290-token byte-level BPE with the Qwen split; returns tokens by id and merges best-first."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from dspark_serve.models.tokenizer import QWEN_SPLIT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    import gguf
    from gguf.quants import quantize

    Q8, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
    tokens, merges = _bpe()
    tokens += [s for s, _ in SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [k for _, k in SPECIALS]
    types += [5] * (ROWS - len(tokens))  # llama.cpp pads the vocabulary to the embedding rows with UNUSED tokens
    tokens += [f"[PAD{i}]" for i in range(len(tokens), ROWS)]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], qtype, scale: float = 0.2, offset: float = 0.0) -> None:
        data = (offset + scale * rng.standard_normal(shape)).astype(np.float32)
        if qtype == Q8:
            w.add_tensor(name, quantize(data, Q8), raw_dtype=Q8)
        else:
            w.add_tensor(name, quantize(data, qtype))

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", (ROWS, HIDDEN), Q8)
    for i in range(LAYERS):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (HIDDEN,), F32, 0.1, 1.0)
        add(b + "attn_q.weight", (HIDDEN, HIDDEN), Q8)
        add(b + "attn_q.bias", (HIDDEN,), F32)
        add(b + "attn_k.weight", (KV_HEADS * head_dim, HIDDEN), F16)
        add(b + "attn_k.bias", (KV_HEADS * head_dim,), F32)
        add(b + "attn_v.weight", (KV_HEADS * head_dim, HIDDEN), Q8)
        add(b + "attn_v.bias", (KV_HEADS * head_dim,), F32)
        add(b + "attn_output.weight", (HIDDEN, HIDDEN), Q8)
        add(b + "ffn_norm.weight", (HIDDEN,), F32, 0.1, 1.0)
        add(b + "ffn_gate.weight", (FFN, HIDDEN), Q8)
        add(b + "ffn_up.weight", (FFN, HIDDEN), F16)
        add(b + "ffn_down.weight", (HIDDEN, FFN), Q8)
    add("output_norm.weight", (HIDDEN,), F32, 0.1, 1.0)
    add("output.weight", (ROWS, HIDDEN), Q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_part_wheels(gguf_path: Path, wheel_dir: Path, parts: int = 3, name: str = "fake") -> tuple[list[str], list[str]]:
    """Split the file into `parts` wheels `{name}_partN-0.9.0`; returns (pip specs, member paths) in join order."""
    data = gguf_path.read_bytes()
    step = -(-len(data) // parts)
    wheel_dir.mkdir(parents=True, exist_ok=True)
    specs, members = [], []
    for i in range(1, parts + 1):
        pkg, member = f"{name}_part{i}", f"{name}_part{i}/data/part{i:02d}.bin"
        info = f"{pkg}-0.9.0.dist-info"
        files = {member: data[(i - 1) * step:i * step],
                 f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}-part{i}\nVersion: 0.9.0\n".encode(),
                 f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
        record = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
        with zipfile.ZipFile(wheel_dir / f"{pkg}-0.9.0-py3-none-any.whl", "w") as z:
            for f, content in files.items():
                z.writestr(f, content)
            z.writestr(f"{info}/RECORD", record)
        specs.append(f"{name}-part{i}==0.9.0")
        members.append(member)
    return specs, members
