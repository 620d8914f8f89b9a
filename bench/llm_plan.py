"""LLM-scale plans on the CPU: CPU seconds and peak resident memory of `autotune plan` for 8B and 70B Llamas.

    python bench/llm_plan.py            # every row (~10 min here before the issue-40 work)
    python bench/llm_plan.py --quick    # the 1B GPT and the 8B FSDP row only

Each row runs ``autotune plan --target-batch 512 --format json`` in its own
process (the models are the shapes of ``bench/llama.py``, built on the meta
device: no weight is made) and prints the max micro-batch per rank, the
estimate evaluations the probe made, the process's user+system CPU seconds,
its wall seconds and its peak resident memory (``wait4``'s ``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from common import ROOT, machine

from autotune.units import format_bytes

LLAMA = os.path.join(ROOT, "bench", "llama.py")
ROWS = [  # (name, probe, device, extra arguments, in --quick)
    ("gpt 1B, H100 x1", "gpt:build_1b", "estimate:H100-80GB", [], True),
    ("llama 8B, FSDP, H100 x8", f"{LLAMA}:build_8b", "estimate:H100-80GB*8", ["--parallel", "fsdp"], True),
    ("llama 8B LoRA, H100 x1", f"{LLAMA}:build_8b_lora", "estimate:H100-80GB", [], False),
    ("llama 8B LoRA bf16, H100 x1", f"{LLAMA}:build_8b_lora_bf16", "estimate:H100-80GB", [], False),
    ("llama 70B, FSDP, H100 x64", f"{LLAMA}:build_70b", "estimate:H100-80GB*64", ["--parallel", "fsdp"], False),
]


def run_row(probe: str, device: str, extra: list[str], src: str | None) -> tuple[dict | None, float, float, int, str]:
    """The plan's JSON (None on failure), CPU seconds, wall seconds, peak RSS in bytes, the verbose log."""
    argv = [sys.executable, "-m", "autotune", "plan", "--target-batch", "512", "--probe", probe, "--device", device,
            "--format", "json", "--verbose", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if src:  # another copy of autotune (an older commit's, for a before-and-after), run from its folder
        src = os.path.abspath(src)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(src), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        begin = time.perf_counter()
        child = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=src or ROOT)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage, before Popen reaps it
        child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - begin
        out.seek(0)
        err.seek(0)
        text, log = out.read(), err.read().decode(errors="replace")
    plan = json.loads(text) if child.returncode == 0 and text.strip() else None
    return plan, usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss * 1024, log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 1B GPT and the 8B FSDP row only")
    parser.add_argument("--only", default=None, help="rows whose name contains one of these (comma-separated)")
    parser.add_argument("--src", default=None,
                        help="plan with the autotune package under this folder (e.g. an older commit's: "
                             "git archive COMMIT autotune probes | tar -x -C DIR)")
    args = parser.parse_args()
    print(machine() + (f"; planned with the autotune under {args.src}" if args.src else ""))
    print("## autotune plan --target-batch 512 on the CPU (each row its own process)")
    print(f"{'workload, device':<27} {'max micro-batch':>15} {'evaluations':>11} {'CPU s':>8} {'wall s':>8} "
          f"{'peak RSS':>9}")
    for name, probe, device, extra, quick in ROWS:
        if (args.quick and not quick) or (args.only and not any(w in name for w in args.only.split(","))):
            continue
        plan, cpu, wall, rss, log = run_row(probe, device, extra, args.src)
        if plan is None:
            print(f"{name:<27} failed: {log.strip()[-300:]}")
            continue
        probe_result = plan["probe"]
        # every evaluation of the estimate, those of a probe not chosen (FSDP's sync "auto" probes two) too
        evaluations = len(re.findall(r"^\s*estimate at micro-batch \d+:", log, flags=re.M))
        print(f"{name:<27} {probe_result['max_micro_batch']:>15} {evaluations:>11} {cpu:>8.1f} {wall:>8.1f} "
              f"{format_bytes(rss):>9}", flush=True)


if __name__ == "__main__":
    main()
