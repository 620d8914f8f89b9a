"""``autotune plan``: probe, then plan micro-batch x accumulation x ranks = exactly the target."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .. import options
from ..errors import BadInput
from . import settings_flags
from .common import (
    Formatter,
    add_common,
    add_distributed,
    add_report,
    add_settings,
    add_store,
    check_memory_snapshot,
    check_output,
    check_report,
    check_store,
    import_torch,
    write_output,
    write_report,
)
from .model_flags import add_model_flags, workload_of

if TYPE_CHECKING:
    from ..planning.planner import Uniform
    from ..results.request import PlanRequest

EXAMPLES = """\
Probes the largest micro-batch that fits (estimate first, one real run to
confirm), then plans the fewest accumulation steps that give exactly the
target effective batch over all data-parallel ranks.

examples:
  autotune plan --target-batch 1024
  autotune plan --target-batch 1024 --device cpu --memory-budget 256MiB
  autotune plan --target-batch 1021 --probe mlp --memory-budget 8MiB      # uneven, exact
  autotune plan --target-batch 4096 --world-size 8 --format deepspeed > ds_batch.json
  autotune plan --target-batch 1024 --format lightning     # {"trainer": {...}, "datamodule": {"batch_size": ...}}
  autotune plan --target-batch 512 --device estimate --memory-budget 80GiB --probe gpt:build_1b
  autotune plan --target-batch 4096 --parallel fsdp --world-size 64 --device estimate --memory-budget 80GiB \
      --probe gpt:build_1b                                              # one rank of 64, sharded
  autotune plan --target-batch 1024 --tune --trials 12 --storage sqlite:///reports/tune.db
  autotune plan --target-batch 1024 --memory-budget 256MiB --report          # reports/gpt-<time>/report.html
  autotune plan --target-batch 512 --device estimate --memory-budget 80GiB --store sqlite:///plans.db
  autotune plan --target-batch 512 --device estimate:H100-80GB --probe gpt:build_100m --memory-snapshot m.pickle
  autotune plan --target-tokens 65536 --model gpt2 --lengths lengths.csv --device estimate:H100-80GB
  autotune plan --target-batch 512 --model DIR --device estimate:A10G-24GB*4 --search-settings --allow lora
"""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan micro-batch x accumulation steps x ranks = exactly the target batch",
                       description=EXAMPLES, formatter_class=Formatter)
    target = p.add_mutually_exclusive_group(required=True)
    add_settings(p, "plan", into={"target_batch": target, "target_tokens": target})  # every setting of a plan
    add_model_flags(p)
    p.add_argument("--format", choices=options.FORMATS, default="table",
                   help="table: a summary for people; json: the Plan; hf|lightning|deepspeed|accelerate: "
                        "that framework's batch settings as a JSON object, from a plan of equal micro-batches "
                        "(exit 2 naming the nearest targets when there is none within twice the fewest steps; "
                        "--uniform forces one)")
    p.add_argument("--output", metavar="FILE", help="also write the Plan JSON to FILE (atomically)")
    add_store(p)
    add_report(p)
    add_distributed(p)
    add_common(p)
    p.set_defaults(handler=run)


def uniform_choice(args) -> Uniform:
    """--uniform: equal micro-batches, however many steps; framework formats: equal ones within twice the fewest."""
    if args.uniform:
        return "force"
    return True if getattr(args, "format", "table") in options.FRAMEWORKS else None


def request_of(args, target: int | None = None) -> PlanRequest:
    """The plan the flags ask for (of ``target`` samples, else --target-batch), every flag checked here, once,
    before torch loads (a target no plan can hold, an optuna storage that cannot open, flags that exclude each
    other)."""
    from ..planning.requests import plan_request

    return plan_request(target or args.target_batch, probe=args.probe, device=args.device,
                        memory_budget=args.memory_budget, margin=args.margin, world_size=args.world_size,
                        multiple_of=args.multiple_of,
                        uniform=uniform_choice(args), uniform_ranks=args.uniform_ranks, parallel=args.parallel,
                        fsdp_sync=args.fsdp_sync,
                        tune=args.tune, trials=args.trials, storage=args.storage, study_name=args.study_name,
                        memory_snapshot=args.memory_snapshot, at=args.at,
                        search_settings=getattr(args, "search_settings", False), allow=getattr(args, "allow", None),
                        group=options.torchrun_group())


def run(args) -> int:
    check_output(args.output)
    check_report(args)
    check_store(args)
    check_memory_snapshot(args)
    lengths = None
    if args.cut_samples and args.target_tokens is None:
        raise BadInput("--cut-samples cuts samples where a step of --target-tokens ends: add --target-tokens N")
    if args.target_tokens is not None:
        if args.tune:
            raise BadInput("--tune times plans of a target batch, not of --target-tokens: drop --tune, or give "
                           "--target-batch")
        if args.model is None:  # without --model, --lengths are the samples' tokens alone
            lengths, args.lengths = args.lengths, None
        else:
            lengths = args.lengths
    args.probe = workload_of(args)  # --model NAME is the workload's model spec
    request = request_of(args) if args.target_tokens is None else None
    import_torch(freeze=args.own_process)
    from ..training import distributed

    with distributed.process_group(args.dist_timeout):
        return _plan(args, request, lengths, lead=distributed.rank() == 0)


def _plan(args, request: PlanRequest | None, lengths: str | None, *, lead: bool) -> int:
    from .. import api as pipeline
    from ..errors import NoUniformPlan, RanksDiffer
    from ..planning.exports import FRAMEWORKS, export, no_equal_split, ranks_differ
    from ..serial import dumps

    framework = args.format in FRAMEWORKS  # equal micro-batches, printed as that framework's settings
    fmt = args.format if framework or not args.json else "json"
    try:
        if request is None:
            plan = pipeline.plan_in_tokens(args.target_tokens, lengths, args.probe,
                                           lambda n: pipeline.plan_for(request_of(args, n), store=args.store),
                                           cut=args.cut_samples)
        else:
            plan = pipeline.plan_for(request, store=args.store)
    except NoUniformPlan as exc:
        raise no_equal_split(exc, args.format, force="--uniform") from None
    except RanksDiffer as exc:
        raise ranks_differ(exc, args.format) from None
    if not lead:
        return 0  # rank 0 speaks for every rank
    text = dumps(plan.to_dict()) if fmt == "json" or args.output else ""  # a million ranks' plan takes seconds
    if fmt == "json":
        print(text, end="")
    elif fmt == "table":
        print("\n".join([plan.summary(), *settings_flags.lines(plan)]))
        if plan.probe is not None and plan.probe.model is not None:
            print(plan.probe.model.line())
        if plan.probe is not None and plan.probe.memory is not None:
            print("\n".join(plan.probe.memory.lines(capacity=plan.probe.capacity_bytes)))
    else:
        print(json.dumps(export(plan, fmt), indent=2))
        settings_flags.say_notes(plan, fmt)
    write_output(args.output, text)
    write_report(args, plan)
    return 0
