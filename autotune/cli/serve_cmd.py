"""``autotune serve``: plans over HTTP from a shared plan store."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import stat
import sys
from pathlib import Path

from .. import options
from ..errors import BadInput
from .common import Formatter, flag, positive_int

EXAMPLES = """\
Answers POST /v1/plan for estimated GPUs from a plan store shared by every job:
a plan asked for before comes from the store ("cached": true), a new one is
probed once, in a worker process, and kept. Probes are the built-in ones and
the NAME.py files in --probes folders; a request never names a file or module.
Without --host the service listens on 127.0.0.1 only; on any other address it
needs --token-file, and every request but GET /healthz then needs
"Authorization: Bearer <token>". The API is described at /docs.

examples:
  autotune serve --store sqlite:///plans.db
  curl -s localhost:8321/v1/plan -H 'content-type: application/json' \\
       -d '{"target_batch": 1024, "probe": "gpt", "device": "estimate", "memory_budget": "80GiB"}'
  python -c 'import secrets; print(secrets.token_urlsafe(32))' > token && chmod 600 token
  autotune serve --store postgresql://db.internal/autotune --host 0.0.0.0 --token-file token --probes ./probes
"""

DEFAULT_PORT = 8321
#: A token shorter than this is refused: it could be guessed.
MIN_TOKEN = 16


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve plans over HTTP from a shared plan store (needs autotune[serve])",
                       description=EXAMPLES, formatter_class=Formatter)
    p.add_argument("--store", metavar="URL", default=None,
                   help="the plan store, e.g. sqlite:///plans.db or postgresql://HOST/DB (default: $AUTOTUNE_STORE)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; any but a loopback one needs "
                                                        "--token-file")
    p.add_argument("--port", type=flag(_port, "--port"), default=DEFAULT_PORT, help="port to listen on")
    p.add_argument("--probes", metavar="DIR", action="append", default=[],
                   help="a folder whose NAME.py probe files the service may run (repeat for several); the built-in "
                        "probes are always served")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help=f"a file holding the bearer token every request must send (at least {MIN_TOKEN} characters)")
    p.add_argument("--workers", type=positive_int("--workers"), default=1, metavar="N",
                   help="worker processes running probes, one probe at a time each")
    p.add_argument("--probe-timeout", type=flag(options.seconds, "--probe-timeout"), default=600.0,
                   metavar="SECONDS", help="a probe running longer is stopped and its request answered 504")
    p.add_argument("--verbose", "-v", action="store_true", help="log every request")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.set_defaults(handler=run)


def _port(text: str, name: str) -> int:
    port = options.whole(text, name)
    if port > 65535:
        raise BadInput(f"{name} {port} must be a port number from 1 to 65535")
    return port


def run(args: argparse.Namespace) -> int:
    url = args.store or os.environ.get("AUTOTUNE_STORE", "").strip()
    if not url:
        raise BadInput("autotune serve needs --store URL (or $AUTOTUNE_STORE), e.g. --store sqlite:///plans.db")
    from ..dburl import check_storage

    check_storage(url, "--store" if args.store else "$AUTOTUNE_STORE")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise BadInput(f"autotune serve needs FastAPI and uvicorn ({exc.name} is not installed): "
                       "pip install 'autotune[serve]'") from None
    token = read_token(args.token_file) if args.token_file else None
    if token is None and not loopback(args.host):
        raise BadInput(f"--host {args.host} is reachable from other machines: give --token-file FILE with a bearer "
                       "token (python -c 'import secrets; print(secrets.token_urlsafe(32))' > FILE)")
    check_port(args.host, args.port)
    from ..serve.app import Settings, create_app
    from ..serve.probes import Catalogue

    catalogue = Catalogue(args.probes)
    app = create_app(Settings(store=url, probes=catalogue, token=token, workers=args.workers,
                              probe_timeout_s=args.probe_timeout))
    where = f"[{args.host}]" if ":" in args.host else args.host
    served = ", ".join(p.name for p in catalogue.all())
    print(f"autotune serve: http://{where}:{args.port} (docs at /docs; probes: {served}; "
          f"{'bearer token required' if token else 'no token: this machine only'})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                access_log=args.verbose)
    return 0


def loopback(host: str) -> bool:
    """Is ``host`` reachable from this machine only?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str) -> str:
    """The bearer token in ``path``: one line, at least :data:`MIN_TOKEN` characters."""
    file = Path(path)
    try:
        token = file.read_text(encoding="utf-8").strip()
        mode = file.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"--token-file {path} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if len(token) < MIN_TOKEN or any(ch.isspace() for ch in token):
        raise BadInput(f"--token-file {path} must hold one token of at least {MIN_TOKEN} characters and no spaces "
                       "(python -c 'import secrets; print(secrets.token_urlsafe(32))' makes one)")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        print(f"autotune serve: warning: --token-file {path} is readable by other users: chmod 600 {path}",
              file=sys.stderr)
    return token


def check_port(host: str, port: int) -> None:
    """BadInput when ``host:port`` cannot be listened on (in use, or not an address here)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BadInput(f"--host {host} is not an address of this machine ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise BadInput(f"cannot listen on {host}:{port} ({exc.strerror}): give another --port, or stop "
                           "what uses it") from None
