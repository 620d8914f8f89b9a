"""``autotune devices``: what memory this machine offers."""

from __future__ import annotations

import json

from ..units import format_bytes
from .common import Formatter, add_common

EXAMPLES = """\
examples:
  autotune devices
  autotune devices --json
"""


def add_parser(sub) -> None:
    p = sub.add_parser("devices", help="list the CPU and every GPU with their memory", description=EXAMPLES,
                       formatter_class=Formatter)
    add_common(p)
    p.set_defaults(handler=run)


def run(args) -> int:
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
