"""DDP vs FSDP: the largest micro-batch per rank on one budget, and the 1B model sharded 1, 8 and 64 ways.

    python bench/fsdp.py               # both tables (~5 min on 2 cores)
    python bench/fsdp.py --only gpt    # the first table: real CPU runs of the built-in gpt
    python bench/fsdp.py --only 1b     # the second: estimates of gpt:build_1b on an 80 GiB GPU

Table 1: the built-in gpt (0.13M parameters) probed on the CPU (estimate, then
confirmed by real runs under the emulated budget) as DDP and as FSDP over 2 and
4 ranks, at budgets from where model state is most of the memory to where
activations are. Each row: the max micro-batch per rank, the share of the DDP
peak that is model state (parameters, gradients, optimizer state, DDP's
buckets), and FSDP's gain. Under FSDP with accumulation every rank keeps the
whole gradient, unsharded, until the last micro-step synchronises: only the
parameters and the optimizer state shrink with the world size.

Table 2: gpt:build_1b (~1.1B parameters, 1024 tokens) estimated for an 80 GiB
CUDA GPU: DDP at 8 ranks, FSDP at 1, 8 and 64 ranks. Each row: the peak per
rank at the max micro-batch, where it goes, the max micro-batch, and the
seconds the estimate-only probe took (under FakeTensorMode for FSDP).
"""

from __future__ import annotations

import argparse
import time

from common import machine

from autotune import api
from autotune.units import format_bytes

BUDGETS = ("5MB", "8MB", "16MB", "48MB")
STATE = ("parameters", "gradients", "optimizer_state")


def model_state(result) -> int:
    """Bytes of model state at the peak: parameters, gradients, optimizer state, and under DDP its
    gradient buckets (one more copy of the parameters' bytes, which the breakdown counts as activations)."""
    state = sum(result.breakdown.get(k, 0) for k in STATE)
    return state + (result.breakdown.get("parameters", 0) if result.data_parallel else 0)


def gpt_table() -> None:
    print("\n## the built-in gpt on the CPU (real runs under the emulated budget), max micro-batch per rank")
    print(f"{'budget':>7} {'DDP x2':>7} {'state share':>11} {'FSDP x2':>8} {'FSDP x4':>8} {'gain x2':>8} "
          f"{'gain x4':>8} {'seconds':>8}")
    for budget in BUDGETS:
        begin = time.perf_counter()
        ddp = api.probe("gpt", device="cpu", memory_budget=budget, world_size=2)
        two, four = (api.probe("gpt", device="cpu", memory_budget=budget, parallel="fsdp", world_size=w)
                     for w in (2, 4))
        share = model_state(ddp) / ddp.peak_bytes
        print(f"{budget:>7} {ddp.max_micro_batch:>7} {share:>11.0%} {two.max_micro_batch:>8} "
              f"{four.max_micro_batch:>8} {two.max_micro_batch / ddp.max_micro_batch:>7.2f}x "
              f"{four.max_micro_batch / ddp.max_micro_batch:>7.2f}x {time.perf_counter() - begin:>8.1f}")


def one_b_table() -> None:
    print("\n## gpt:build_1b on an 80 GiB GPU, estimated (usable 71.4 GiB after the CUDA context and the margin)")
    print(f"{'how':>9} {'max micro-batch':>15} {'peak per rank':>13} {'model state':>11} {'the rest':>11} "
          f"{'seconds':>8}")
    rows = [("ddp", 8), ("fsdp", 1), ("fsdp", 8), ("fsdp", 64)]
    for parallel, world in rows:
        begin = time.perf_counter()
        result = api.probe("gpt:build_1b", device="estimate", memory_budget="80GiB", parallel=parallel,
                           world_size=world)
        seconds = time.perf_counter() - begin
        state = model_state(result)
        print(f"{parallel + ' x' + str(world):>9} {result.max_micro_batch:>15} {format_bytes(result.peak_bytes):>13} "
              f"{format_bytes(state):>11} {format_bytes(result.peak_bytes - state):>11} {seconds:>8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("gpt", "1b"), default=None, help="one of the two tables")
    args = parser.parse_args()
    print(machine())
    if args.only in (None, "gpt"):
        gpt_table()
    if args.only in (None, "1b"):
        one_b_table()


if __name__ == "__main__":
    main()
