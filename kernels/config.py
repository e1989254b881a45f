"""The kernel and graph choices of inference, as one frozen KernelConfig.

The engine builds it once (`KernelConfig.for_device`: the defaults the device can run, then the CLI's
`--kernel-config` or, for A/B runs, `from_env`) and installs it before it prepares its models; the kernels read the
installed one (`active()`). Each field's comment gives what it measured (bench/RESULTS.md holds the runs).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


def _have_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # a finder that refuses it
        return False


HAVE_TRITON = _have_triton()  # an optional extra (`dspark-serve[triton]`); CPU torch comes without it


@dataclass(frozen=True)
class KernelConfig:
    # Inference on CUDA runs the Triton kernels (None: when Triton is installed); True also runs them on CPU tensors,
    # which needs Triton's interpreter (TRITON_INTERPRET=1, the tests); False: the PyTorch references everywhere.
    triton: bool | None = None
    # The 1 < M <= 64 NVFP4 GEMV decodes with the inline PTX of e2m1_prmt.py on sm_90+ (1.7-2.4x the integer decode
    # on an H200).
    gemv_prmt: bool = True
    # M <= 16 NVFP4 GEMVs on sm_90+ take the register-fed mma.sync kernel (w4a16_gemv_mma.py) where K % 128 == 0 and
    # N % 16 == 0.
    gemv_mma: bool = True
    # An NVFP4 draft's q/k/v and gate/up run as one stacked GEMV each (nvfp4_linear.NVFP4Stack) at 2-16 rows.
    nvfp4_stack: bool = True
    # The target's one-row decode GEMVs take the Triton dense GEMV (gemv_bf16.py) instead of cuBLAS (8B plain step
    # on an H200: 4.52 instead of 4.82 ms).
    dense_gemv: bool = True
    # 2-16 rows of bf16 activations (verify's 1 + 7, batch-8 decode) take the register-fed mma GEMV of
    # gemv_bf16_mma.py on sm_90 (8B verify 1 + 7: 4.65 instead of 5.16 ms).
    dense_mma: bool = True
    # Tile-major copies of the bf16 projections for those rows (twice their memory; demo-shape verify graph 766
    # instead of 827 us). None: when the copies take at most `dense_tiled_max_fraction` of the GPU's memory.
    dense_tiled: bool | None = None
    dense_tiled_max_fraction: float = 0.02
    # The target's lm_head takes the GEMVs above instead of cuBLAS (8B lm_head: 278 / 285 instead of 296 / 299 us).
    lm_head_gemv: bool = True
    # The one-row GEMV applies the layer's RMSNorm (and residual add) before q/k/v and gate/up itself.
    norm_gemv: bool = True
    # The GEMV computes SwiGLU in the gate/up projection's epilogue (no silu_mul launch).
    gemv_swiglu: bool = True
    # The decode step's Triton kernels launch with programmatic dependent launch on sm_90+ (kernels/pdl.py; 8B plain
    # step: 4.19-4.29 instead of 4.50-4.56 ms).
    pdl: bool = True
    # Fresh prompts longer than 16 tokens attend with one causal SDPA instead of the paged reference.
    prompt_sdpa: bool = True
    # Prefills of fresh prompts replay CUDA graphs (engine/runner/prompt_graphs.py) while their padded tokens x one
    # layer's weights stay within `prompt_graph_work` (inf: no limit).
    prompt_graphs: bool = True
    prompt_graph_work: float = 1.6e11
    # Up to this many prompts of a prefill step replay their graphs one after another; more run eagerly as one batch.
    # Served at c = 64 on an H100 (real demo pair, alternated runs) 8 gave 5-6 % fewer tokens/s than 4.
    prompt_graph_max_prompts: int = 4
    # Two or more prompts of a prefill step run as one packed graph (their tokens one after another, varlen) instead
    # of a graph each or an eager batch (H100, real demo pair, c = 64: in-process TTFT p50 25.0 against 39.1 ms; served
    # steps of 55-59 prompts 18-21 against 46 ms eagerly).
    prompt_graph_packed: bool = True
    # The deterministic mode's matmul (matmul_invariant.config_for, by each weight's shape alone): K split until one
    # row tile's programs reach this many (0: K whole), in tiles of invariant_block_n output columns, K walked in
    # steps of invariant_block_k, invariant_warps warps a program.
    invariant_programs: int = 0
    invariant_block_n: int = 32
    invariant_block_k: int = 128
    invariant_warps: int = 4

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("triton", "dense_tiled"):
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"kernel config {f.name} must be true, false or null, got {value!r}")
            elif f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"kernel config {f.name} must be true or false, got {value!r}")
        if not 0 <= self.dense_tiled_max_fraction <= 1:
            raise ValueError(f"kernel config dense_tiled_max_fraction must be in [0, 1], "
                             f"got {self.dense_tiled_max_fraction!r}")
        if not isinstance(self.prompt_graph_max_prompts, int) or isinstance(self.prompt_graph_max_prompts, bool) \
                or self.prompt_graph_max_prompts < 1:
            raise ValueError("kernel config prompt_graph_max_prompts takes an int >= 1, got "
                             f"{self.prompt_graph_max_prompts!r}")
        if not isinstance(self.invariant_programs, int) or isinstance(self.invariant_programs, bool) \
                or self.invariant_programs < 0:
            raise ValueError(f"kernel config invariant_programs takes an int >= 0, got {self.invariant_programs!r}")
        for name in ("invariant_block_n", "invariant_block_k", "invariant_warps"):
            allowed = (2, 4, 8) if name == "invariant_warps" else (16, 32, 64, 128, 256)
            if getattr(self, name) not in allowed:
                raise ValueError(f"kernel config {name} takes one of {allowed}, got {getattr(self, name)!r}")
        if not (isinstance(self.prompt_graph_work, (int, float)) and self.prompt_graph_work >= 0):  # refuses nan
            raise ValueError("kernel config prompt_graph_work takes a number >= 0 (padded prompt tokens x weights of "
                             f"one layer; inf: no limit), got {self.prompt_graph_work!r}")

    @classmethod
    def for_device(cls, device: torch.device | str, **overrides: Any) -> KernelConfig:
        """The defaults a device runs: the sm_90 kernels (inline PTX, mma GEMVs, PDL) off below sm_90; then the
        overrides (field names)."""
        device = torch.device(device)
        base: dict[str, Any] = {}
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
            base = dict(gemv_prmt=False, gemv_mma=False, dense_mma=False, pdl=False)
        cfg = replace(cls(), **{**base, **overrides})
        cfg.validate()
        return cfg

    def with_overrides(self, items: Mapping[str, Any]) -> KernelConfig:
        """Fields by name (case-insensitive), values as Python values or the strings 0 / 1 / true / false / auto /
        a number -> a new validated config; an unknown name is refused, naming the known ones."""
        known = {f.name: f for f in fields(self)}
        parsed: dict[str, Any] = {}
        for key, value in items.items():
            name = key.lower()
            if name not in known:
                raise ValueError(f"unknown kernel config field {key!r}; known: {sorted(known)}")
            parsed[name] = _parse(name, value, known[name].type)
        cfg = replace(self, **parsed)
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, text: str | Mapping[str, Any] | None, device: torch.device | str = "cpu") -> KernelConfig:
        """--kernel-config: a JSON object of fields over the device's defaults."""
        if text is None or text == "":
            return cls.for_device(device)
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kernel config is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"kernel config must be a JSON object, got {type(raw).__name__}")
        return cls.for_device(device).with_overrides(raw)

    @classmethod
    def from_env(cls, device: torch.device | str = "cpu", environ: Mapping[str, str] | None = None) -> KernelConfig:
        """For A/B runs: DSPARK_<FIELD> (e.g. DSPARK_PDL=0, DSPARK_DENSE_TILED=auto) over the device's defaults."""
        environ = os.environ if environ is None else environ
        names = {f"DSPARK_{f.name.upper()}": f.name for f in fields(cls)}
        return cls.for_device(device).with_overrides({names[k]: v for k, v in environ.items() if k in names})


def _parse(name: str, value: Any, annotation: str) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if annotation == "int":
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"kernel config {name} takes an integer, got {value!r}") from None
    if annotation == "float":
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"kernel config {name} takes a number, got {value!r}") from None
    table = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
    if annotation == "bool | None":
        table = {**table, "auto": None, "none": None, "null": None}
    if text not in table:
        raise ValueError(f"kernel config {name} takes {'/'.join(table)}, got {value!r}")
    return table[text]


_active = KernelConfig()


def active() -> KernelConfig:
    """The installed config (KernelConfig() until an engine installs one)."""
    return _active


def install(cfg: KernelConfig) -> None:
    """Make `cfg` the kernels' choices in this process (the engine does, once, before it prepares its models)."""
    global _active
    cfg.validate()
    _active = cfg


@contextmanager
def using(cfg: KernelConfig) -> Iterator[KernelConfig]:
    """`cfg` installed for a block (tests, A/B benchmarks), the previous one after it."""
    before = _active
    install(cfg)
    try:
        yield cfg
    finally:
        install(before)


def use_triton(t: torch.Tensor, cfg: KernelConfig | None = None) -> bool:
    """Inference on bf16/fp32 CUDA tensors takes the Triton kernels unless the config (default: the installed one)
    says triton=False or Triton is missing; CPU tensors take them only with triton=True (under Triton's
    interpreter). Autograd always takes the references (the kernels have no backward)."""
    mode = (cfg or _active).triton
    if mode is False or not HAVE_TRITON or torch.is_grad_enabled() or t.dtype not in (torch.bfloat16, torch.float32):
        return False
    return t.is_cuda or mode is True
