"""The KV-block invariant, checked after every test: an idle engine (in-process, or behind a live test server)
has every block of every pool free."""

from __future__ import annotations

import time
import weakref

ENGINES: weakref.WeakSet = weakref.WeakSet()  # every LLM built during the run
SERVERS: weakref.WeakSet = weakref.WeakSet()  # every ServerProcess started during the run


def track_engines() -> None:
    from dspark_serve.engine.llm import LLM

    init = LLM.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        ENGINES.add(self)

    LLM.__init__ = tracked


def engine_leaks() -> list[str]:
    bad = []
    for llm in list(ENGINES):
        if llm.has_unfinished():
            continue
        kv = llm.kv
        pools = [("target", kv.target)] + ([("draft", kv.draft)] if kv.draft is not None else [])
        bad += [f"{name}: {p.num_free} of {p.num_blocks} blocks free while idle" for name, p in pools
                if p.num_free != p.num_blocks]
    return bad


def server_leaks(timeout_s: float = 10.0) -> list[str]:
    if not SERVERS:  # (and no gRPC needed: the GPU host runs its engine tests without it)
        return []
    import grpc

    from dspark_serve.cluster.grpc_client import DSparkClient

    bad = []
    for srv in list(SERVERS):
        if getattr(srv, "proc", None) is None or srv.proc.poll() is not None or srv.address is None or not srv.checked:
            continue
        client = DSparkClient(srv.address, api_key=getattr(srv, "api_key", None))
        try:
            end = time.monotonic() + timeout_s
            s = client.server_stats()
            while (s.num_running or s.num_waiting) and time.monotonic() < end:
                time.sleep(0.05)
                s = client.server_stats()
            if s.num_running or s.num_waiting:
                bad.append(f"{srv.address}: {s.num_running} running, {s.num_waiting} waiting {timeout_s} s after "
                           f"the test")
            elif s.free_target_blocks != s.total_target_blocks or s.free_draft_blocks != s.total_draft_blocks:
                bad.append(f"{srv.address}: idle with {s.free_target_blocks}/{s.total_target_blocks} target and "
                           f"{s.free_draft_blocks}/{s.total_draft_blocks} draft blocks free")
        except grpc.RpcError:
            pass  # a server the test took down or locked (no key here): nothing to check
        finally:
            client.close()
    return bad
