"""The gateway's pacing of many streams: a stream's next chunk waits for its share of the message rate, but its final
message (or an error) ends the wait at once."""

import asyncio

from dspark_serve.actors.frames import Output
from dspark_serve.cluster.config import GatewayConfig
from dspark_serve.cluster.gateway import GatewayCore, GatewayError
from dspark_serve.cluster.live_sequence import LiveSequence


def _paced(last_item) -> tuple[bool, bool, bool]:
    """Two live streams at one message a second: a 2 s gap. -> (held after 50 ms, still held after a chunk, ended
    within 0.5 s of `last_item`)."""

    async def run():
        core = GatewayCore(None, {"target": "t"}, GatewayConfig(stream_messages_per_s=1.0))
        live = LiveSequence(text=None, num_prompt_tokens=0)
        core.live = {"a": live, "b": LiveSequence(text=None, num_prompt_tokens=0)}
        loop = asyncio.get_running_loop()
        task = loop.create_task(core._pace([live], live.urgent, loop.time()))
        await asyncio.sleep(0.05)
        held = not task.done()
        core._deliver("a", Output("a", [1]))
        await asyncio.sleep(0.05)
        still = not task.done()
        core._deliver("a", last_item)
        try:
            await asyncio.wait_for(task, 0.5)
            ended = True
        except asyncio.TimeoutError:
            ended = False
        await core.close()
        return held, still, ended

    return asyncio.run(run())


def test_a_final_ends_the_pace_but_a_chunk_does_not():
    assert _paced(Output("a", [2], "length", {})) == (True, True, True)


def test_an_error_ends_the_pace():
    assert _paced(GatewayError("UNAVAILABLE", "gone")) == (True, True, True)


def test_the_pace_ends_at_its_share_of_the_rate():
    async def run():
        core = GatewayCore(None, {"target": "t"}, GatewayConfig(stream_messages_per_s=20.0))
        live = LiveSequence(text=None, num_prompt_tokens=0)
        core.live = {"a": live}
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(core._pace([live], live.urgent, t0), 1.0)  # one live stream at 20/s: 50 ms
        waited = loop.time() - t0
        await core.close()
        return waited

    assert 0.045 <= asyncio.run(run()) < 1.0
