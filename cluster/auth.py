"""Who is calling: the bearer-key check (constant time) and the caller identity that scopes request ids. Works on a
grpc.aio context and on Ray Serve's gRPC context alike (both give metadata, peer and TLS peer identities)."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .gateway import GatewayError


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _tag(kind: str, identity: str) -> str:
    """A short opaque caller name: request ids on the step loop's side carry no key, certificate or address."""
    return f"{kind}:{_digest(identity).hex()[:16]}"


class Access:
    """`api_keys` empty: no key is asked for. Otherwise each dspark.v1.Generation call must carry metadata
    `authorization: Bearer KEY` with one of them, and the key names the caller."""

    def __init__(self, api_keys: tuple[str, ...] = ()) -> None:
        # The digests have one length, so comparing them says nothing about a key's length or prefix.
        self._keys = [(_digest(k), _tag("key", k)) for k in api_keys]

    def caller(self, context: Any) -> str:
        """The caller: named by its key, else by its TLS certificate's identities (mutual TLS), else by its address
        (the port dropped: one host's channels share their ids). Raises GatewayError(UNAUTHENTICATED) when a key is
        required and missing or wrong."""
        if self._keys:
            return self._key_caller(context)
        identities = context.peer_identities()
        if identities:
            return _tag("cert", ",".join(sorted(i.decode("utf-8", "replace") for i in identities)))
        peer = context.peer() or "unknown"
        return _tag("peer", peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer)

    def _key_caller(self, context: Any) -> str:
        values = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization"]
        if not values:
            raise GatewayError("UNAUTHENTICATED", "missing metadata 'authorization: Bearer <api key>'")
        scheme, _, token = str(values[0]).partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise GatewayError("UNAUTHENTICATED", "metadata 'authorization' must be 'Bearer <api key>'")
        given = _digest(token.strip())
        found = None
        for digest, name in self._keys:  # every key is compared, whichever matches
            if hmac.compare_digest(given, digest):
                found = name
        if found is None:
            raise GatewayError("UNAUTHENTICATED", "invalid API key")
        return found
