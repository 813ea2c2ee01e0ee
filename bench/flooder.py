"""`python -m bench.flooder WS_URL [FROM]`: sends 1 MB frames of 28,000 one-character messages as fast as the server
answers them, printing each answer's error code, one a line. `bench flood` and tests/hostile run it in a
process of its own at a low CPU priority: an attacker's CPU is on another machine, here it shares two cores. FROM:
the local address to connect from (127.0.0.2: another client than the neighbour's 127.0.0.1, as a real
attacker's address is; the server shares its loop per client)."""
from __future__ import annotations

import asyncio
import json
import sys

from websockets.asyncio.client import connect

FRAME = json.dumps({"type": "chat", "id": "flood", "messages": [{"role": "user", "content": "x"}] * 28_000})


async def main(url: str, local: str | None = None) -> None:
    async with connect(url, max_size=None, local_addr=(local, 0) if local else None) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        while True:
            await ws.send(FRAME)
            reply = json.loads(await ws.recv())
            print(reply.get("code"), flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
