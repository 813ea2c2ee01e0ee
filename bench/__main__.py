"""CLI: `python -m bench WORKLOAD... [--quick] [--model DIR]`; WORKLOAD is offline, stall, neighbour, prefix, serve, flood,
replay, tiers, restart, evict, kvquant, host, spec, attention, grammar or all.

The thread environment is fixed here, before torch is imported, so every system (and the server
subprocess of `serve`) runs with the same intra-op threads and OpenMP wait policy.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

WORKLOADS = ("offline", "stall", "neighbour", "prefix", "serve", "flood", "replay", "tiers", "restart", "evict", "kvquant", "host", "spec",
             "attention", "grammar")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("workload", nargs="+", choices=(*WORKLOADS, "all"))
    ap.add_argument("--quick", action="store_true", help="shrunk sizes (~1 min in all): a smoke test, not a measurement")
    ap.add_argument("--model", type=Path, help="HF model directory (default: the engine/tiny.py `small` preset)")
    ap.add_argument("--out", type=Path, help="results folder (default bench/results/HOST, e.g. xeon-amx or epyc-avx512bf16; "
                    "bench/results/quick with --quick)")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="auto: bfloat16 if the CPU has AMX/AVX512-BF16, else float32")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (fixed for every system)")
    ap.add_argument("--rounds", type=int, default=1, help="measured rounds per system, alternating (best kept)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int,
                    help="offline: concurrency of every system (default 64: every request at once)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="offline: step token budget of sluice and transformers-cb (default 2048, the engine's)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # NOTE: libgomp's default spin-then-block barrier collapses when another process holds one of the
    # cores (measured: 15 ms instead of 0.1 ms per op with 2 threads on a shared 2-core host);
    # PASSIVE makes waiting threads sleep, so a busy neighbour costs a share, not a time slice per op.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch

    from bench import common

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or common.RESULTS_DIR / ("quick" if args.quick else common.host_slug())
    run = common.Run(
        model_dir=(args.model or common.default_model_dir()).resolve(),
        dtype=common.pick_dtype() if args.dtype == "auto" else args.dtype,
        threads=args.threads, quick=args.quick, out_dir=out, seed=args.seed, rounds=args.rounds,
        progress=not args.no_progress,
        command=" ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    names = WORKLOADS if "all" in args.workload else tuple(dict.fromkeys(args.workload))
    print(f"bench: {', '.join(names)} | model {run.model_dir} | {run.dtype} | {run.threads} threads"
          f"{' | quick' if run.quick else ''} -> {out}", file=sys.stderr)
    failed = 0
    for name in names:
        t = time.perf_counter()
        mod = __import__(f"bench.{name}", fromlist=["main"])
        res = mod.main(run)
        for tg in res.get("targets", []):
            mark = {True: "met", False: "MISSED", None: "n/a"}[tg["met"]]
            print(f"  {name}: {tg['name']} = {tg['value']} ({tg['op']} {tg['bound']}): {mark}", file=sys.stderr)
        failed += any(r.get("error") for r in res["rows"] if not r["system"].startswith("transformers"))
        print(f"bench {name}: {time.perf_counter() - t:.0f} s -> {out / (name + '.json')}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
