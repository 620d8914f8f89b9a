"""``autotune devices``: what memory this machine offers."""

from __future__ import annotations

import json

from ..units import format_bytes
from .common import Formatter, add_common

EXAMPLES = """\
examples:
  autotune devices
  autotune devices --json
  autotune devices --presets     # the GPUs --device estimate:NAME stands in for
"""


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="list the CPU and every GPU with their memory", description=EXAMPLES,
                       formatter_class=Formatter)
    p.add_argument("--presets", action="store_true",
                   help="list the GPUs an estimate can stand in for by name (--device estimate:NAME)")
    add_common(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    if args.presets:
        return presets(args)
    from ..devices import list_devices

    info = list_devices()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    cpu = info["cpu"]
    print(f"cpu      {cpu['cpu_count']} cores, RAM {format_bytes(cpu['ram_total_bytes'])} total, "
          f"{format_bytes(cpu['ram_available_bytes'])} available")
    for gpu in info["gpus"]:
        others = gpu.get("other_processes_bytes")
        other = f", {format_bytes(others)} used by other processes" if others is not None else ""
        print(f"cuda:{gpu['index']:<3} {gpu['name']}: {format_bytes(gpu['total_bytes'])} total, "
              f"{format_bytes(gpu['free_bytes'])} free{other}")
    if info.get("driver"):
        print(f"driver   {info['driver']}")
    for note in info["notes"]:
        print(f"note: {note}")
    print(f"torch    {info['torch']}")
    return 0


def presets(args) -> int:
    """The GPU presets: memory as NVML reports it, compute capability, the allowance assumed."""
    from ..devices.presets import PRESETS

    if args.json:
        print(json.dumps([{"name": p.name, "model": p.model, "total_bytes": p.total_bytes,
                           "compute_capability": p.sm, "allowance_bytes": p.allowance_bytes} for p in PRESETS],
                         indent=2))
        return 0
    width = max(len(p.name) for p in PRESETS)
    print(f"{'preset':<{width}}  {'NVML memory':>22}  {'compute':>7}  {'allowance':>9}  model")
    for p in PRESETS:
        memory = f"{p.total_bytes // 2**20} MiB ({format_bytes(p.total_bytes)})"
        print(f"{p.name:<{width}}  {memory:>22}  {p.sm:>7}  {format_bytes(p.allowance_bytes):>9}  {p.model}")
    print("use: --device estimate:NAME (--memory-budget replaces its memory); the allowance is memory assumed "
          "taken by the CUDA context and libraries, outside PyTorch's allocator")
    return 0
