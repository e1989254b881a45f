"""The step channel between verifier (rank 0) and draft (rank 1): torch.distributed send/recv, NCCL or gloo.

One message each way per step: a byte buffer of a fixed capacity (both ends derive it from the context width)
holding a 64-byte int64 header, the int64 fields, then the float payload (16-byte aligned); the header words and
a request's per-row fields are declared once by name (REQUEST_HEADER, ANSWER_HEADER, ROW), and both ends pack and
read them by those names. A payload past the capacity (a prefill's context, a batch's, a dense q) follows in a
second message whose size the header gives. The receiver reads the header (and the draft the int64 fields) to the
host in one copy; the floats stay where they arrived. Buffers grow once and are reused.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
from torch import Tensor

from dspark_serve.engine.drafter import DraftInput, DraftProposal

HEADER = 8  # int64 words: the named fields below, zeros, and the message's total bytes last
REQUEST_HEADER = ("op", "num_reqs", "num_ctx", "width")  # verifier -> draft (a ping or stop: the op alone)
ANSWER_HEADER = ("op", "n", "kind", "k", "has_conf", "compute_us")  # draft -> verifier (op 0)
ROW = ("anchors", "anchor_pos", "ctx_start", "ctx_len", "seeds", "temperature")  # a request's int64 fields, then
# its `width` block table entries (DraftInput's fields of those names; the temperature as its fp32 bits)
OP_PROPOSE, OP_STOP, OP_PING = 1, 2, 3
Q_NONE, Q_DENSE, Q_TOPK = 0, 1, 2
TO_VERIFIER = 16 << 10  # bytes: a top-k 64 proposal of 2 requests, or a greedy one of 100
HOST_PREFIX = 8 << 10  # bytes of a request the draft reads to the host at once (header + fields, usually)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def capacity_to_draft(ctx_dim: int) -> int:
    """Bytes of the request message: the fields, and 8 rows of bf16 features (a batch-1 step's block)."""
    return 4096 + 8 * ctx_dim * 2


def _aligned(n: int) -> int:
    return (n + 15) // 16 * 16


def header(names: tuple[str, ...], **values: int) -> Tensor:
    """[HEADER] int64 host words: `values` at their names' places, zeros elsewhere (the total is set on packing)."""
    words = [0] * HEADER
    for name, value in values.items():
        words[names.index(name)] = value
    return torch.tensor(words, dtype=torch.int64)


def fields(names: tuple[str, ...], words: list[int]) -> dict[str, int]:
    """A received header's words by name."""
    return dict(zip(names, words))


def pack_rows(inp: DraftInput) -> Tensor:
    """[R, len(ROW) + W] int64: each request's ROW fields, then its block table."""
    temp_bits = inp.temperature.float().view(torch.int32).to(torch.int64)
    cols = [temp_bits if name == "temperature" else getattr(inp, name) for name in ROW]
    return torch.cat([torch.stack(cols, 1), inp.block_table], 1)


def unpack_rows(ints: Tensor, features: Tensor | None) -> DraftInput:
    """The DraftInput of pack_rows' words (views of `ints`, but the temperature)."""
    cols = {name: ints[:, i] for i, name in enumerate(ROW)}
    cols["temperature"] = cols["temperature"].to(torch.int32).view(torch.float32)
    return DraftInput(**cols, features=features, block_table=ints[:, len(ROW):])


class StepChannel:
    """One end of the pair's process group; `device` is where messages cross (cuda with NCCL, cpu with gloo)."""

    def __init__(self, rank: int, host: str, port: int, backend: str, device: torch.device, ctx_dim: int,
                 timeout_s: float = 120.0) -> None:
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=2,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.rank, self.peer, self.device = rank, 1 - rank, device
        self.capacity_to_draft, self.capacity_to_verifier = capacity_to_draft(ctx_dim), TO_VERIFIER
        self._bufs: dict[str, Tensor] = {}

    def _bytes(self, name: str, n: int, keep: int = 0) -> Tensor:
        """A uint8 buffer of >= n bytes (its first `keep` bytes survive growing)."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n:
            grown = torch.empty(max(n, 64), dtype=torch.uint8, device=self.device)
            if buf is not None and keep:
                grown[:keep].copy_(buf[:keep])
            buf = self._bufs[name] = grown
        return buf

    def _host_words(self, name: str, words: Tensor) -> Tensor:
        """int64 host words staged where an asynchronous copy to the device may read them (pinned on CUDA)."""
        if self.device.type != "cuda":
            return words
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < words.numel():
            buf = self._bufs[name] = torch.empty(max(words.numel(), 1024), dtype=torch.int64, pin_memory=True)
        buf[:words.numel()].copy_(words)
        return buf[:words.numel()]

    def _pack(self, name: str, words: Tensor, payload: list[Tensor], capacity: int) -> tuple[Tensor, int]:
        """Header + fields `words` (int64 host, header first) and `payload` tensors into one byte buffer;
        -> (buffer, total bytes). The header's last word is set to the total."""
        offsets, end = [], _aligned(8 * words.numel())
        for t in payload:
            offsets.append(end)
            end = _aligned(end + t.numel() * t.element_size())
        words[HEADER - 1] = end
        buf = self._bytes(name, max(end, capacity))
        buf[:8 * words.numel()].view(torch.int64).copy_(self._host_words(name + ".host", words), non_blocking=True)
        for t, off in zip(payload, offsets):
            n = t.numel() * t.element_size()
            buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
        return buf, end

    def _send(self, buf: Tensor, total: int, capacity: int) -> None:
        dist.send(buf[:capacity], self.peer)
        if total > capacity:
            dist.send(buf[capacity:total], self.peer)

    def _recv(self, name: str, capacity: int, prefix: int) -> tuple[Tensor, list[int], Tensor]:
        """One message (and its overflow) -> (buffer, header, the first `prefix` bytes as int64 host words)."""
        buf = self._bytes(name, capacity)
        dist.recv(buf[:capacity], self.peer)
        words = buf[:prefix].to("cpu", copy=True).view(torch.int64)  # the one device -> host copy
        total = int(words[HEADER - 1])
        if total > capacity:
            buf = self._bytes(name, total, keep=capacity)
            dist.recv(buf[capacity:total], self.peer)
        return buf, words[:HEADER].tolist(), words

    @staticmethod
    def view(buf: Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Tensor, int]:
        """A typed view of `buf` at `offset` -> (view, the next aligned offset)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        return buf[offset:offset + n].view(dtype).view(shape), _aligned(offset + n)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class VerifierEnd(StepChannel):
    """Sends DraftInput, receives DraftProposal."""

    def __init__(self, host: str, port: int, backend: str, device: torch.device, ctx_dim: int,
                 feature_dtype: torch.dtype, target_vocab: int, timeout_s: float = 120.0) -> None:
        super().__init__(0, host, port, backend, device, ctx_dim, timeout_s)
        self.ctx_dim, self.feature_dtype, self.target_vocab = ctx_dim, feature_dtype, target_vocab
        self.last_used = time.monotonic()

    def ping(self) -> float:
        """One empty round trip, so that an idle channel's operations never reach their timeout; -> ms."""
        t0 = time.perf_counter()
        buf, total = self._pack("out", header(REQUEST_HEADER, op=OP_PING), [], self.capacity_to_draft)
        self._send(buf, total, self.capacity_to_draft)
        self._recv("in", self.capacity_to_verifier, 8 * HEADER)
        self.last_used = time.monotonic()
        return (time.perf_counter() - t0) * 1e3

    def propose(self, inp: DraftInput) -> DraftProposal:
        """One message each way (plus an overflow message for a payload past the capacity)."""
        t0 = time.perf_counter()
        num_reqs, width = inp.block_table.shape
        num_ctx = int(inp.ctx_len.sum())
        head = header(REQUEST_HEADER, op=OP_PROPOSE, num_reqs=num_reqs, num_ctx=num_ctx, width=width)
        feats = [inp.features.to(self.device, self.feature_dtype)] if num_ctx else []
        buf, total = self._pack("out", torch.cat([head, pack_rows(inp).flatten()]), feats, self.capacity_to_draft)
        self._send(buf, total, self.capacity_to_draft)
        buf, words, _ = self._recv("in", self.capacity_to_verifier, 8 * HEADER)
        h = fields(ANSWER_HEADER, words)
        n, kind, k, has_conf = h["n"], h["kind"], h["k"], h["has_conf"]
        k_ids = k if kind == Q_TOPK else 0
        q_width = {Q_TOPK: k, Q_DENSE: self.target_vocab}.get(kind, 0)
        ints, off = self.view(buf, 8 * HEADER, torch.int64, (num_reqs, n, 1 + k_ids))
        floats = self.view(buf, off, torch.float32, (num_reqs, n, q_width + has_conf))[0].clone() \
            if q_width + has_conf else None
        ints = ints.clone()  # the buffer is the next step's
        probs = floats[..., :q_width] if kind == Q_DENSE else None
        cand_ids, cand_probs = (ints[..., 1:], floats[..., :k]) if kind == Q_TOPK else (None, None)
        conf = floats[..., -1] if has_conf else None
        self.last_used = time.monotonic()
        wall_ms = (time.perf_counter() - t0) * 1e3
        return DraftProposal(ints[..., 0], probs, conf, transfer_ms=max(0.0, wall_ms - h["compute_us"] / 1e3),
                             cand_ids=cand_ids, cand_probs=cand_probs)

    def stop(self) -> None:
        buf, total = self._pack("out", header(REQUEST_HEADER, op=OP_STOP), [], self.capacity_to_draft)
        self._send(buf, total, self.capacity_to_draft)


class DraftEnd(StepChannel):
    """Receives DraftInput, runs `propose`, sends the DraftProposal (q restricted to its candidates)."""

    def __init__(self, host: str, port: int, backend: str, device: torch.device, ctx_dim: int,
                 feature_dtype: torch.dtype, timeout_s: float = 120.0) -> None:
        super().__init__(1, host, port, backend, device, ctx_dim, timeout_s)
        self.ctx_dim, self.feature_dtype = ctx_dim, feature_dtype

    def serve(self, propose) -> None:
        """Loop until OP_STOP: one proposal per verify step, an empty answer per ping."""
        while True:
            out = self._receive()
            if out is None:
                return
            if out == OP_PING:
                buf, total = self._pack("out", header(ANSWER_HEADER), [], self.capacity_to_verifier)
                self._send(buf, total, self.capacity_to_verifier)
                continue
            t0 = time.perf_counter()
            proposal = propose(out)
            if self.device.type == "cuda":  # compute time includes the device's: the rest is the channel's
                torch.cuda.synchronize(self.device)
            self._reply(proposal, int((time.perf_counter() - t0) * 1e6))

    def _receive(self) -> DraftInput | int | None:
        """The next request: a DraftInput, OP_PING, or None for OP_STOP."""
        buf, head, words = self._recv("in", self.capacity_to_draft, min(HOST_PREFIX, self.capacity_to_draft))
        h = fields(REQUEST_HEADER, head)
        if h["op"] == OP_STOP:
            return None
        if h["op"] == OP_PING:
            return OP_PING
        num_reqs, num_ctx, row = h["num_reqs"], h["num_ctx"], len(ROW) + h["width"]
        n_words = HEADER + num_reqs * row
        if n_words > words.numel():  # many requests: the fields run past the prefix read
            words = buf[:8 * n_words].to("cpu", copy=True).view(torch.int64)
        feats = self.view(buf, _aligned(8 * n_words), self.feature_dtype, (num_ctx, self.ctx_dim))[0] \
            if num_ctx else None
        return unpack_rows(words[HEADER:n_words].view(num_reqs, row), feats)

    def _reply(self, out: DraftProposal, compute_us: int) -> None:
        num_reqs, n = out.tokens.shape
        kind = Q_TOPK if out.cand_ids is not None else (Q_NONE if out.probs is None else Q_DENSE)
        k = out.cand_ids.shape[-1] if out.cand_ids is not None else 0
        has_conf = out.confidence_logits is not None
        head = header(ANSWER_HEADER, n=n, kind=kind, k=k, has_conf=int(has_conf), compute_us=compute_us)
        ints = torch.cat([out.tokens[..., None]] + ([out.cand_ids] if kind == Q_TOPK else []), -1)  # [R, N, 1 (+ K)]
        floats = ([out.cand_probs.float()] if kind == Q_TOPK else []) + \
            ([out.probs.float()] if kind == Q_DENSE else []) + \
            ([out.confidence_logits.float()[..., None]] if has_conf else [])
        payload = [ints.to(self.device)] + ([torch.cat(floats, -1).to(self.device)] if floats else [])  # [R, N, K + 1]
        buf, total = self._pack("out", head, payload, self.capacity_to_verifier)
        self._send(buf, total, self.capacity_to_verifier)
