"""EngineConfig: everything one engine (the in-process LLM, a verifier or draft actor) is built from, as one frozen
dataclass; the CLI's flags (`add_engine_args`) and the Serve app's options map onto it through `from_options`.

Imports neither torch nor the kernels at module level: the gateway's process builds one to hand to the pair.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core.step_costs import StepCosts
from .spec_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from dspark_serve.kernels.config import KernelConfig

DTYPES = ("bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_NUM_KV_BLOCKS = 2048
DEFAULT_MAX_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    target: str | None  # the target checkpoint directory (HF); None: LLM.from_config is handed the model itself
    draft: str | None = None  # the draft checkpoint directory; None: speculative_config.model, or plain decoding
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    dtype: str | None = None  # "bfloat16" | "float16" | "float32"; None: the checkpoint's
    device: str = "auto"  # "auto": CUDA when available (in a pair: one GPU per actor when the cluster has GPUs)
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # per model; None: DEFAULT_NUM_KV_BLOCKS, or what gpu_memory_utilization fits
    gpu_memory_utilization: float | None = None  # on a GPU: as many KV blocks as fit in this share of its memory
    max_num_seqs: int = 64  # requests decoded together at most (CUDA graphs are recorded up to this batch)
    max_num_batched_tokens: int | None = None  # tokens one step processes (decode rows, verified drafts, prompt
    # chunks); None: DEFAULT_MAX_BATCHED_TOKENS, at least max_num_seqs
    max_model_len: int | None = None  # the longest prompt + output; None: the target's max_position_embeddings
    enforce_eager: bool | None = None  # vLLM's name; None: True on CPU, False on CUDA (static shapes, CUDA graphs)
    warmup: bool = True  # record the CUDA graphs at start rather than on the first requests that meet them
    tokenizer: str | None = None  # a tokenizer directory; None: the target directory's
    chat_template: str | None = None  # a Jinja file rendering chat input, overriding the target's template
    kernels: KernelConfig | None = None  # None: KernelConfig.for_device(the engine's device)
    step_costs: StepCosts | None = None  # the policy's step costs; None: measured when the engine starts
    enable_prefix_caching: bool = True  # full KV blocks shared between requests by the hash of their prefix
    deterministic: bool = False  # every target row computed as it would be alone (the batch-invariant kernels, or
    # one row at a time without Triton) and sampled tokens coupled by their keyed noise: a request's tokens do not
    # depend on its batch or on speculation

    def validate(self) -> None:
        """ValueError naming the field; the limits that need the loaded models (max_model_len against the target,
        num_speculative_tokens against the draft's block) are checked where those are loaded."""
        if self.target is not None and not (isinstance(self.target, str) and self.target):
            raise ValueError(f"target must be a checkpoint directory, got {self.target!r}")
        if not (self.device in DEVICES or str(self.device).startswith("cuda:")):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in (None, *DTYPES):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be true or false, got {self.deterministic!r}")
        for name in ("block_size", "max_num_seqs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        t = self.max_num_batched_tokens
        if t is not None and (not isinstance(t, int) or t < self.max_num_seqs):
            raise ValueError(f"max_num_batched_tokens must be an int >= max_num_seqs ({self.max_num_seqs}), got {t!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks must be an int >= 1, got {self.num_kv_blocks!r}")
        u = self.gpu_memory_utilization
        if u is not None and not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u}")
        if u is not None and self.num_kv_blocks is not None:
            raise ValueError("give num_kv_blocks or gpu_memory_utilization, not both")
        self.speculative_config.validate()
        if self.kernels is not None:
            self.kernels.validate()

    @property
    def batched_tokens(self) -> int:
        """The step's token budget."""
        t = self.max_num_batched_tokens
        return max(DEFAULT_MAX_BATCHED_TOKENS, self.max_num_seqs) if t is None else t

    @property
    def kv_blocks(self) -> int:
        """The KV blocks of each model when not sized from GPU memory."""
        return DEFAULT_NUM_KV_BLOCKS if self.num_kv_blocks is None else self.num_kv_blocks

    def resolved_device(self) -> str:
        """"auto" -> "cuda" when this process sees a GPU, else "cpu"; anything else as given."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return getattr(torch, self.dtype) if self.dtype else None

    def kernel_config(self, device: torch.device | str) -> KernelConfig:
        """The kernel choices to install on `device`: the configured ones, else that device's defaults."""
        from dspark_serve.kernels.config import KernelConfig

        return self.kernels if self.kernels is not None else KernelConfig.for_device(device)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> EngineConfig:
        """A validated config from plain values by field name (the CLI's flags, the Serve app's args, LLM's
        keywords): speculative_config and kernel_config as JSON text, a dict or the config itself; dtype "auto"
        or a torch.dtype; paths as str or Path; None for a field: its default. An unknown name is refused."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine options {unknown}; known: {sorted(OPTIONS)}")
        raw = {k: v for k, v in options.items() if v is not None}
        spec = raw.pop("speculative_config", None)
        spec = spec if isinstance(spec, SpeculativeConfig) else SpeculativeConfig.from_json(spec)
        kernels = raw.pop("kernel_config", raw.pop("kernels", None))
        costs = raw.get("step_costs")
        if isinstance(costs, (str, Path)):
            import json
            text = Path(costs).read_text() if Path(costs).is_file() else str(costs)
            try:
                costs = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"step_costs is neither a JSON object nor a JSON file: {e}") from None
        if isinstance(costs, dict):
            raw["step_costs"] = StepCosts.from_dict(costs)
        dtype = raw.pop("dtype", None)
        dtype = None if dtype == "auto" else (str(dtype).removeprefix("torch.") if dtype is not None else None)
        for name in ("target", "draft", "tokenizer", "chat_template"):
            if isinstance(raw.get(name), Path):
                raw[name] = str(raw[name])
        raw.setdefault("draft", spec.model)
        cfg = cls(**{"target": None, **raw}, speculative_config=spec, dtype=dtype)
        if kernels is not None:
            cfg = replace(cfg, kernels=_kernel_config(kernels, cfg))
        cfg.validate()
        return cfg


OPTIONS = frozenset({f.name for f in fields(EngineConfig)} | {"kernel_config"})  # kernel_config: kernels' option


def split_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine's options, the rest) of a mapping of options by name."""
    return ({k: v for k, v in options.items() if k in OPTIONS},
            {k: v for k, v in options.items() if k not in OPTIONS})


def _kernel_config(value: Any, cfg: EngineConfig) -> KernelConfig:
    """--kernel-config's JSON (or a dict) over the defaults of the device this process resolves `cfg.device` to;
    the fields it names hold on every device."""
    from dspark_serve.kernels.config import KernelConfig

    if isinstance(value, KernelConfig):
        return value
    device = cfg.resolved_device()
    if device.startswith("cuda"):
        import torch

        device = device if torch.cuda.is_available() else "cpu"  # a gateway host without the pair's GPUs
    return KernelConfig.from_json(value, device)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, named after EngineConfig's fields (`EngineConfig.from_options(vars(args))` reads them;
    the target is each command's own argument)."""
    p = parser
    p.add_argument("--draft", help="the draft checkpoint directory (DeepSpec, z-lab DFlash, speculators or vLLM "
                                   "names; or speculative_config's \"model\"); none: plain decoding")
    p.add_argument("--speculative-config",
                   help='JSON with vLLM\'s field names, e.g. {"model": DIR, "num_speculative_tokens": 7}')
    p.add_argument("--kernel-config",
                   help='JSON of kernel choices over the device\'s defaults (KernelConfig\'s fields in '
                        'kernels/config.py), e.g. {"pdl": false, "prompt_graphs": false}')
    p.add_argument("--device", choices=list(DEVICES), default="auto",
                   help="auto: CUDA when available (serving: one GPU per actor when the cluster has GPUs)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto: the checkpoint's")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int,
                   help=f"KV-cache blocks of each model (default {DEFAULT_NUM_KV_BLOCKS})")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="on a GPU: as many KV blocks as fit in this share of its memory beside the weights and the "
                        "CUDA graphs (vLLM's flag; one process's caches: co-located pairs); default: --num-kv-blocks")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests decoded together at most (CUDA graphs are recorded up to this batch)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens one step processes at most: decode rows, verified drafts and prompt chunks (long "
                        "prompts are prefilled in chunks beside running streams; vLLM's flag; default "
                        f"{DEFAULT_MAX_BATCHED_TOKENS}, at least --max-num-seqs)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share full KV blocks (target and draft) between requests whose prompts start alike, evicted "
                        "least recently used (vLLM's flag; default on)")
    p.add_argument("--step-costs",
                   help="the speculation policy's step costs (JSON or a JSON file, StepCosts.to_dict's shape: verify "
                        "ms by requests and tokens, draft ms by requests); default: measured when the engine starts")
    p.add_argument("--max-model-len", type=int,
                   help="longest prompt + output (default: the target's max_position_embeddings; larger is refused)")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs (vLLM's flag)")
    p.add_argument("--deterministic", "--enable-deterministic-inference", dest="deterministic", action="store_true",
                   default=None, help="a request's tokens do not depend on what runs beside it, and speculative "
                                      "output equals plain output, greedy and seeded (each row computed on its own: "
                                      "slower; docs/serving.md)")
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the target's)")
    p.add_argument("--chat-template", help="a Jinja chat template file for chat input, overriding the target's")
