"""``autotune serve``: plans over HTTP from a shared plan store (FastAPI on uvicorn, the ``serve`` extra).

- :mod:`.app`: the FastAPI application;
- :mod:`.bodies`: its request bodies, and what it says about a bad one;
- :mod:`.guard`: the Host and body-size gate in front of it;
- :mod:`.auth`: the bearer token, a FastAPI security dependency of every route but /healthz;
- :mod:`.answers`: the models of its JSON answers (what /openapi.json describes);
- :mod:`.probes`: the probes a service may run (built-in ones, and files in folders its operator named);
- :mod:`.worker`: the worker processes that run probes, one at a time each, with a time limit;
- :mod:`.jobs`: what a worker runs for a request, and how a failure is said.

Owns: the HTTP service, its probe workers and which probes it may run. May import: everything
below it (the API and the store included), beside the command line; the server process never
imports torch, its workers do.
"""
