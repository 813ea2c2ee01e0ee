"""Helpers of the hostile-client tests: raw sockets (test_connections.py). `main_server` comes from tests/conftest.py."""
from __future__ import annotations

import asyncio
import time

import pytest


# ---- raw sockets (tests/hostile/test_connections.py) -------------------------------------------
async def read_until_closed(reader: asyncio.StreamReader, within: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took; the test
    fails if the connection is still open after `within` seconds."""
    start, data = time.monotonic(), b""
    try:
        async with asyncio.timeout(within):
            while chunk := await reader.read(65536):
                data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {within} s; it sent {data[:200]!r}")
    except ConnectionResetError:
        pass  # closed with unread bytes on its side: closed all the same
    return data, time.monotonic() - start


async def still_open(reader: asyncio.StreamReader, for_s: float = 0.3) -> bool:
    """True if nothing arrives and the connection stays open for `for_s` seconds."""
    try:
        async with asyncio.timeout(for_s):
            await reader.read(1)
    except TimeoutError:
        return True
    return False
