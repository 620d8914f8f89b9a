"""A case of torchrun_cases.py: FSDP on two gloo ranks.

Returns every rank's peak of the FSDP fit rule measured on the real process
group, and again with collectives that keep every buffer they were given until
the end (what gloo's threads do for a while, longer on a loaded machine); a
probe where rank 1 has less memory than rank 0 (its real trials run out of
memory mid-forward, with units all-gathered) and what was left alive after it;
the runner's checks, on a plan made from that probe, for the correct
accumulation and two planted faults; and the same with gradients synchronised
every micro-step (``sync_every``): each rank's fit-rule peak, and the runner's
checks on a plan whose probe chose it, correct and with the sync planted
deferred to the last micro-step.
"""

from __future__ import annotations

import gc
from dataclasses import replace

import torch

# the same planted faults as under DDP: sync after every micro-step (k reduce-scatter rounds), and no world-size
# factor in the loss weight (FSDP's averaging reduce-scatter then shrinks the gradient)
from torch._subclasses.fake_tensor import FakeTensor

from autotune import api as pipeline
from autotune.devices import get_device
from autotune.planning.planner import make_plan
from autotune.probing.fitrule import fit_rule_work
from autotune.probing.fsdp import Sharding
from autotune.training import distributed
from autotune.training.accumulate import Accumulator
from autotune.workload import load_workload

from ..helpers import fake_groups, transport_keeps_buffers
from .ddp_worker import NoWorldFactor, SyncsEveryMicroStep, checks, with_no_sync


class DefersSync(Accumulator):
    """Fault for a plan that synchronises every micro-step: FSDP's own no_sync() before the last micro-step
    (the right gradient, one reduce-scatter round a step instead of one a micro-step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **with_no_sync(kwargs, None))


def out_of_memory_on_rank_1(limit: int):
    """The gpt loss, but rank 1's real runs above ``limit`` samples run out of memory in the last
    block's forward (FSDP has all-gathered it by then)."""
    from autotune.probes.gpt import loss

    def planted(model, batch):
        last = model.blocks[-1]
        if not getattr(last, "planted", False):
            last.register_forward_pre_hook(oom)
            last.planted = True
        return loss(model, batch)

    def oom(module, args):
        x = args[0]
        if distributed.rank() == 1 and not isinstance(x, FakeTensor) and not x.is_meta and x.shape[0] > limit:
            raise torch.OutOfMemoryError(f"planted: rank 1 has no memory for {x.shape[0]} samples")

    return planted


def live_fsdp_params() -> int:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    gc.collect()
    return sum(isinstance(o, FSDPParam) for o in gc.get_objects())


# the fit rule's batch, each rank's budget, the target, and the most samples rank 1 holds in the probe
BATCH, BUDGET, TARGET, LIMIT = 6, 8_000_000, 19, 5


def case() -> dict:
    """The module docstring's figures, with the settings they were measured at (batch, target, limit)."""
    rank, world = distributed.rank(), distributed.world_size()
    gpt = load_workload("gpt")
    cpu = get_device("cpu", memory_budget=BUDGET)
    rule = Sharding(world, rank, real_group=True)
    _, measured = cpu.measure(fit_rule_work(gpt, BATCH, sharding=rule))
    with transport_keeps_buffers():
        _, kept = cpu.measure(fit_rule_work(gpt, BATCH, sharding=rule), enforce_capacity=False)
    _, every = cpu.measure(fit_rule_work(gpt, BATCH, sharding=replace(rule, sync_every=True)))
    out: dict = {"batch": BATCH, "target": TARGET, "limit": LIMIT,
                 "peaks": distributed.gather_ints(measured.peak_bytes),
                 "peaks_sync_every": distributed.gather_ints(every.peak_bytes),
                 "peaks_transport_keeps": distributed.gather_ints(kept.peak_bytes)}

    # Rank 1 runs out of memory above ``LIMIT`` samples, where rank 0 fits.
    planted = replace(gpt, loss=out_of_memory_on_rank_1(LIMIT))
    probed = pipeline.probe(planted, device=cpu, parallel="fsdp")
    out["probe"] = {"max": distributed.gather_ints(probed.max_micro_batch), "ranks": list(probed.ranks),
                    "real_ooms": distributed.gather_ints(probed.real_ooms),
                    "live_fsdp_params_after": distributed.gather_ints(live_fsdp_params()),
                    "fake_groups_after": distributed.gather_ints(len(fake_groups()))}

    # The plan from that probe (the ranks agreed on rank 1's max), trained on the gpt workload.
    plan = make_plan(TARGET, probed.max_micro_batch, world_size=world, probe=probed)
    out["schedule"] = [list(r) for r in plan.schedule]
    out["parallel"] = plan.parallel
    out.update(checks(plan, gpt, cpu, 2, {"syncs_every_micro_step": SyncsEveryMicroStep,
                                          "no_world_factor": NoWorldFactor}))
    every_plan = make_plan(TARGET, probed.max_micro_batch, world_size=world, probe=replace(probed, fsdp_sync="every"))
    out["sync_every"] = checks(every_plan, gpt, cpu, 2, {"defers_sync": DefersSync})
    return out
