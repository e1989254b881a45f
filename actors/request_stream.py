"""The request stream between the gateway and the verifier's step loop: one TCP connection carrying adds and
aborts in, and one frame of outputs per step out. Ray only sets it up (the address and a secret, over Ray's
authenticated calls); the connection is authenticated by the secret before any frame is read.

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
    the gateway's frames or a connection; `send` writes one frame. One gateway at a time; a new one replaces it."""

    def __init__(self, host: str, send_timeout_s: float = 30.0) -> None:
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = (host, self.listener.getsockname()[1])
        self.send_timeout_s = send_timeout_s
        self.conn: socket.socket | None = None
        self._buf = bytearray()

    @property
    def connected(self) -> bool:
        return self.conn is not None

    def poll(self, timeout_s: float) -> tuple[list[Any], bool]:
        """-> (the frames that arrived, whether the gateway went away). Waits up to timeout_s for the first."""
        socks = [self.listener] + ([self.conn] if self.conn is not None else [])
        ready, _, _ = select.select(socks, [], [], timeout_s)
        lost = False
        if self.listener in ready:
            lost = self._accept()
        frames: list[Any] = []
        if self.conn is not None and self.conn in ready:
            try:
                data = self.conn.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                self._drop()
                return frames, True
            if data:
                self._buf += data
                frames = self._frames()
        return frames, lost

    def _accept(self) -> bool:
        """Take a new gateway if it proves the secret; -> whether an old one was replaced."""
        try:
            conn, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        conn.settimeout(5.0)
        try:
            got = _recv_exactly(conn, SECRET_BYTES)
        except OSError:
            got = b""
        if not hmac.compare_digest(got, self.secret):
            conn.close()
            return False
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replaced = self.conn is not None
        self._drop()
        self.conn = conn
        return replaced

    def _frames(self) -> list[Any]:
        out, buf, pos = [], self._buf, 0
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

    def send(self, obj: Any) -> bool:
        """One frame to the gateway; False (and the connection dropped) when there is none or it stopped
        reading for send_timeout_s."""
        if self.conn is None:
            return False
        data = memoryview(pack(obj))
        try:
            while data:
                try:
                    n = self.conn.send(data)
                    data = data[n:]
                except (BlockingIOError, InterruptedError):
                    if not select.select([], [self.conn], [], self.send_timeout_s)[1]:
                        raise TimeoutError("the gateway stopped reading") from None
        except OSError:
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn, self._buf = None, bytearray()

    def close(self) -> None:
        self._drop()
        self.listener.close()


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
