"""How fast does the caching-allocator replica replay a training-like trace?

    python bench/allocator_speed.py                    # ~200k events, 3 repeats per row (~1 min on 2 cores)
    python bench/allocator_speed.py --events 50000 --repeat 1

The trace (seeded, made once, not timed) is what a transformer's training steps
ask of the allocator: parameters and optimizer state once, then per step each
layer's forward activations (sequence length varies from step to step, as with
dynamic batches), small tensors (biases, norms, scalars), backward temporaries
freed at once, activations freed in reverse order, gradients. Each row replays
the whole trace on a fresh ``CachingAllocator`` under one ``PYTORCH_CUDA_ALLOC_CONF``;
the "tight" row gives it only 90% of its default reserved peak, so cudaMalloc
fails and the release-and-retry path runs (an out-of-memory error would end the
replay there; the row says so). The first row is the cost
floor of any Python replay: a dict of live sizes and a running sum.

Printed: events, the median CPU seconds of a replay (process time, so that other
work on a shared machine does not count), events per CPU second, microseconds
per event, the simulated allocated and reserved peaks (the figures an estimate
would use), release-and-retry count, and whether the replay ran out of memory.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch
from common import machine

from autotune.devices.allocator import CachingAllocator

GiB = 2**30
LAYERS = 24
HIDDEN = 1024
BATCH = 8


def training_trace(events: int, seed: int = 0) -> list[tuple[int, int]]:
    """(+nbytes, id) for a malloc, (-1, id) for a free; about ``events`` of them."""
    rng = random.Random(seed)
    trace: list[tuple[int, int]] = []
    next_id = 0

    def malloc(nbytes: int) -> int:
        nonlocal next_id
        next_id += 1
        trace.append((nbytes, next_id))
        return next_id

    def free(i: int) -> None:
        trace.append((-1, i))

    for _ in range(LAYERS):  # weights, their gradients and two Adam moments
        for _ in range(4):
            malloc(4 * HIDDEN * HIDDEN * 4)
            malloc(HIDDEN * 4)
    while len(trace) < events:
        seq = rng.choice(range(384, 513, 16))
        act = BATCH * seq * HIDDEN * 4
        saved: list[int] = []
        for _ in range(LAYERS):
            saved += [malloc(act), malloc(act), malloc(4 * act), malloc(BATCH * seq * 4), malloc(rng.randint(64, 4096))]
            tmp = [malloc(act), malloc(BATCH * 16 * seq * seq * 2)]
            for i in tmp:
                free(i)
        for _ in range(LAYERS):
            grads = [malloc(act), malloc(4 * act), malloc(rng.randint(512, 65536))]
            for _ in range(5):
                free(saved.pop())
            for i in grads:
                free(i)
        for _ in range(LAYERS):  # optimizer step temporaries
            tmp = [malloc(4 * HIDDEN * HIDDEN * 4) for _ in range(2)]
            for i in tmp:
                free(i)
    return trace


def replay(trace: list[tuple[int, int]], conf: str, capacity: int) -> tuple[float, CachingAllocator]:
    """CPU seconds to replay the whole trace (until an out-of-memory error, if one comes), and the allocator."""
    a = CachingAllocator(capacity=capacity, conf=conf)
    handles: dict[int, int] = {}
    malloc, free = a.malloc, a.free
    start = time.process_time()
    try:
        for nbytes, i in trace:
            if nbytes > 0:
                handles[i] = malloc(nbytes)
            else:
                free(handles.pop(i))
    except torch.OutOfMemoryError:
        pass
    return time.process_time() - start, a


def floor_cost(trace: list[tuple[int, int]]) -> float:
    live: dict[int, int] = {}
    total = peak = 0
    start = time.process_time()
    for nbytes, i in trace:
        if nbytes > 0:
            live[i] = nbytes
            total += nbytes
            peak = max(peak, total)
        else:
            total -= live.pop(i)
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200_000, help="trace length (default 200000)")
    parser.add_argument("--repeat", type=int, default=3, help="replays per row; the median is printed (default 3)")
    args = parser.parse_args(argv)
    print(machine())
    trace = training_trace(args.events)
    default_peak = replay(trace, "", 80 * GiB)[1].max_reserved
    rows = [
        ("default", "", 80 * GiB),
        ("expandable_segments:True", "expandable_segments:True", 80 * GiB),
        ("max_split_size_mb:128 + gc 0.6, fraction 0.9",
         "max_split_size_mb:128,garbage_collection_threshold:0.6,per_process_memory_fraction:0.9", 80 * GiB),
        ("roundup_power2_divisions:4", "roundup_power2_divisions:4", 80 * GiB),
        ("default, tight: 0.9 x its reserved peak", "", int(default_peak * 0.9)),
    ]
    mallocs = sum(1 for n, _ in trace if n > 0)
    print(f"# {len(trace)} events ({mallocs} mallocs), {LAYERS} layers; median of {args.repeat} replays\n")
    print("| replay | CPU s | events/s | us/event | allocated peak | reserved peak | retries | OOM |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    seconds = statistics.median(floor_cost(trace) for _ in range(args.repeat))
    print(f"| floor: dict of sizes + running sum | {seconds:.2f} | {len(trace) / seconds:,.0f} | "
          f"{1e6 * seconds / len(trace):.2f} | | | | |")
    for name, conf, capacity in rows:
        print(f"... {name}", file=sys.stderr)
        runs = [replay(trace, conf, capacity) for _ in range(args.repeat)]
        seconds = statistics.median(r[0] for r in runs)
        a = runs[0][1]
        stats = a.memory_stats()
        print(f"| {name} | {seconds:.2f} | {len(trace) / seconds:,.0f} | {1e6 * seconds / len(trace):.2f} | "
              f"{a.max_allocated / GiB:.2f} GiB | {a.max_reserved / GiB:.2f} GiB | {stats['num_alloc_retries']} | "
              f"{'yes, replay stopped' if stats['num_ooms'] else 'no'} |")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
