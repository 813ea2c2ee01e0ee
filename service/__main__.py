"""`sluice serve` / `python -m service`: parse flags into a `ServerConfig` and serve."""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from service.config import LOG_FORMAT, ServerConfig, parse_config


def prepare(argv: Sequence[str]) -> ServerConfig:
    """What `main` does before it imports the server: flags parsed, logging set up, and with `--engine-process` (the
    default) the engine's child spawned, so that its imports run beside the server's (service/engine_child.py)."""
    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format=LOG_FORMAT)
    # NOTE: torch's worker threads spin while waiting; on a small CPU box, leaving one core to the
    # event loop keeps streaming latency flat. Must be set before torch is imported.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    if config.engine_process:
        from service.engine_child import start_early

        start_early()
    return config


def main(argv: Sequence[str] | None = None) -> int:
    config = prepare(sys.argv[1:] if argv is None else argv)
    from service.server import serve  # after flag parsing: `--help` must not wait for torch to import

    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
