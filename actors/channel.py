"""The step channel between verifier (rank 0) and draft (rank 1): torch.distributed send/recv, NCCL or gloo.

Every message is a fixed int64 header, then tensors whose sizes the header gives. Receive buffers grow once and
are reused, so the hot path allocates nothing once shapes have been seen.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
from torch import Tensor

from dspark_serve.engine.draft_side import DraftInput, DraftProposal

HEADER = 8
OP_PROPOSE, OP_STOP = 1, 2
Q_NONE, Q_DENSE, Q_TOPK = 0, 1, 2


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class StepChannel:
    """One end of the pair's process group; `device` is where tensors cross (cuda with NCCL, cpu with gloo)."""

    def __init__(self, rank: int, host: str, port: int, backend: str, device: torch.device,
                 timeout_s: float = 120.0) -> None:
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.peer, self.device = rank, 1 - rank, device
        self._bufs: dict[str, Tensor] = {}

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        n = 1
        for s in shape:
            n *= s
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self._bufs[name] = torch.empty(max(n, 1), dtype=dtype, device=self.device)
        return buf[:n].view(shape)

    def send(self, t: Tensor) -> None:
        dist.send(t.to(self.device).contiguous(), self.peer)

    def recv(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        buf = self._buf(name, shape, dtype)
        dist.recv(buf, self.peer)
        return buf

    def header(self, *values: int) -> Tensor:
        return torch.tensor(list(values) + [0] * (HEADER - len(values)), dtype=torch.int64)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class VerifierEnd(StepChannel):
    """Sends DraftInput, receives DraftProposal."""

    def __init__(self, host: str, port: int, backend: str, device: torch.device, ctx_dim: int,
                 feature_dtype: torch.dtype, target_vocab: int) -> None:
        super().__init__(0, host, port, backend, device)
        self.ctx_dim, self.feature_dtype, self.target_vocab = ctx_dim, feature_dtype, target_vocab

    def propose(self, inp: DraftInput) -> DraftProposal:
        """Three messages each way: a header, the int64 fields packed, then the float payload."""
        t0 = time.perf_counter()
        num_reqs, width = inp.block_table.shape
        num_ctx = int(inp.ctx_len.sum())
        self.send(self.header(OP_PROPOSE, num_reqs, num_ctx, width))
        temp_bits = inp.temperature.float().view(torch.int32).to(torch.int64)
        self.send(torch.cat([torch.stack([inp.anchors, inp.anchor_pos, inp.ctx_start, inp.ctx_len, inp.seeds,
                                          temp_bits], 1), inp.block_table], 1))  # [R, 6 + W]
        if num_ctx:
            self.send(inp.features.to(self.feature_dtype))
        h = self.recv("h", (HEADER,), torch.int64).tolist()
        n, kind, k, has_conf, compute_us = h[1], h[2], h[3], h[4], h[5]
        k_ids = k if kind == Q_TOPK else 0
        ints = self.recv("ints", (num_reqs, n, 1 + k_ids), torch.int64).clone()
        q_width = {Q_TOPK: k, Q_DENSE: self.target_vocab}.get(kind, 0)
        floats = self.recv("floats", (num_reqs, n, q_width + has_conf), torch.float32).clone() \
            if q_width + has_conf else None
        probs = floats[..., :q_width] if kind == Q_DENSE else None
        cand_ids, cand_probs = (ints[..., 1:], floats[..., :k]) if kind == Q_TOPK else (None, None)
        conf = floats[..., -1] if has_conf else None
        wall_ms = (time.perf_counter() - t0) * 1e3
        return DraftProposal(ints[..., 0], probs, conf, transfer_ms=max(0.0, wall_ms - compute_us / 1e3),
                             cand_ids=cand_ids, cand_probs=cand_probs)

    def stop(self) -> None:
        self.send(self.header(OP_STOP))


class DraftEnd(StepChannel):
    """Receives DraftInput, runs `propose`, sends the DraftProposal (q restricted to its candidates)."""

    def __init__(self, host: str, port: int, backend: str, device: torch.device, ctx_dim: int,
                 feature_dtype: torch.dtype) -> None:
        super().__init__(1, host, port, backend, device)
        self.ctx_dim, self.feature_dtype = ctx_dim, feature_dtype

    def serve(self, propose) -> None:
        """Loop until OP_STOP: one proposal per verify step."""
        while True:
            h = self.recv("h", (HEADER,), torch.int64).tolist()
            if h[0] == OP_STOP:
                return
            num_reqs, num_ctx, width = h[1], h[2], h[3]
            ints = self.recv("ints", (num_reqs, 6 + width), torch.int64).cpu()
            temp = ints[:, 5].to(torch.int32).view(torch.float32)
            feats = self.recv("feats", (num_ctx, self.ctx_dim), self.feature_dtype) if num_ctx else None
            t0 = time.perf_counter()
            out = propose(DraftInput(ints[:, 0], ints[:, 1], ints[:, 2], ints[:, 3], feats, ints[:, 6:], temp,
                                     ints[:, 4]))
            if self.device.type == "cuda":  # compute time includes the device's: the rest is the channel's
                torch.cuda.synchronize(self.device)
            self._reply(out, int((time.perf_counter() - t0) * 1e6))

    def _reply(self, out: DraftProposal, compute_us: int) -> None:
        num_reqs, n = out.tokens.shape
        kind = Q_TOPK if out.cand_ids is not None else (Q_NONE if out.probs is None else Q_DENSE)
        k = out.cand_ids.shape[-1] if out.cand_ids is not None else 0
        has_conf = out.confidence_logits is not None
        self.send(self.header(0, n, kind, k, int(has_conf), compute_us))
        ints = [out.tokens[..., None]] + ([out.cand_ids] if kind == Q_TOPK else [])
        self.send(torch.cat(ints, -1))  # [R, N, 1 (+ K)]
        floats = ([out.cand_probs.float()] if kind == Q_TOPK else []) + \
            ([out.probs.float()] if kind == Q_DENSE else []) + \
            ([out.confidence_logits.float()[..., None]] if has_conf else [])
        if floats:
            self.send(torch.cat(floats, -1))  # [R, N, K or V (+ 1)]
