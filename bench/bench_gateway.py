"""The gateway's own ceiling, without a model or a GPU: a stand-in step loop (the real request stream's server, in a
process of its own) answers every Add with --tokens-per-step tokens each --step-ms, as the engine would at that
speed, and c clients in several processes stream through the real gRPC gateway. Per level: tokens/s delivered
against the stand-in's own, TTFT and TPOT p50 at the clients against the stand-in's, how late each final reaches its
client after the stand-in finished it, the gateway process's CPU time per 1,000 tokens, and when the first wave's
calls left the clients and started at the server. --bare measures a bare grpc.aio server in the gateway's place;
--bare-servers N runs N of them on one port (SO_REUSEPORT) and one event loop, so N calls can be taken in at once.

usage: python bench/bench_gateway.py [--levels 32 64] [--step-ms 3.6] [--tokens-per-step 3] [--max-tokens 128]
                                     [--requests 64] [--rounds 2] [--client-procs 8] [--bare [--bare-servers N]]
                                     [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import threading
import time
from pathlib import Path

from bench_service import chat_prompts, summarize
from service_clients import load


def stand_in(queue, step_ms: float, tokens_per_step: int) -> None:
    """The step loop's side of the request stream: each Add's sequence gets tokens_per_step of its prompt's ids
    (cycled, so the gateway detokenizes real text) every step_ms until its max_tokens, then its final with stats."""
    from dspark_serve.actors.frames import Abort, Add, Output, Step
    from dspark_serve.actors.request_stream import StreamServer
    from dspark_serve.engine.request import RequestStats

    server = StreamServer("127.0.0.1")
    queue.put((*server.address, server.secret))
    live: dict[str, list] = {}  # key -> [gateway, prompt ids, tokens sent, max_tokens, arrival, first]
    next_step = time.monotonic()
    while True:
        frames, _ = server.poll(max(0.0, next_step - time.monotonic()) if live else 0.05)
        now = time.monotonic()
        for cid, f in frames:
            if isinstance(f, Add):
                live[f.request_id] = [cid, f.prompt_ids, 0, f.params.get("max_tokens") or 16, now, None]
            elif isinstance(f, Abort):
                for rid in f.request_ids:
                    live.pop(rid, None)
        if not live or now < next_step:
            continue
        next_step = now + step_ms / 1e3
        by_gateway: dict[int, list] = {}
        for rid, s in list(live.items()):
            cid, ids, sent, cap, arrival, first = s
            n = min(tokens_per_step, cap - sent)
            new = [ids[(sent + i) % len(ids)] for i in range(n)]
            s[2] += n
            s[5] = first or now
            out = Output(rid, new)
            if s[2] >= cap:
                stats = RequestStats(steps=-(-cap // tokens_per_step), arrival=arrival)
                stats.first_token_ms, stats.finish_ms = 1e3 * (s[5] - arrival), 1e3 * (now - arrival)
                out = Output(rid, new, "length", stats.to_dict())
                del live[rid]
            by_gateway.setdefault(cid, []).append(out)
        for cid, outs in by_gateway.items():
            server.send(cid, Step(outs))


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class StandInVerifier:
    """What the gateway asks of the verifier actor, answered locally: the real tokenizer, the stand-in's stream."""

    def __init__(self, target: str, address: tuple[str, int, bytes]) -> None:
        from dspark_serve.models.tokenizer import load_tokenizer

        tok = load_tokenizer(target)
        info = {"target": target, "draft": "", "method": "dspark", "vocab_size": 151936, "max_model_len": 4096,
                "num_speculative_tokens": 7, "eos_token_ids": [], "has_tokenizer": True}
        self.model_info = _Method(lambda: info)
        self.tokenizer_json = _Method(lambda: tok.to_str())
        self.chat_template = _Method(lambda: None)
        self.stream_address = _Method(lambda: address)
        self.health = _Method(lambda: {"ok": True})
        self.stats = _Method(lambda: {})


CALL_STARTS: list[float] = []  # time.monotonic() of each Generate call's start at the server (this process)


def _record_call_starts() -> None:
    from dspark_serve.cluster.gateway import GatewayCore

    generate = GatewayCore.generate

    def timed(self, *args):
        CALL_STARTS.append(time.monotonic())
        return generate(self, *args)

    GatewayCore.generate = timed


def start_bare(step_ms: float, tokens_per_step: int, servers: int = 1) -> str:
    """A bare grpc.aio server of dspark.v1.Generation in a thread (`servers` of them on one port and event loop): each
    call streams tokens_per_step tokens every step_ms up to its max_tokens, then a Complete; nothing else (what
    grpc.aio itself costs); -> its address."""
    import grpc

    from dspark_serve.cluster.grpc_methods import SERVICE_NAME
    from dspark_serve.protos.dspark.v1 import dspark_pb2 as pb

    async def generate(request, context):
        CALL_STARTS.append(time.monotonic())
        sent = 0
        while sent < request.sampling.max_tokens:
            await asyncio.sleep(step_ms / 1e3)
            n = min(tokens_per_step, request.sampling.max_tokens - sent)
            sent += n
            yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=[1] * n, num_output_tokens=sent))
        yield pb.GenerateResponse(complete=pb.GenerateComplete(output_ids=[1] * sent, stats=pb.SpecStats()))

    loop, ready = asyncio.new_event_loop(), mp.get_context("spawn").Queue()

    async def run() -> None:
        handler = grpc.unary_stream_rpc_method_handler(generate, pb.GenerateRequest.FromString,
                                                      pb.GenerateResponse.SerializeToString)
        port, kept = 0, []
        for _ in range(servers):  # each its own accept loop; the kernel spreads the connections over them
            server = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                                  {"Generate": handler}),))
            port = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            kept.append(server)
        ready.put(port)
        await asyncio.Event().wait()

    threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True).start()
    return f"127.0.0.1:{ready.get(timeout=60)}"


def start_gateway(target: str, address: tuple, messages_per_s: float,
                  profile=None) -> tuple[str, asyncio.AbstractEventLoop]:
    """The real gRPC gateway on its own event loop in a thread of this process (`profile`, a cProfile.Profile:
    enabled in that thread); -> its address."""
    from dspark_serve.cluster.config import GatewayConfig
    from dspark_serve.cluster.grpc_server import GatewayServer

    loop, ready = asyncio.new_event_loop(), mp.get_context("spawn").Queue()
    cfg = GatewayConfig(port=0, max_queue=4096, stream_messages_per_s=messages_per_s)

    async def run() -> None:
        if profile is not None:
            profile.enable()
        server = GatewayServer(StandInVerifier(target, address), cfg)
        ready.put(await server.start())
        await asyncio.Event().wait()

    threading.Thread(target=lambda: loop.run_until_complete(run()), daemon=True).start()
    return f"127.0.0.1:{ready.get(timeout=60)}", loop


def spread(records: list[dict], starts: list[float]) -> dict:
    """When the first wave's calls left the clients and when the server started them (ms after the first left):
    first, median, last."""
    t0 = sorted(r["t0"] for r in records)[:len(starts)]
    at = lambda xs: [round(1e3 * (xs[i] - t0[0]), 2) for i in (0, len(xs) // 2, -1)] if xs else []  # noqa: E731
    return {"client_sent_ms": at(t0), "server_started_ms": at(starts)}


def server_cpu_s() -> float:
    """CPU seconds of this process's threads but the main one (which runs the load generator's processes): the
    gateway's event loop and gRPC's own threads."""
    import os

    total, main = 0.0, str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        if tid == main:
            continue
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.models.demo import demo_target_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()), help="its tokenizer and chat template only")
    ap.add_argument("--levels", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--step-ms", type=float, default=3.6, help="the stand-in engine's step time")
    ap.add_argument("--tokens-per-step", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--client-procs", type=int, default=8)
    ap.add_argument("--stream-messages-per-s", type=float, default=6000.0)
    ap.add_argument("--bare", action="store_true", help="a bare grpc.aio server streaming the same shape of answers "
                    "in place of the gateway and the stand-in (what grpc.aio itself costs)")
    ap.add_argument("--bare-servers", type=int, default=1, help="with --bare: this many servers on the one port")
    ap.add_argument("--profile", type=int, default=0, help="print the gateway thread's top N functions (cProfile)")
    ap.add_argument("--profile-sort", default="tottime")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import cProfile
    import pstats

    prof = cProfile.Profile() if args.profile else None
    ctx = mp.get_context("spawn")
    q, loop_proc = ctx.Queue(), None
    if args.bare:
        address, loop = start_bare(args.step_ms, args.tokens_per_step, args.bare_servers), None
    else:
        loop_proc = ctx.Process(target=stand_in, args=(q, args.step_ms, args.tokens_per_step), daemon=True)
        loop_proc.start()
        _record_call_starts()
        address, loop = start_gateway(args.target, q.get(timeout=60), args.stream_messages_per_s, prof)
    prompts, _ = chat_prompts(args.target, args.requests)
    rows = []
    for c in args.levels:
        load(address, None, prompts[:c], c, args.max_tokens, False, args.client_procs)  # warm-up
        for rnd in range(args.rounds):
            cpu0 = server_cpu_s()
            CALL_STARTS.clear()
            records, wall = load(address, None, prompts, c, args.max_tokens, False, args.client_procs)
            cpu = server_cpu_s() - cpu0
            s = summarize(records, wall)
            ok = [r for r in records if "error" not in r]
            late = [1e3 * (r["t_end"] - r["t0"]) - r["finish_ms"] - r["gateway_intake_ms"] for r in ok]
            rows.append({"concurrency": c, "round": rnd, **s, "stand_in_tok_s": c * 1e3 * args.tokens_per_step
                         / args.step_ms, "final_late_ms_p50": statistics.median(late),
                         "gateway_cpu_s": cpu, "gateway_cpu_ms_per_1k_tokens": 1e6 * cpu / max(s["tokens"], 1),
                         **spread(ok, sorted(CALL_STARTS)[:c])})
            r = rows[-1]
            print(f"c={c:<4} round {rnd}  {r['tok_s']:9.1f} tok/s (stand-in {r['stand_in_tok_s']:.0f})  TTFT p50 "
                  f"{r['ttft_ms_p50']:7.2f} ms (loop {r['loop_ttft_ms_p50']:6.2f})  TPOT p50 {r['tpot_ms_p50']:6.3f} "
                  f"ms (loop {r['loop_tpot_ms_p50']:6.3f})  final late p50 {r['final_late_ms_p50']:6.2f} ms  gateway "
                  f"CPU {r['gateway_cpu_ms_per_1k_tokens']:6.1f} ms / 1k tokens ({cpu / wall:.0%} of a core)  first "
                  f"wave sent {r['client_sent_ms']}, started {r['server_started_ms']} ms  "
                  f"errors {r['errors']}", flush=True)
    result = {"step_ms": args.step_ms, "tokens_per_step": args.tokens_per_step, "max_tokens": args.max_tokens,
              "requests": args.requests, "stream_messages_per_s": args.stream_messages_per_s,
              "bare_servers": args.bare_servers if args.bare else 0, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if prof is not None and loop is not None:
        done = threading.Event()
        loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
        done.wait(10)
        pstats.Stats(prof).sort_stats(args.profile_sort).print_stats(args.profile)
    if loop_proc is not None:
        loop_proc.terminate()
    return result


if __name__ == "__main__":
    main()
