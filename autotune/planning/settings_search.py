"""The settings search's arithmetic: which settings to try, the time model of an optimizer step, the ranking.

Settings that do not change what is computed are tried by default: DDP, and with several ranks FSDP
(``fully_shard``) with its gradient sync after every micro-step or at the last one; on any number of ranks,
FSDP syncing every micro-step with CPU offload (FSDP2's ``CPUOffloadPolicy``: shards and optimizer on the
host); activation checkpointing of none, every one, or every 2nd of the model's repeated blocks; on a GPU by
estimate, the allocator
setting that fits most (tried on the best of the others: it changes no time, only the max micro-batch).
Settings that change the numbers (``bf16-mixed``, ``bf16`` weights, ``lora``) join only when allowed.

The time model of one optimizer step of a rank (``k`` micro-steps at micro-batch ``b``), stated:

    step = k x (micro + fsdp_gathers + fsdp_scatter_every) + sync_once + offload_copies + optimizer

- ``micro``: the roofline time of one micro-step at ``b`` (:mod:`autotune.devices.roofline`: FLOPs at the
  device's peak or bytes at its memory bandwidth, whichever is longer), counted on the model as the setting
  runs it, so checkpointing's recomputed forwards are counted, and autocast's half-precision FLOPs run at
  the tensor-core rate; every micro-step is taken at ``b``, the largest (a bound for an uneven plan);
  plus the fixed costs of a micro-step, whatever ``b`` is: each op's launch and dispatch (``ops x per_op``:
  ``LAUNCH`` on a GPU; on the CPU, measured on a small training step), and each checkpointed block's own
  work beside its ops (``regions x per_region``: ``torch.utils.checkpoint``'s frame, its saved-tensor hooks,
  the start of the recompute; measured on the CPU, where the host is the device; 0 on a GPU, whose host runs
  it ahead of the kernels). So of two plans with the same FLOPs, the one with fewer micro-steps is faster;
- FSDP: each micro-step all-gathers the parameters twice (forward, and backward after the forward's reshard),
  ``2 x (W-1)/W x parameter bytes``, and reduce-scatters the gradients, ``(W-1)/W x gradient bytes``, after
  every micro-step or once a step, over the link of one GPU (``LINKS``; the CPU: its memory bandwidth);
- DDP over ``W > 1`` ranks: one all-reduce a step (micro-steps before the last run in ``no_sync``),
  ``2 x (W-1)/W x gradient bytes``;
- offload (FSDP's CPU offload): each all-gather first copies the rank's parameter shard to the device,
  ``2 x parameter bytes / W`` a micro-step, and each reduce-scatter copies its gradient shard to the host,
  ``gradient bytes / W``, over the GPU's PCIe link to the host (``HOST_LINKS``);
- optimizer: an Adam step reads parameter, gradient and two moments and writes three, ``7 x`` the trainable
  parameter bytes of the rank's shard, at the memory bandwidth; under offload it runs on the host, whose CPU
  steps every rank's shard (one host serves the ranks of a node), ``trainable parameters / HOST_ADAM``.

Nothing overlaps in the model (collectives do overlap compute in practice, so FSDP's and DDP's costs are an
upper bound); kernels below their peak are left out. It ranks settings on the same work;
it is not meant to predict seconds. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from itertools import combinations

from ..results.search import SettingRow, TrainSetting
from ..units import format_bytes

#: The bandwidth of one GPU's link to its peers, one direction, bytes/s: NVLink where the GPU has it (SXM
#: parts, as the presets name), else PCIe (Gen4 x16: 32 GB/s, Gen5: 64 GB/s; T4 Gen3: 16 GB/s).
LINKS = {"H100-80GB": 450e9, "H200-141GB": 450e9, "A100-80GB": 300e9, "A100-40GB": 300e9,
         "A10G-24GB": 32e9, "L4-24GB": 32e9, "L40S-48GB": 32e9, "T4-16GB": 16e9, "RTX3090-24GB": 32e9,
         "RTX4090-24GB": 32e9, "RTX5090-32GB": 64e9}
#: The bandwidth of one GPU's PCIe link to the host, one direction, effective bytes/s (FSDP's CPU offload copies
#: over it): about 80% of the link's rate, as NVIDIA's bandwidthTest reports for pinned host memory (Gen5 x16
#: 63 GB/s -> ~50; Gen4 x16 31.5 GB/s -> ~25; Gen3 x16 15.8 GB/s -> ~12). The SXM parts (H100, H200, A100) reach
#: the host over PCIe too: NVLink joins only the GPUs.
HOST_LINKS = {"H100-80GB": 50e9, "H200-141GB": 50e9, "A100-80GB": 25e9, "A100-40GB": 25e9, "A10G-24GB": 25e9,
              "L4-24GB": 25e9, "L40S-48GB": 25e9, "T4-16GB": 12e9, "RTX3090-24GB": 25e9, "RTX4090-24GB": 25e9,
              "RTX5090-32GB": 50e9}
#: Parameters a second the host's CPU steps with Adam under offload (torch.optim.AdamW on the CPU): a stated round
#: figure, not a measurement: 28 bytes a parameter (fp32 parameter, gradient, two moments read; three written) at
#: the ~30 GB/s a server's host memory gives one optimizer over its threads.
HOST_ADAM = 1e9
#: Repeated blocks checkpointed: every one, and every 2nd (only where there are at least this many blocks).
EVERY_NTH = 2
MIN_BLOCKS_FOR_NTH = 4
#: Seconds a GPU op costs beyond its roofline: a kernel launch and PyTorch's dispatch, typically 5-10 us.
LAUNCH = 5e-6
#: Allocator settings tried on the best setting, on a GPU by estimate.
ALLOCATOR = ("expandable_segments:True",)
#: Bytes an Adam step moves per trainable parameter byte (read parameter, gradient, two moments; write three).
ADAM_PASSES = 7


@dataclass(frozen=True, kw_only=True)
class Rank:
    """What the time model knows of one rank's device: memory bandwidth, link bandwidth to its peers and to the
    host (``host_link``), bytes/s, the host's Adam throughput (``host_adam``, parameters/s), and the seconds each
    op costs beyond its roofline (a kernel launch and PyTorch's dispatch: ``LAUNCH`` on a GPU) and each checkpointed
    block beyond its ops (``per_region``)."""

    bandwidth: float
    link: float
    host_link: float = 25e9
    host_adam: float = HOST_ADAM
    per_op: float = 0.0
    per_region: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Work:
    """What one setting's rank computes: the roofline seconds of one micro-step at ``micro_batch``, the micro-steps
    a step, the model's parameter bytes (all of them) and trainable ones (what has gradients), how many
    trainable parameters there are, and what a micro-step costs whatever its size: the ops it runs (``ops``,
    recomputed ones included) and the checkpointed blocks it runs (``regions``)."""

    micro_seconds: float
    micro_batch: int
    steps: int
    param_bytes: int
    trainable_bytes: int
    trainable_count: int = 0
    ops: int = 0
    regions: int = 0


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """One optimizer step by the time model, in its parts (seconds): ``host``, offload's copies over PCIe."""

    compute: float
    communication: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.optimizer + self.host


def candidates(world_size: int, blocks: str | None, count: int, allow: Iterable[str] = (), *,
               offload: bool = True) -> list[TrainSetting]:
    """Every setting to estimate: parallel x checkpointing x each subset of the ``allow``-ed changes (simplest
    first, so a tie goes to the simpler one); ``blocks``: the repeated blocks' pattern, ``count`` how many;
    ``offload``: FSDP's CPU offload is tried (a GPU's: on the CPU the host is the device, nothing to move)."""
    parallel = [TrainSetting()]
    if world_size > 1:
        parallel += [TrainSetting(parallel="fsdp", fsdp_sync=s) for s in ("last", "every")]
    if offload:  # syncing at the last micro-step only would hold the whole unsharded gradient on the device
        parallel.append(TrainSetting(parallel="fsdp", fsdp_sync="every", offload=True))
    every = [0] + ([1] if blocks else []) + ([EVERY_NTH] if blocks and count >= MIN_BLOCKS_FOR_NTH else [])
    allowed = tuple(allow)
    subsets = [c for n in range(len(allowed) + 1) for c in combinations(allowed, n) if _compatible(c)]
    return [replace(p, blocks=blocks if e else None, checkpoint_every=e, changes=c)
            for c in subsets for e in every for p in parallel]


def _compatible(changes: tuple[str, ...]) -> bool:
    """bf16 weights and bf16-mixed (autocast over fp32 weights) are two ways to one thing: not both."""
    return not {"bf16", "bf16-mixed"} <= set(changes)


def step_time(setting: TrainSetting, work: Work, rank: Rank, world_size: int) -> StepTime:
    """One optimizer step of ``setting`` by the time model (see the module)."""
    ring = (world_size - 1) / world_size
    gathers = scatter_every = once = 0.0
    if setting.parallel == "fsdp" and world_size > 1:
        gathers = 2 * ring * work.param_bytes / rank.link
        scatter = ring * work.trainable_bytes / rank.link
        scatter_every, once = (scatter, 0.0) if setting.fsdp_sync == "every" else (0.0, scatter)
    elif world_size > 1:
        once = 2 * ring * work.trainable_bytes / rank.link
    shard = world_size if setting.parallel == "fsdp" else 1
    optimizer = ADAM_PASSES * work.trainable_bytes / shard / rank.bandwidth
    host = 0.0
    if setting.offload:
        copies_in = 2 * work.param_bytes / world_size / rank.host_link
        copy_out = work.trainable_bytes / world_size / rank.host_link
        host = work.steps * (copies_in + (copy_out if setting.fsdp_sync == "every" else 0.0)) + \
            (0.0 if setting.fsdp_sync == "every" else copy_out)
        optimizer = work.trainable_count / rank.host_adam
    micro = work.micro_seconds + work.ops * rank.per_op + work.regions * rank.per_region
    return StepTime(compute=work.steps * micro,
                    communication=work.steps * (gathers + scatter_every) + once, optimizer=optimizer, host=host)


def ranked(rows: Iterable[SettingRow], times: dict[int, StepTime] | None = None) -> list[SettingRow]:
    """``rows`` best first (fits, then samples per second; the earlier, simpler one on a tie), each with why it won
    or lost; ``times``: each row's step time by its index in ``rows``, for the reasons."""
    given = list(rows)
    times = times or {}
    order = sorted(range(len(given)), key=lambda i: (not given[i].fits, -given[i].samples_per_second, i))
    best = given[order[0]]
    out = []
    for place, i in enumerate(order):
        row = given[i]
        if not row.fits:
            why = row.why or "does not fit a micro-batch of 1"
        elif place == 0:
            why = f"fastest by the time model: {row.samples_per_second:.4g} samples/s" + _only(row, given)
        else:
            why = _slower(row, best, times.get(i), times.get(order[0]))
            if row.setting.offload:
                why += f"; offload trades speed for memory (max micro-batch {row.max_micro_batch} here)"
        out.append(replace(row, why=why))
    return out


def _only(best: SettingRow, rows: list[SettingRow]) -> str:
    """What the winner is alone in: fitting at all, or fitting with CPU offload (which wins where nothing else fits)."""
    others = [r for r in rows if r is not best]
    if others and not any(r.fits for r in others):
        return "; the only setting that fits"
    if best.setting.offload and any(not r.setting.offload for r in others) and \
            not any(r.fits for r in others if not r.setting.offload):
        return "; nothing fits without CPU offload"
    return ""


def _slower(row: SettingRow, best: SettingRow, mine: StepTime | None, theirs: StepTime | None) -> str:
    """Why ``row`` lost to ``best``: by how much, and the part of the step that costs it most."""
    slower = best.samples_per_second / row.samples_per_second - 1 if row.samples_per_second else float("inf")
    text = f"slower by {slower:.0%}"
    if mine is None or theirs is None:
        return text
    parts = {"compute": mine.compute - theirs.compute, "communication": mine.communication - theirs.communication,
             "the optimizer step": mine.optimizer - theirs.optimizer,
             "copies to and from the host": mine.host - theirs.host}
    what, extra = max(parts.items(), key=lambda kv: kv[1])
    if extra <= 0:
        return text
    detail = f"{row.accumulation_steps} micro-steps of {row.micro_batch} vs {best.accumulation_steps} of " \
        f"{best.micro_batch}" if what == "compute" else "over PCIe" if what.startswith("copies") else \
        "on the host's CPU" if mine.host and what == "the optimizer step" else "collectives over the link"
    return f"{text}: {what} +{extra * 1e3:.3g} ms a step ({detail})"


def table(rows: list[SettingRow], seconds: float | None = None) -> list[str]:
    """The ranked settings as lines for people (``rows`` best first); ``seconds``: what the search took."""
    head = f"{'#':>2}  {'setting':<46} {'max mb':>6} {'plan':>9} {'peak':>10} {'samples/s':>10}  why"
    lines = [f"settings searched: {len(rows)}" + (f" in {seconds:.1f} s" if seconds is not None else ""), head]
    for i, r in enumerate(rows, 1):
        plan = f"{r.micro_batch}x{r.accumulation_steps}" if r.fits else "-"
        peak = format_bytes(r.peak_bytes) if r.peak_bytes else "-"
        rate = f"{r.samples_per_second:.4g}" if r.fits else "-"
        if r.measured_samples_per_second is not None:
            rate += f" ({r.measured_samples_per_second:.4g} measured)"
        lines.append(f"{i:>2}  {r.setting.label:<46} {r.max_micro_batch:>6} {plan:>9} {peak:>10} {rate:>10}  {r.why}")
    return lines
