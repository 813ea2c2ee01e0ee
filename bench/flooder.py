"""`python -m bench.flooder WS_URL`: sends 1 MB frames of 28,000 one-character messages as fast as the server
answers them, printing each answer's error code, one a line. `bench flood` and tests/hostile run it in a
process of its own at a low CPU priority: an attacker's CPU is on another machine, here it shares two cores."""
from __future__ import annotations

import asyncio
import json
import sys

from websockets.asyncio.client import connect

FRAME = json.dumps({"type": "chat", "id": "flood", "messages": [{"role": "user", "content": "x"}] * 28_000})


async def main(url: str) -> None:
    async with connect(url, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        while True:
            await ws.send(FRAME)
            reply = json.loads(await ws.recv())
            print(reply.get("code"), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
