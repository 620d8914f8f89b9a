"""One fit-rule evaluation of an LLM-shaped estimate under cProfile: where its CPU seconds go.

    python bench/llm_profile.py --probe bench/llama.py:build_8b --device estimate:H100-80GB --world-size 8 --fsdp
    python bench/llm_profile.py --probe gpt:build_1b --device estimate:H100-80GB
    python bench/llm_profile.py --probe gpt:build_1b --device estimate:H100-80GB --warm --reuse

Builds the device and the workload as ``autotune plan`` does, runs the fit rule once at ``--batch``
(default 2) on the estimate (the meta engine, as the probe does; ``--engine fake``: FakeTensorMode), and prints the CPU
seconds of that evaluation and the top of its profile by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from common import machine

from autotune.devices import get_device
from autotune.probing.fitrule import fit_rule_work, isolate
from autotune.probing.fsdp import Sharding, fake_engine
from autotune.probing.stepreuse import OptimizerSteps
from autotune.workload import load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--probe", default="bench/llama.py:build_8b")
    parser.add_argument("--device", default="estimate:H100-80GB")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true", help="the fit rule of rank 0 of --world-size under FSDP")
    parser.add_argument("--every", action="store_true", help="FSDP's gradient sync after every micro-step")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--engine", choices=("meta", "fake"), default="meta",
                        help="the estimate's engine (FSDP ran under FakeTensorMode only, before issue 40 item 1)")
    parser.add_argument("--warm", action="store_true",
                        help="evaluate once first, unprofiled (torch's caches warm, as at a probe's later sizes)")
    parser.add_argument("--replay", action="store_true",
                        help="evaluate as the probe does a model of identical blocks: through the model cut to 2 "
                             "and 3 of them (autotune.probing.blockreplay), the whole model's trace built from theirs")
    parser.add_argument("--reuse", action="store_true",
                        help="with --warm: the optimizer steps evaluated at the warm-up and made again at --batch, as "
                             "a probe does at its later sizes (autotune.probing.stepreuse)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--output", default=None, help="also write the profile here (for pstats or snakeviz)")
    args = parser.parse_args()
    print(machine())
    workload = isolate(load_workload(args.probe))
    device = get_device(args.device).estimator()
    sharding = Sharding(args.world_size, sync_every=args.every) if args.fsdp else None
    if args.engine == "fake":
        device = fake_engine(device)
    steps = OptimizerSteps() if args.reuse else None
    evaluate = _replayed(device, workload, sharding, steps) if args.replay else \
        (lambda b: device.measure(fit_rule_work(workload, b, sharding=sharding, optimizer_steps=steps),
                                  enforce_capacity=False)[1])
    if args.warm:
        evaluate(args.batch + 1)
    profile = cProfile.Profile(time.process_time)  # CPU seconds: beside other work, wall time says little
    begin = time.process_time()
    profile.enable()
    m = evaluate(args.batch)
    profile.disable()
    seconds = time.process_time() - begin
    print(f"one evaluation at micro-batch {args.batch}: {seconds:.1f} CPU s under cProfile, engine {device.engine}, "
          f"peak {m.peak_bytes / 2**30:.2f} GiB, {len(m.trace)} allocation events")
    if args.output:
        profile.dump_stats(args.output)
    stats = pstats.Stats(profile)
    for key in ("tottime", "cumulative"):
        print(f"\n## by {key}")
        stats.sort_stats(key).print_stats(args.top)


def _replayed(device, workload, sharding, steps):
    import torch

    from autotune.probing.blockreplay import replayed_trial
    from autotune.probing.blocks import identical_blocks

    with device.standing_in(), torch.device("meta"):
        blocks, why = identical_blocks(workload.make_model())
    if blocks is None:
        raise SystemExit(f"no block replay: {why}")

    def evaluate(batch: int):
        done = replayed_trial(device, workload, blocks, batch, 2**62, source="estimate", cuts=(2, 3),
                              sharding=sharding, optimizer_steps=steps)
        if done is None:
            raise SystemExit("the blocks did not replay (their pattern did not rebuild the cut traces)")
        return done.measurement

    return evaluate


if __name__ == "__main__":
    main()
