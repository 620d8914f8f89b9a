"""The settings search on a 7B/8B config: `autotune plan --model DIR --search-settings` on GPU presets.

    python bench/settings_search.py                          # Llama-3.1-8B on A10G-24GB*4 and H100-80GB*8
    python bench/settings_search.py --only A10G --seq 1024 --target 64
    python bench/settings_search.py --model Qwen2.5-7B --allow lora

The config.json of the model (bench/hf_models.py's public values) is written to a temporary folder; each
device runs ``autotune plan --model DIR --dtype bf16-true --seq-len S --target-batch T --device D
--search-settings --json`` in its own process (``OMP_NUM_THREADS=1``) and prints every setting's row (max
micro-batch by the estimate, the plan, the reserved peak, predicted samples/s by the stated time model of
autotune/planning/settings_search.py, why it lost), the setting chosen, and the process's CPU seconds (the
search's own figure is in the plan's notes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

from common import machine
from hf_models import write_configs

from autotune.units import format_bytes

DEVICES = {"A10G": "estimate:A10G-24GB*4", "H100": "estimate:H100-80GB*8"}


def search(model_dir: str, device: str, args: argparse.Namespace) -> tuple[dict | None, str, float]:
    """The plan's JSON (None on failure), the last error line, and the child's CPU seconds."""
    argv = [sys.executable, "-m", "autotune", "plan", "--model", model_dir, "--dtype", "bf16-true", "--seq-len",
            str(args.seq), "--target-batch", str(args.target), "--device", device, "--search-settings", "--json"]
    if args.allow:
        argv += ["--allow", args.allow]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    plan = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    return plan, lines[-1] if lines else f"exit {done.returncode}", cpu


def label(setting: dict) -> str:
    parts = [setting["parallel"] if setting["fsdp_sync"] is None else f"fsdp(sync {setting['fsdp_sync']})"]
    if setting.get("offload"):
        parts.append("offload")
    if setting["checkpoint_every"]:
        parts.append(f"ckpt every {setting['checkpoint_every']}")
    parts += [p for p in (setting["allocator"], *setting["changes"]) if p]
    return " + ".join(parts)


def table(plan: dict) -> list[str]:
    out = ["| # | setting | max mb | plan | peak | samples/s | why |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(plan["settings"], 1):
        fits = r["fits"]
        made = f"{r['micro_batch']}x{r['accumulation_steps']}" if fits else "-"
        peak = format_bytes(r["peak_bytes"]) if r["peak_bytes"] else "-"
        rate = f"{r['samples_per_second']:.3g}" if fits else "-"
        out.append(f"| {i} | {label(r['setting'])} | {r['max_micro_batch']} | {made} | {peak} | {rate} | "
                   f"{r['why'][:140]} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Llama-3.1-8B")
    p.add_argument("--only", default=",".join(DEVICES), help="A10G,H100")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--target", type=int, default=64)
    p.add_argument("--allow", default="")
    args = p.parse_args()
    print(machine())
    with tempfile.TemporaryDirectory() as folder:
        model_dir = write_configs(folder)[args.model]
        for key in args.only.split(","):
            device = DEVICES[key]
            plan, error, cpu = search(model_dir, device, args)
            print(f"\n## {args.model}, seq {args.seq}, target batch {args.target}, {device}: {cpu:.0f} CPU-s")
            if plan is None:
                print(f"failed: {error}")
                continue
            print("\n".join(table(plan)))
            print(f"\nchosen: {label(plan['setting'])}, {plan['micro_batch']} x {plan['accumulation_steps']} "
                  f"steps x {plan['world_size']} ranks")
            print(next((n for n in plan["notes"] if n.startswith("settings search:")), ""))


if __name__ == "__main__":
    main()
