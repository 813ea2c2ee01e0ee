"""Sluice's network surface: WebSocket chat protocol, OpenAI-compatible HTTP, metrics (docs/architecture.md §1, §9).

Everything here runs on one asyncio loop, except the engine, which lives on its own thread (bridge.py).
"""
