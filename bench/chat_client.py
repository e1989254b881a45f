"""The multi-turn chat client of the benchmarks: conversations over one gRPC channel, each turn's prompt the system
prompt, every earlier question with the reply the server gave and the new question, rendered with the target's chat
template (ChatML when it has none); a record per turn with its times, tokens, cached tokens and replica."""

from __future__ import annotations

import asyncio
import time


def render(template, messages: list[dict]) -> str:
    from dspark_serve.models.chat_template import render_chat

    if template is None:
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
            "<|im_start|>assistant\n"
    return render_chat(template, messages, add_generation_prompt=True)


async def _turn(stub, prompt: str, metadata: tuple, max_tokens: int, header: str | None) -> dict:
    """One streamed Generate: its times, output, prompt and cached tokens, and the replica that answered."""
    import grpc

    from dspark_serve.cluster.grpc_client import DSparkClient

    req = DSparkClient.request(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rec = {"t0": time.monotonic(), "t_first": None}
    try:
        call = stub.Generate(req, metadata=metadata)
        async for msg in call:
            if msg.HasField("chunk"):
                if rec["t_first"] is None and msg.chunk.token_ids:
                    rec["t_first"] = time.monotonic()
            else:
                c = msg.complete
                rec.update(t_end=time.monotonic(), tokens=len(c.output_ids), prompt_tokens=c.num_prompt_tokens,
                           cached_tokens=c.stats.cached_tokens, text=c.text, steps=c.stats.num_spec_steps,
                           queue_ms=c.stats.queue_ms, engine_ttft_ms=c.stats.first_token_ms)
        rec["replica"] = dict(await call.trailing_metadata() or ()).get(header) if header else None
    except grpc.aio.AioRpcError as e:
        return {"error": f"{e.code().name}: {e.details()}"}
    return rec if "t_end" in rec else {"error": "the stream ended without its final message"}


async def conversation(stub, index: int, questions: list[str], system: str | None, template, max_tokens: int,
                       metadata: tuple = (), header: str | None = None) -> list[dict]:
    """The turns of one conversation, each sent when the previous reply ended; it stops at an error."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    records = []
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        rec = await _turn(stub, render(template, messages), metadata, max_tokens, header)
        records.append({"conversation": index, "turn": turn, **rec})
        if "error" in rec:
            break
        messages.append({"role": "assistant", "content": records[-1].pop("text")})
    return records


async def run_conversations(address: str, application: str | None, convs: list[tuple[int, list[str]]],
                            concurrency: int, system: str | None, template, max_tokens: int,
                            header: str | None = None) -> list[dict]:
    """Every conversation, `concurrency` of them at once over one channel; -> the records of all their turns."""
    import grpc

    from dspark_serve.protos.dspark.v1 import dspark_pb2_grpc

    metadata = (("application", application),) if application else ()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = dspark_pb2_grpc.GenerationStub(channel)

        async def one(index: int, questions: list[str]) -> list[dict]:
            async with gate:
                return await conversation(stub, index, questions, system, template, max_tokens, metadata, header)

        return [r for rs in await asyncio.gather(*(one(*c) for c in convs)) for r in rs]
