"""The request stream between the gateways and the verifier's step loop: one TCP connection per gateway process,
carrying adds and aborts in, and one frame of outputs per step out. Ray only sets it up (the address and a secret,
over Ray's authenticated calls); the connection is authenticated by the secret before any frame is read.

Frames: a 4-byte big-endian length, then a pickle of one of actors/frames.py's named tuples: Add and Abort in;
Step (every sequence's Output of one step), Rejected and Fatal out.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import secrets
import select
import socket
import struct
from typing import Any

from .frames import Add, Step

_LEN = struct.Struct("!I")
SECRET_BYTES = 32
MAX_FRAME = 256 << 20


def pack(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


class StreamServer:
    """The verifier's end, driven by the step loop's thread only: `poll` waits (select, without the GIL) for
    frames or connections; `send` writes one frame to one gateway. Several gateways (processes) may connect, each
    authenticated by the secret; a connection is known by a number, and a sequence by the gateway that added it."""

    def __init__(self, host: str, send_timeout_s: float = 30.0) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = (host, self.listener.getsockname()[1])
        self.send_timeout_s = send_timeout_s
        self.conns: dict[int, socket.socket] = {}
        self._bufs: dict[int, bytearray] = {}
        self._next = 0

    def poll(self, timeout_s: float) -> tuple[list[tuple[int, Any]], list[int]]:
        """-> ((connection, frame) that arrived, in order per connection; the connections that went away). Waits up
        to timeout_s for the first."""
        ready, _, _ = select.select([self.listener, *self.conns.values()], [], [], timeout_s)
        frames: list[tuple[int, Any]] = []
        lost: list[int] = []
        if self.listener in ready:
            self._accept()
        for cid, conn in list(self.conns.items()):
            if conn not in ready:
                continue
            try:
                data = conn.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data == b"":
                self.drop(cid)
                lost.append(cid)
                continue
            buf = self._bufs[cid]
            buf += data
            try:
                frames += [(cid, f) for f in _frames(buf)]
            except (ValueError, pickle.UnpicklingError):  # not our frames: that gateway is cut off
                self.drop(cid)
                lost.append(cid)
        return frames, lost

    def _accept(self) -> None:
        """Take a new gateway if it proves the secret."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.settimeout(5.0)
        try:
            got = _recv_exactly(conn, SECRET_BYTES)
        except OSError:
            got = b""
        if not hmac.compare_digest(got, self.secret):
            conn.close()
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next += 1
        self.conns[self._next], self._bufs[self._next] = conn, bytearray()

    def send(self, cid: int, obj: Any) -> bool:
        """One frame to gateway `cid`; False (and the connection dropped) when it is gone or stopped reading for
        send_timeout_s."""
        conn = self.conns.get(cid)
        if conn is None:
            return False
        data = memoryview(pack(obj))
        try:
            while data:
                try:
                    n = conn.send(data)
                    data = data[n:]
                except (BlockingIOError, InterruptedError):
                    if not select.select([], [conn], [], self.send_timeout_s)[1]:
                        raise TimeoutError("the gateway stopped reading") from None
        except OSError:
            self.drop(cid)
            return False
        return True

    def broadcast(self, obj: Any) -> None:
        for cid in list(self.conns):
            self.send(cid, obj)

    def drop(self, cid: int) -> None:
        conn = self.conns.pop(cid, None)
        self._bufs.pop(cid, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for cid in list(self.conns):
            self.drop(cid)
        self.listener.close()


def _frames(buf: bytearray) -> list[Any]:
    """The whole frames at the front of `buf`, taken off it."""
    out, pos = [], 0
    while len(buf) - pos >= _LEN.size:
        (n,) = _LEN.unpack_from(buf, pos)
        if n > MAX_FRAME:
            raise ValueError(f"request stream frame of {n} bytes")
        if len(buf) - pos - _LEN.size < n:
            break
        out.append(pickle.loads(bytes(buf[pos + _LEN.size:pos + _LEN.size + n])))
        pos += _LEN.size + n
    del buf[:pos]
    return out


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class StreamClient:
    """The gateway's end, on its asyncio loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, timeout_s: float = 10.0) -> StreamClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, limit=MAX_FRAME), timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(secret)
        return cls(reader, writer)

    def send(self, obj: Any) -> None:
        """Queued on the transport; frames are small and the step loop reads them every step."""
        self.writer.write(pack(obj))

    async def recv(self) -> Any:
        """The next frame; asyncio.IncompleteReadError when the verifier is gone."""
        (n,) = _LEN.unpack(await self.reader.readexactly(_LEN.size))
        return pickle.loads(await self.reader.readexactly(n))

    def close(self) -> None:
        self.writer.close()


class SyncStreamClient:
    """A blocking end for scripts and tests that drive a pair without a gateway."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(secret)

    def send(self, obj: Any) -> None:
        self.sock.sendall(pack(obj))

    def recv(self) -> Any:
        (n,) = _LEN.unpack(_recv_exactly(self.sock, _LEN.size))
        return pickle.loads(_recv_exactly(self.sock, n))

    def run(self, requests: dict[str, tuple[list[int], dict]]) -> dict[str, tuple[list[int], str, dict]]:
        """Add every request (id -> (prompt ids, sampling params)) and collect each one's tokens, finish reason
        and stats."""
        for rid, (ids, params) in requests.items():
            self.send(Add(rid, ids, params))
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        done: dict[str, tuple[list[int], str, dict]] = {}
        while len(done) < len(requests):
            frame = self.recv()
            if not isinstance(frame, Step):
                raise RuntimeError(f"the step loop answered {frame}")
            for out in frame.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    done[out.request_id] = (tokens[out.request_id], out.finish_reason, out.stats)
        return done

    def close(self) -> None:
        self.sock.close()
