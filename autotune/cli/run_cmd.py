"""``autotune run``: train the probe workload by a plan and verify it."""

from __future__ import annotations

import argparse

from .. import options
from ..errors import BadInput
from . import settings_flags
from .common import (
    Formatter,
    add_common,
    add_distributed,
    add_fsdp_sync,
    add_report,
    add_schedule_flags,
    add_store,
    check_output,
    check_probe,
    check_report,
    check_store,
    flag,
    import_torch,
    positive_int,
    write_output,
    write_report,
)
from .model_flags import add_device, workload_of

EXAMPLES = """\
Trains the probe workload by the plan for N optimizer steps and verifies it:
the accumulated gradient equals the full-batch gradient (relative error,
limit 1e-5 in fp32), peak memory stays under the usable budget, and every step
consumes exactly the target batch. Exit code 1 when a check fails.

examples:
  autotune run --target-batch 1024 --device cpu --memory-budget 256MiB
  autotune plan --target-batch 1021 --probe mlp --memory-budget 8MiB --output plan.json
  autotune run --plan plan.json --steps 5 --json
  autotune run --plan plan.json --report reports/my-run
  autotune run --target-batch 256 --probe convnet --memory-budget 64MiB    # BatchNorm is flagged
  autotune run --target-batch 512 --probe mlp --device cpu --memory-budget 2MB --steps 200 --ramp
  torchrun --nproc-per-node 2 -m autotune run --target-batch 64 --probe mlp --device cpu --memory-budget 3MB
  torchrun --nproc-per-node 2 -m autotune run --target-batch 64 --probe gpt --device cpu --memory-budget 8MB \
      --parallel fsdp
"""


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train by a plan for N steps and verify it", description=EXAMPLES,
                       formatter_class=Formatter)
    p.add_argument("--plan", metavar="FILE", help="a Plan JSON from autotune plan --output (else plan now)")
    settings_flags.add_run_flag(p)
    p.add_argument("--target-batch", type=positive_int("--target-batch"), metavar="N",
                   help="plan for this effective batch first (when no --plan)")
    add_device(p)
    add_schedule_flags(p)
    p.add_argument("--parallel", choices=options.PARALLEL, default=None,
                   help="ddp or fsdp (fully_shard) when planning now (default ddp); a --plan runs as it was made")
    add_fsdp_sync(p)
    p.add_argument("--steps", type=positive_int("--steps"), default=options.STEPS, help="optimizer steps to train")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                   help="check gradient equivalence, memory and sample counts")
    p.add_argument("--precision", choices=options.PRECISIONS, default="fp32",
                   help="fp32, or autocast to bf16/fp16 (fp16 with one GradScaler scale per step)")
    p.add_argument("--max-norm", type=flag(options.max_norm, "--max-norm"), default=None, metavar="X",
                   help="clip the accumulated gradient to this norm, once per optimizer step")
    p.add_argument("--ramp", action="store_true",
                   help="start at a small effective batch and grow it toward --target-batch with the measured "
                        "gradient noise scale (about B_simple, only when its 95%% lower bound is above the batch), "
                        "every phase an exact plan of micro-batches at most the memory limit (the fewest micro-steps, "
                        "evened; with --uniform whole micro-batches of the plan's); ranks that differ ramp with "
                        "--uniform-ranks; the result's batch_schedule says what was done")
    p.add_argument("--ramp-from", type=positive_int("--ramp-from"), default=None, metavar="N",
                   help="with --ramp: the first effective batch (default: the smallest with two micro-batches at "
                        "the memory limit, or a quarter of a target that memory holds in one step)")
    p.add_argument("--lr-scaling", choices=options.LR_SCALINGS, default=None,
                   help="with --ramp: how the learning rate follows the batch: noise (McCandlish et al.'s "
                        "eps(B) = eps_max / (1 + B_noise/B), relative to the target), linear, sqrt, none "
                        f"(default {options.DEFAULT_LR_SCALING})")
    p.add_argument("--output", metavar="FILE", help="also write the RunResult JSON to FILE (atomically)")
    add_store(p)
    add_report(p)
    add_distributed(p)
    add_common(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    settings_flags.for_run(args)
    if (args.plan is None) == (args.target_batch is None):
        raise BadInput("give either --plan FILE or --target-batch N (one of them)")
    if not args.ramp and (args.ramp_from is not None or args.lr_scaling is not None):
        raise BadInput(f"{'--ramp-from' if args.ramp_from is not None else '--lr-scaling'} is for a batch ramp: "
                       "add --ramp")
    check_output(args.output)
    check_report(args)
    check_probe(args)
    args.probe = workload_of(args)  # --model NAME is the workload's model spec
    check_store(args)
    _check_ramp(args)
    import_torch(freeze=args.own_process)
    from ..training import distributed

    with distributed.process_group(args.dist_timeout):
        return _run(args, lead=distributed.rank() == 0)


def _check_ramp(args) -> None:
    """What the flags alone show a ramp cannot run, before torch loads: a start above the target, and a device or
    budget per rank in a process that is not one of a torchrun job's ranks."""
    if not args.ramp:
        return
    from ..planning.ramp import check_below
    from ..planning.requests import this_rank

    if args.ramp_from is not None and args.target_batch is not None:
        check_below(args.ramp_from, args.target_batch)
    this_rank(args.device, args.memory_budget, options.torchrun_group())


def _run(args, *, lead: bool) -> int:
    from .. import api as pipeline
    from ..results.ramp import RampConfig
    from ..serial import dumps

    result = pipeline.run(plan=args.plan, target_batch=args.target_batch, probe=args.probe, device=args.device,
                          memory_budget=args.memory_budget, margin=args.margin, world_size=args.world_size,
                          multiple_of=args.multiple_of, uniform="force" if args.uniform else None, steps=args.steps,
                          verify=args.verify, precision=args.precision, max_norm=args.max_norm,
                          parallel=args.parallel, fsdp_sync=args.fsdp_sync, store=args.store,
                          uniform_ranks=args.uniform_ranks, search_settings=args.search_settings,
                          ramp=RampConfig(start=args.ramp_from,
                                          lr_scaling=args.lr_scaling or options.DEFAULT_LR_SCALING)
                          if args.ramp else None)
    if not lead:
        return 0 if result.passed else 1  # rank 0 speaks for every rank; the verdict is shared
    text = dumps(result.to_dict())
    print(text, end="") if args.json else print(result.summary())
    write_output(args.output, text)
    write_report(args, result)
    return 0 if result.passed else 1
