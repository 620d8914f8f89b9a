"""``autotune probe``: the largest micro-batch that fits."""

from __future__ import annotations

from collections.abc import Sequence

from .common import (
    Formatter,
    add_common,
    add_settings,
    add_store,
    check_memory_snapshot,
    check_output,
    check_store,
    import_torch,
    write_output,
)
from .model_flags import add_model_flags

EXAMPLES = """\
Estimates with fake tensors first (no device memory used), then confirms with
one real run of the fit rule: two optimizer steps of two micro-steps each.
When a real run disagrees, the real peaks correct the estimate and the next
run goes where they predict; what cannot be estimated is searched on the device.

examples:
  autotune probe
  autotune probe --probe mlp --device cpu --memory-budget 64MiB
  autotune probe --probe gpt:build_1b --device estimate --memory-budget 80GiB
  autotune probe --probe gpt:build_100m --device estimate:A100-40GB
  autotune probe --probe gpt:build_1b --parallel fsdp --world-size 8 --device estimate --memory-budget 80GiB
  autotune probe --probe my_model.py --max-batch 512 --json > probe.json
  autotune probe --probe gpt --device estimate --memory-budget 24GiB --store sqlite:///plans.db
  autotune probe --probe gpt:build_100m --device estimate:H100-80GB --memory-snapshot gpt.pickle
      # then: python -m torch.cuda._memory_viz trace_plot gpt.pickle -o gpt.html
"""


def add_parser(sub) -> None:
    p = sub.add_parser("probe", help="find the largest micro-batch that fits the device", description=EXAMPLES,
                       formatter_class=Formatter)
    add_settings(p, "probe")  # every setting of a probe
    add_model_flags(p)
    p.add_argument("--output", metavar="FILE", help="also write the ProbeResult JSON to FILE (atomically)")
    add_store(p)
    add_common(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from ..planning.requests import probe_request
    from ..results.request import Snapshot
    from .model_flags import workload_of

    check_output(args.output)
    check_store(args)
    check_memory_snapshot(args)
    # Every flag checked here, once, before torch loads.
    request = probe_request(workload_of(args), device=args.device, memory_budget=args.memory_budget,
                            margin=args.margin, max_batch=args.max_batch, parallel=args.parallel,
                            fsdp_sync=args.fsdp_sync, world_size=args.world_size)
    snapshot = Snapshot.of(args.memory_snapshot, args.at)
    import_torch(freeze=args.own_process)
    from .. import api as pipeline
    from ..serial import dumps

    result = pipeline.probe_for(request, store=args.store, snapshot=snapshot)
    text = dumps(result.to_dict())
    if args.json:
        print(text, end="")
    else:
        print(describe(result))
    write_output(args.output, text)
    return 0


def describe(result) -> str:
    from ..units import format_bytes

    lines = [result.summary(), f"device: {result.device.summary}"]
    if result.model is not None:
        lines.append(result.model.line())
    allocator = result.allocator_line()
    # with --at, the memory lines below are of another micro-batch than the probe's own figures: say whose these are
    other = result.memory is not None and result.memory.batch != result.max_micro_batch
    if result.breakdown:
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in result.breakdown.items())
        # under a caching allocator the reserved peak decides, and the tensors' peak comes at another moment
        where = "live tensors at the allocated peak" if allocator is not None else "at the peak"
        if other:
            where += (f" of micro-batch {result.max_micro_batch} (the max; micro-batch {result.memory.batch}'s "
                      "memory is below)")
        lines.append(f"{where}: {parts}")
    if allocator is not None:
        lines.append(f"at micro-batch {result.max_micro_batch} (the max), {allocator}" if other else allocator)
    lines.append(f"trials: {len(result.trials)} ({result.real_runs} real, {result.real_ooms} out of memory), "
                 f"{result.seconds:.1f} s")
    if any(t.allocated_bytes is not None for t in result.trials):
        rows = [(str(t.batch), t.source, "OOM" if t.oom else format_bytes(t.peak_bytes),
                 "-" if t.allocated_bytes is None else format_bytes(t.allocated_bytes),
                 "-" if t.retries is None else str(t.retries), "yes" if t.fits else "no", f"{t.seconds:.2f}")
                for t in result.trials]
        lines.append(text_table(("batch", "source", "reserved", "allocated", "retries", "fits", "seconds"), rows))
    else:
        plain = [(str(t.batch), t.source, "OOM" if t.oom else format_bytes(t.peak_bytes), "yes" if t.fits else "no",
                  f"{t.seconds:.2f}") for t in result.trials]
        lines.append(text_table(("batch", "source", "peak", "fits", "seconds"), plain))
    lines += [f"note: {n}" for n in result.notes]
    if result.memory is not None:
        lines += result.memory.lines(capacity=result.capacity_bytes)
    return "\n".join(lines)


def text_table(headers: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    """Columns right-aligned to their widest cell, as a person reads a table in a terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    return "\n".join(" ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in (headers, *rows))
