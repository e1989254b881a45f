"""The streams of a batch of prompts as one: each message tagged with its prompt's index. Every stream has produced
its first message (or failed, which fails the batch) before the first is yielded, so a batch is refused or answered
whole; closing the merged stream closes every stream (their requests are aborted)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

_END = object()


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    if len(streams) == 1:  # no tasks for the common case
        async with aclosing(streams[0]) as stream:
            async for msg in stream:
                yield 0, msg
        return
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))  # a slow reader holds the streams back
    pumps: list[asyncio.Task] = []
    try:
        for i, msg in enumerate(await asyncio.gather(*firsts)):
            yield i, msg
        pumps = [asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams)]
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in firsts + pumps:
            task.cancel()
        await asyncio.gather(*firsts, *pumps, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _pump(i: int, stream: AsyncIterator[Any], queue: asyncio.Queue) -> None:
    try:
        async for msg in stream:
            await queue.put((i, msg))
    except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
        await queue.put((i, e))
        return
    await queue.put((i, _END))
