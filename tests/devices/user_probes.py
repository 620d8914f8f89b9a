"""Probe files as a user writes them, for the tests of what the estimate tells about the user's own code (frames
in a memory snapshot, CUDA's autocast in the user's forward)."""

from __future__ import annotations

from pathlib import Path


def user_probe(path: Path, forward: str) -> Path:
    """A probe file of the user's: a Linear(32, 64) as ``self.layer``, and ``forward`` (lines 7 on) as the
    body of the model's own forward (of ``x``)."""
    path.write_text(
        "import torch, autotune\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.layer = torch.nn.Linear(32, 64)\n"
        "    def forward(self, x):\n"
        + "".join(f"        {line}\n" for line in forward.splitlines()) +
        "def build():\n"
        f"    return autotune.Workload(name={path.stem!r}, model=Net,\n"
        "        batch=lambda n, g: torch.randn(n, 32, generator=g), loss=lambda m, b: m(b).float().pow(2).mean(),\n"
        "        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))\n")
    return path
