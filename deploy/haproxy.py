"""Writes an HAProxy configuration for Sluice replicas from deploy/haproxy.cfg.template (README "Scaling").

    python3 deploy/haproxy.py --bind :8000 --replica 10.0.0.1:8000 --replica 10.0.0.2:8000 > haproxy.cfg
    python3 deploy/haproxy.py --bind :8000 --replicas-dns sluice:8000 --count 4 > haproxy.cfg   # compose replicas

Standard library only: it runs wherever the proxy does. Check the result with `haproxy -c -f haproxy.cfg`.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from string import Template

TEMPLATE = Path(__file__).with_name("haproxy.cfg.template")
WHOLE_ADDRESSES = ("0.0.0.0/0", "::ffff:0:0/96", "64:ff9b::/96", "::1", "fc00::/7", "fe80::/10")
_ADDRESS = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


def render(*, bind: str, replicas: list[str] = (), replicas_dns: str | None = None, count: int = 0,
           check_interval: str = "2s", hard_stop_after: str = "30m", maxconn: int = 4096,
           log_level: str = "info", rate_limit: int = 1000) -> str:
    """The configuration text. `replicas`: fixed HOST:PORT addresses; or `replicas_dns` (HOST:PORT whose name
    resolves to the replicas, e.g. a compose service) with up to `count` servers filled from DNS. `rate_limit`: the
    requests a client may send in 10 s (0: no bound)."""
    if rate_limit < 0:
        raise ValueError(f"--rate-limit must be >= 0 (0: no bound), not {rate_limit}")
    if bool(replicas) == bool(replicas_dns):
        raise ValueError("give either --replica (one or more) or --replicas-dns, not both or neither")
    for address in [*replicas, *([replicas_dns] if replicas_dns else [])]:
        if not _ADDRESS.match(address):
            raise ValueError(f"not a HOST:PORT address: {address!r}")
    if replicas:
        servers = "\n".join(f"    server replica{i} {a}" for i, a in enumerate(replicas, 1))
    else:
        if count < 1:
            raise ValueError("--replicas-dns needs --count >= 1 (the most replicas the proxy will use)")
        # NOTE: compose's DNS (127.0.0.11) answers every replica's address; the template fills `count` slots
        servers = (f"    server-template replica {count} {replicas_dns} resolvers dns init-addr none\n\n"
                   "resolvers dns\n    parse-resolv-conf\n    hold valid 5s")
    error = json.dumps({"error": {"message": f"more than {rate_limit} requests in 10 s from this client; retry later",
                                  "type": "requests", "param": None, "code": "rate_limit_exceeded"}})
    limit = "" if not rate_limit else (
        "    stick-table type ipv6 size 1m expire 60s store http_req_rate(10s)\n"
        # (an internet IPv6 address by its /64; IPv4, IPv4 on a dual-stack bind, NAT64's, and loopback, private and
        # link-local addresses each alone, as service/handle.py client_key counts clients)
        f"    acl whole_address src {' '.join(WHOLE_ADDRESSES)}\n"
        "    http-request track-sc0 src if whole_address\n"
        "    http-request track-sc0 src,ipmask(32,64) unless whole_address\n"
        f"    http-request return status 429 content-type application/json hdr retry-after 5 string '{error}'"
        f" if {{ sc_http_req_rate(0) gt {rate_limit} }}\n")
    return Template(TEMPLATE.read_text()).substitute(
        bind=bind, servers=servers, check_interval=check_interval, hard_stop_after=hard_stop_after,
        maxconn=maxconn, log_level=log_level, rate_limit=limit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/haproxy.py", description=__doc__.splitlines()[0])
    ap.add_argument("--bind", default=":8000", help="HAProxy's listening address (default: %(default)s)")
    ap.add_argument("--replica", action="append", default=[], metavar="HOST:PORT", help="a replica (repeat)")
    ap.add_argument("--replicas-dns", metavar="HOST:PORT", help="a name that resolves to every replica")
    ap.add_argument("--count", type=int, default=0, help="with --replicas-dns: the most replicas to use")
    ap.add_argument("--check-interval", default="2s", help="between two /health checks (default: %(default)s)")
    ap.add_argument("--hard-stop-after", default="30m",
                    help="how long old workers keep their streams after a reload (default: %(default)s)")
    ap.add_argument("--maxconn", type=int, default=4096,
                    help="most client connections (HAProxy needs ~2 file descriptors each; default: %(default)s)")
    ap.add_argument("--rate-limit", type=int, default=1000, metavar="N",
                    help="requests a client (an address; an IPv6 /64) may send in 10 s before it gets 429s; "
                         "0: no bound (default: %(default)s)")
    ap.add_argument("-o", "--output", type=Path, help="write here (default: stdout)")
    args = ap.parse_args(argv)
    try:
        text = render(bind=args.bind, replicas=args.replica, replicas_dns=args.replicas_dns, count=args.count,
                      check_interval=args.check_interval, hard_stop_after=args.hard_stop_after,
                      maxconn=args.maxconn, rate_limit=args.rate_limit)
    except ValueError as e:
        ap.error(str(e))
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
