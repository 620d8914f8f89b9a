"""``autotune serve``: plans over HTTP from a shared plan store."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import options
from ..errors import BadInput
from .common import Formatter, flag

EXAMPLES = """\
Answers POST /v1/plan for estimated GPUs from a plan store shared by every job:
a plan asked for before comes from the store ("cached": true), a new one is
probed once, in a worker process, and kept. Probes are the built-in ones and
the NAME.py files in --probes folders; a request never names a file or module.
Without --host the service listens on 127.0.0.1 only; on any other address it
needs --token-file, and every request but GET /healthz then needs
"Authorization: Bearer <token>" (/healthz without it says only whether the
service is up). A request's Host must name the address listened on (on
127.0.0.1: also localhost) unless --allowed-hosts names it. A plan request
whose client hangs up stops its probe unless another request waits for the
same one; Ctrl-C or SIGTERM stops running probes and answers their requests
503 within seconds. The store must be a database every worker process can
reach: not an in-memory one. A request answered before (the same probe,
code and settings) is answered from the store without a worker. GET /metrics
gives Prometheus metrics (behind the token like the rest); each request is
logged as one JSON line on stderr (--no-access-log: none). The API is
described at /docs.

Several replicas share one PostgreSQL store (pip install 'autotune[serve,postgres]'):
a plan probed by one is answered by every other, a probe asked of two at
once runs once, and a replica killed while probing frees its probe at once (its
workers end with it and drop their claims), or once its claim's lease
(30 s) runs out when its host went away.

examples:
  autotune serve --store sqlite:///plans.db
  curl -s localhost:8321/v1/plan -H 'content-type: application/json' \\
       -d '{"target_batch": 1024, "probe": "gpt", "device": "estimate", "memory_budget": "80GiB"}'
  python -c 'import secrets; print(secrets.token_urlsafe(32))' > token && chmod 600 token
  autotune serve --store sqlite:///plans.db --host 10.0.0.5 --token-file token --allowed-hosts plans.internal

  # a team: two replicas (on two hosts, or two ports) behind a load balancer, one PostgreSQL store
  export AUTOTUNE_STORE=postgresql://autotune:PASSWORD@db.internal:5432/autotune
  autotune serve --host 0.0.0.0 --port 8321 --token-file token --probes ./probes --workers 2   # replica 1
  autotune serve --host 0.0.0.0 --port 8322 --token-file token --probes ./probes --workers 2   # replica 2
  curl -s -H "Authorization: Bearer $(cat token)" plans.internal:8321/metrics
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
    p.add_argument("--models", metavar="DIR", action="append", default=[],
                   help="a folder of Hugging Face model folders (NAME/config.json) a request's model may name by NAME "
                        "(repeat for several); hub ids are always served")
    p.add_argument("--allowed-hosts", metavar="NAMES", type=flag(_hosts, "--allowed-hosts"), default=None,
                   help="more names requests may give in their Host header, comma-separated ('*': any); the address "
                        "listened on is always one (and localhost on 127.0.0.1; on 0.0.0.0 or :: any name is)")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help=f"a file holding the bearer token every request must send (at least {MIN_TOKEN} characters)")
    p.add_argument("--workers", type=flag(options.workers, "--workers"), default=1, metavar="N",
                   help="worker processes running probes, one probe at a time each (at most "
                        f"{options.WORKERS_PER_CPU} per CPU)")
    p.add_argument("--probe-timeout", type=flag(options.seconds, "--probe-timeout"), default=options.PROBE_TIMEOUT_S,
                   metavar="SECONDS", help="a probe running longer is stopped and its request answered 504")
    p.add_argument("--read-timeout", type=flag(options.seconds, "--read-timeout"), default=options.READ_TIMEOUT_S,
                   metavar="SECONDS", help="a client that has not sent its request whole (headers and body) this long "
                                           "after it connected (or began its next request) is answered 408 and "
                                           "disconnected")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="no access-log line per request (by default one JSON object a line on stderr: time, method, "
                        "path, status, seconds, cached, fingerprint)")
    p.add_argument("--verbose", "-v", action="store_true", help="uvicorn's own log too")
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.set_defaults(handler=run)


def _port(text: str, name: str) -> int:
    port = options.whole(text, name)
    if port > 65535:
        raise BadInput(f"{name} {port} must be a port number from 1 to 65535")
    return port


def _hosts(text: str, name: str) -> frozenset[str]:
    names = frozenset(n.strip().lower().strip("[]") for n in text.split(",") if n.strip())
    if not names or any(" " in n or "/" in n for n in names):
        raise BadInput(f"{name} {text!r} must be host names or addresses, comma-separated (e.g. plans.internal,"
                       "10.0.0.5), or '*' for any")
    return names


def allowed_hosts(host: str, extra: frozenset[str] | None) -> frozenset[str] | None:
    """The names a request's Host may give: the address listened on (and this machine's names for a
    loopback one) and ``extra``; None (any) for a wildcard address or when ``extra`` holds '*'."""
    if extra is not None and "*" in extra:
        return None
    bound = host.strip("[]").lower()
    if bound in ("0.0.0.0", "::", ""):
        return None if extra is None else extra | {"localhost", "127.0.0.1", "::1"}
    names = {bound} | ({"localhost", "127.0.0.1", "::1"} if loopback(bound) else set())
    return frozenset(names | (extra or frozenset()))


def run(args: argparse.Namespace) -> int:
    url = args.store or options.store_from_environment()
    if not url:
        raise BadInput("autotune serve needs --store URL (or $AUTOTUNE_STORE), e.g. --store sqlite:///plans.db")
    from ..dburl import check_storage
    from ..store.database import in_memory

    name = "--store" if args.store else "$AUTOTUNE_STORE"
    check_storage(url, name, store=True)
    if in_memory(url):
        raise BadInput(f"{name} {url!r} is an in-memory database, private to each connection: the service's "
                       "workers would not see what it stores; give a file, e.g. --store sqlite:///plans.db")
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
    from ..serve.models import model_folders
    from ..serve.probes import Catalogue

    catalogue = Catalogue(args.probes)
    app = create_app(Settings(store=url, probes=catalogue, token=token, workers=args.workers,
                              probe_timeout_s=args.probe_timeout,
                              allowed_hosts=allowed_hosts(args.host, args.allowed_hosts),
                              models=model_folders(args.models)))
    where = f"[{args.host}]" if ":" in args.host else args.host
    served = ", ".join(p.name for p in catalogue.all())
    print(f"autotune serve: http://{where}:{args.port} (docs at /docs; probes: {served}; "
          f"{'bearer token required' if token else 'no token: this machine only'})", file=sys.stderr, flush=True)
    if args.access_log:
        _log_access()
    from ..serve.guard import protocol

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            access_log=False, http=protocol(args.read_timeout))
    _server(uvicorn.Server, app.state.pool.shutdown)(config).run()
    return 0


def _log_access() -> None:
    """Access-log lines (:mod:`autotune.serve.metrics`) on stderr, as they are: one JSON object each."""
    import logging

    from ..serve.metrics import access

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def _server(base: type, on_exit: Callable[[], None]) -> type:
    """uvicorn's Server, which on Ctrl-C or SIGTERM first calls ``on_exit`` (the workers' probes end and
    their requests are answered, instead of the server waiting for them to finish)."""

    class Server(base):
        def handle_exit(self, sig: int, frame: Any) -> None:
            on_exit()
            super().handle_exit(sig, frame)

    return Server


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
