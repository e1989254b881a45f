"""bench_service.py's load generator: c clients in several processes (so that the gateway, not the load generator,
is what is measured), each on a connection of its own, or Poisson arrivals; each request's record: its times, tokens
and the Complete's stats. Beside it, what the server spent meanwhile: the host's and its processes' cores, and the
step loop's time by part."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

POISSON_CONNECTIONS = 8  # per client process, taken in turn by arrivals


async def _client(address: str, application: str | None, jobs: list[tuple], concurrency: int,
                  max_tokens: int, start_at: float) -> list[dict]:
    """Jobs (prompt, plain) kept `concurrency` in flight, each client on a connection of its own (as separate
    clients are: several gateway processes then share them); or (prompt, plain, offset) each sent at start_at + offset
    (concurrency 0: as many in flight as arrived) over POISSON_CONNECTIONS connections in turn."""
    import grpc

    from dspark_serve.cluster.grpc_client import DSparkClient
    from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

    metadata = (("application", application),) if application else None
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(concurrency or POISSON_CONNECTIONS)]
    try:
        # connected before the clock starts
        await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), 30)
        stubs = [dspark_pb2_grpc.GenerationStub(ch) for ch in channels]
        queue, records = list(jobs), []

        async def one(stub, prompt: str, plain: bool, at: float | None = None) -> None:
            if at is not None:
                await asyncio.sleep(max(0.0, start_at + at - time.monotonic()))
            req = DSparkClient.request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                       disable_speculation=plain)
            rec = {"t0": time.monotonic(), "t_first": None}
            await _stream(stub, req, metadata, rec, records)

        async def worker(stub) -> None:
            while queue:
                await one(stub, *queue.pop(0))

        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        if concurrency == 0:
            await asyncio.gather(*(one(stubs[i % len(stubs)], *job) for i, job in enumerate(jobs)))
        else:
            await asyncio.gather(*(worker(stub) for stub in stubs))
        return records
    finally:
        for ch in channels:
            await ch.close()


async def _stream(stub, req, metadata, rec: dict, records: list[dict]) -> None:
    """One Generate to its end: its record (times, tokens, stats) joins `records`."""
    import grpc

    try:
        async for msg in stub.Generate(req, metadata=metadata):
            if msg.HasField("chunk"):
                if rec["t_first"] is None and msg.chunk.token_ids:
                    rec["t_first"] = time.monotonic()
            else:
                s = msg.complete.stats
                rec.update(t_end=time.monotonic(), tokens=len(msg.complete.output_ids), steps=s.num_spec_steps,
                           accepted=s.num_accepted_tokens, transfer_ms=s.transfer_ms,
                           first_token_ms=s.first_token_ms, queue_ms=s.queue_ms, finish_ms=s.finish_ms,
                           gateway_intake_ms=s.gateway_intake_ms, gateway_first_token_ms=s.gateway_first_token_ms)
    except grpc.aio.AioRpcError as e:
        rec = {"error": e.code().name}
    records.append(rec)


def _client_proc(address, application, jobs, concurrency, max_tokens, start_at, out) -> None:
    out.put(asyncio.run(_client(address, application, jobs, concurrency, max_tokens, start_at)))


SERVER_PROCS = (("ray::VerifierActor", "verifier"), ("ray::DraftActor", "draft"),
                ("dspark_serve.cluster.commands serve", "gateway"))  # command line -> label


def host_cpu() -> tuple[int, int, dict[str, int]]:
    """(busy, all) jiffies of the host since boot, and the CPU jiffies of the server's processes (SERVER_PROCS: the
    step loop's actor, the draft's, the first gateway's), summed by label (Linux)."""
    import os

    try:
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except OSError:
        return 0, 0, {}
    procs: dict[str, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = next((label for n, label in SERVER_PROCS if n in cmd), None)
        if name is not None:
            procs[name] = procs.get(name, 0) + int(stat[11]) + int(stat[12])
    return sum(f) - f[3] - f[4], sum(f), procs


def cpu_use(before: tuple, after: tuple, wall_s: float) -> dict:
    """Cores busy on the host and in each server process between two host_cpu() readings."""
    import os

    tick, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    host = ncpu * (after[0] - before[0]) / max(after[1] - before[1], 1)
    return {"host_busy_cores": host, **{f"cpu_cores {k}": (v - before[2].get(k, 0)) / tick / wall_s
                                        for k, v in after[2].items()}}


LOOP_TIMES = ("loop_steps", "loop_step_s", "loop_intake_s", "loop_publish_s")


def loop_times(t: dict, wall_s: float) -> dict:
    """The step loop's (or the engine's) steps in a run: ms per step in the engine step, taking adds and writing
    outputs (served only), and the share of the run's wall time in all three."""
    n = max(t["loop_steps"], 1)
    busy = t["loop_step_s"] + t.get("loop_intake_s", 0.0) + t.get("loop_publish_s", 0.0)
    return {"loop_steps": int(t["loop_steps"]), "loop_step_ms": 1e3 * t["loop_step_s"] / n,
            "loop_intake_ms": 1e3 * t.get("loop_intake_s", 0.0) / n,
            "loop_publish_ms": 1e3 * t.get("loop_publish_s", 0.0) / n, "loop_busy_frac": busy / wall_s}


def load(address: str, application: str | None, prompts: list[str], concurrency: int, max_tokens: int,
         plain: bool, max_procs: int, offsets: list[float] | None = None,
         cpu: dict | None = None) -> tuple[list[dict], float]:
    """`concurrency` streams over up to max_procs client processes, or with `offsets` each prompt sent at its
    arrival (every process takes every max_procs-th: each sees a thinned Poisson process); -> (records, wall s).
    `cpu`: filled with the cores busy from the start until the last client answered (cpu_use)."""
    ctx = mp.get_context("spawn")
    procs = min(concurrency if offsets is None else len(prompts), max_procs)
    out = ctx.Queue()
    start_at = time.monotonic() + 2.0  # every process connected and waiting
    workers = []
    for p in range(procs):
        idx = range(p, len(prompts), procs)
        jobs = [(prompts[i], plain) if offsets is None else (prompts[i], plain, offsets[i]) for i in idx]
        conc = 0 if offsets is not None else concurrency // procs + (1 if p < concurrency % procs else 0)
        w = ctx.Process(target=_client_proc, args=(address, application, jobs, conc, max_tokens, start_at, out))
        w.start()
        workers.append(w)
    time.sleep(max(0.0, start_at - time.monotonic()))
    t0, c0 = time.monotonic(), host_cpu()
    records = [r for _ in workers for r in out.get(timeout=1800)]
    if cpu is not None:
        cpu.update(cpu_use(c0, host_cpu(), time.monotonic() - t0))
    for w in workers:
        w.join()
    ok = [r for r in records if "error" not in r]
    return records, (max(r["t_end"] for r in ok) - start_at) if ok else float("nan")
