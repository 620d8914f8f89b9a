"""Which Host names a service answers to: the address it listens on, and what --allowed-hosts adds."""

from __future__ import annotations

import pytest

from autotune.cli.serve_cmd import allowed_hosts
from autotune.serve.guard import host_name

LOCAL = {"127.0.0.1", "localhost", "::1"}


@pytest.mark.parametrize("host,extra,names", [
    ("127.0.0.1", None, LOCAL),
    ("localhost", None, LOCAL),
    ("::1", None, LOCAL),
    ("127.0.0.1", frozenset({"plans.internal"}), LOCAL | {"plans.internal"}),
    ("10.0.0.5", None, {"10.0.0.5"}),
    ("10.0.0.5", frozenset({"plans.internal"}), {"10.0.0.5", "plans.internal"}),
    ("0.0.0.0", None, None),  # every address of the machine: its names are not known, any is taken
    ("::", None, None),
    ("0.0.0.0", frozenset({"plans.internal"}), LOCAL | {"plans.internal"}),
    ("127.0.0.1", frozenset({"*"}), None),
])
def test_the_names_a_service_answers_to(host, extra, names):
    assert allowed_hosts(host, extra) == (None if names is None else frozenset(names))


@pytest.mark.parametrize("header,name", [
    (b"127.0.0.1:8321", "127.0.0.1"), (b"LocalHost", "localhost"), (b"[::1]:8321", "::1"), (b"[::1]", "::1"),
    (b"attacker.example.com:80", "attacker.example.com"), (b"", ""),
    (b"localhost:18321@evil.com", "localhost:18321@evil.com"), (b"localhost:", "localhost:"),
    (b"[::1]:80@evil.com", "[::1]:80@evil.com"), (b"[::1]x", "[::1]x"), (b"localhost:\xb2", "localhost:\xb2"),
])
def test_the_name_in_a_host_header(header, name):
    assert host_name(header) == name


def test_allowed_hosts_must_be_names(capsys):
    from autotune.cli import main

    assert main(["serve", "--store", "sqlite:///x.db", "--allowed-hosts", "a b,c"]) == 2
    assert "--allowed-hosts 'a b,c' must be host names or addresses" in capsys.readouterr().err


def test_workers_are_bounded_by_the_cpus(capsys):
    import os

    from autotune import options
    from autotune.cli import main

    bound = options.WORKERS_PER_CPU * (os.cpu_count() or 1)
    # --port 0 is refused as well, after: the command never starts serving, bound or not
    assert main(["serve", "--store", "sqlite:///x.db", "--workers", str(bound + 1), "--port", "0"]) == 2
    assert (f"--workers {bound + 1} is more than {bound}, {options.WORKERS_PER_CPU} per CPU "
            f"({os.cpu_count()} here)") in capsys.readouterr().err
    assert main(["serve", "--store", "sqlite:///x.db", "--workers", "0"]) == 2
