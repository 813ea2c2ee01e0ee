"""`python -m bench.serve_host LAG_FILE SERVICE_FLAGS...`: the real server (`python -m service`), plus an
event-loop lag probe running on the server's own loop.

The probe sleeps 5 ms over and over and records how late each wake-up is: the time any callback
(a socket write, a step's fan-out, GIL waits on the engine thread) held the loop. Samples are
appended to LAG_FILE as float64 pairs (time.monotonic(), lag seconds), flushed every ~250 ms.
Nothing in service/ changes: the probe wraps `Service.lifespan` before the app is built. It starts as `sluice serve`
does (`service.__main__.prepare`): the engine's child is spawned before the server's imports.
"""
from __future__ import annotations

import asyncio
import sys
import time
from array import array
from contextlib import asynccontextmanager
from typing import BinaryIO

INTERVAL_S = 0.005


async def probe(out: BinaryIO) -> None:
    buf = array("d")
    flushed = time.monotonic()
    try:
        while True:
            t = time.monotonic()
            await asyncio.sleep(INTERVAL_S)
            now = time.monotonic()
            buf.extend((now, max(0.0, now - t - INTERVAL_S)))
            if now - flushed > 0.25:
                out.write(buf.tobytes())
                buf, flushed = array("d"), now
    finally:
        out.write(buf.tobytes())


def main(argv: list[str]) -> int:
    lag_file, flags = open(argv[0], "ab", buffering=0), argv[1:]  # noqa: SIM115 — lives as long as the process
    from service import __main__ as cli

    config = cli.prepare(flags)  # the engine's child starts before the server's imports, as under `sluice serve`
    from service.app import Service
    from service.server import serve

    inner = Service.lifespan

    @asynccontextmanager
    async def lifespan(self, app):
        task = asyncio.get_running_loop().create_task(probe(lag_file))
        try:
            async with inner(self, app):
                yield
        finally:
            task.cancel()

    Service.lifespan = lifespan
    return serve(config)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
