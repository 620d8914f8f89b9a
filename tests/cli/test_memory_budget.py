"""A CPU --memory-budget must be memory this machine has."""

from __future__ import annotations

import pytest

from autotune.cli import main
from autotune.devices import get_device
from autotune.devices.cpu import ram_bytes
from autotune.errors import BadInput
from autotune.units import format_bytes


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_cpu_budget_above_the_ram_is_refused_naming_both(capsys, device):
    total = ram_bytes()[0]
    if device == "auto" and get_device("auto").name != "cpu":
        pytest.skip("auto is a GPU on this machine")
    code = main(["probe", "--probe", "mlp", "--device", device, "--memory-budget", str(total + 1), "--quiet"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1
    assert format_bytes(total + 1) in lines[0] and f"{format_bytes(total)} of RAM" in lines[0]
    assert "--device estimate" in lines[0]  # the fix for planning a bigger machine


def test_a_cpu_budget_within_the_ram_is_taken():
    assert get_device("cpu", memory_budget=ram_bytes()[0]).capacity_bytes() == ram_bytes()[0]
    with pytest.raises(BadInput, match="of RAM"):
        get_device("cpu", memory_budget=ram_bytes()[0] + 1)
