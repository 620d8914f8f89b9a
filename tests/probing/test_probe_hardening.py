"""The probe where estimates cannot see everything: real OOMs, sizes with no bound, values that depend on
parameters, errors that merely look like OOMs. It searches on the device, bounded, and says why; what the batch's
values or an upper bound answer, it estimates."""

from __future__ import annotations

import json

import pytest

from autotune.cli import main
from autotune.devices import get_device
from autotune.errors import WorkloadError
from autotune.probing.finder import find_max_micro_batch
from autotune.probing.fitrule import run_trial

from .. import workloads
from ..helpers import true_max


@pytest.mark.slow
def test_a_real_oom_the_estimate_cannot_see_is_searched_and_reported(capsys, tmp_path):
    path = workloads.probe_file(tmp_path, "oomy", "oom_above", 40)
    saved = tmp_path / "probe.json"
    argv = ["probe", "--probe", str(path), "--device", "cpu", "--memory-budget", "1MB", "--quiet", "--output",
            str(saved)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "max micro-batch 40 " in out and "OOM" in out, out + err
    data = json.loads(saved.read_text())
    assert data["max_micro_batch"] == 40 and data["real_ooms"] >= 1
    assert any(t["oom"] and t["peak_bytes"] is None for t in data["trials"])
    assert any("ran out of memory" in n and "far below" in n for n in data["notes"]), data["notes"]
    assert main(["report", str(saved), "--out", str(tmp_path / "rep")]) == 0
    assert "OOM" in (tmp_path / "rep" / "report.md").read_text()


def test_an_error_that_only_says_out_of_memory_is_the_workloads_error_on_the_cpu():
    with pytest.raises(WorkloadError, match=r"failed at micro-batch \d+ \(real run\): RuntimeError: CUDA out of"):
        find_max_micro_batch(workloads.oom_message_above(50), get_device("cpu", memory_budget=1_000_000),
                             max_batch=4096)


@pytest.mark.slow
def test_routing_that_depends_on_parameters_is_estimated_at_its_upper_bound():
    """MoE top-2 routing (nonzero of the router's choice): every token counted in every expert, which over-counts;
    the confirm run and a short search on the device find the answer."""
    w = workloads.moe()
    device = get_device("cpu", memory_budget=2_000_000)
    result = find_max_micro_batch(w, device, max_batch=4096)
    expected, _ = true_max(w, device, result.usable_bytes, 4096)
    assert result.max_micro_batch == expected
    assert any("upper bound" in n and "nonzero" in n and "worst case" in n for n in result.notes), result.notes
    assert result.real_runs <= 4 and result.real_ooms <= 1


@pytest.mark.slow
def test_a_size_with_no_bound_is_searched_on_the_device_with_a_note():
    w = workloads.unbounded_routing()
    device = get_device("cpu", memory_budget=2_000_000)
    result = find_max_micro_batch(w, device, max_batch=4096)
    expected, _ = true_max(w, device, result.usable_bytes, 4096)
    # Up to 2 short, and what the search costs, where samples hold different amounts: test_probe_learning.py.
    assert expected - 2 <= result.max_micro_batch <= expected
    assert any("cannot run this workload" in n and "repeat_interleave" in n and "no bound" in n
               for n in result.notes), result.notes
    assert result.real_runs <= 7 and sum(not t.fits for t in result.trials if t.source == "real") <= 2


@pytest.mark.slow
def test_a_larger_micro_batch_holds_the_samples_of_a_smaller_one_so_routing_memory_grows_with_it():
    """Each token is copied as many times (0 to 3) as the router decides: memory depends on the samples. Drawn from
    one stream for all four micro-steps, the later micro-batches of b + 1 began one sample later than those of b,
    every size drew other tokens, and a size could need tens of KB less than the one below it (the exhaustive
    bisection and the probe then found different sizes whose next one did not fit). Each micro-step seeded on its
    own, b + 1 holds b's samples and one more."""
    w = workloads.unbounded_routing()
    device = get_device("cpu")
    peaks = [run_trial(device, w, b, 2**40, source="real", capacity_guard=False).peak_bytes for b in range(100, 124)]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_a_shape_read_from_the_batch_is_answered_from_its_values():
    """trim_padding cuts its batch at the longest row, a length it reads with .item(): the estimate reads it from
    the batch, exactly, and one real run confirms."""
    w = workloads.trim_padding()
    device = get_device("cpu", memory_budget=8_000_000)
    result = find_max_micro_batch(w, device, max_batch=65536)
    assert result.real_runs <= 2 and result.real_ooms == 0
    assert any("answered 4 reads" in n for n in result.notes), result.notes
    assert not any("not trusted" in n for n in result.notes), result.notes
    answer = result.max_micro_batch
    assert real_fits(w, device, result, answer) and not real_fits(w, device, result, answer + 1)


@pytest.mark.slow
def test_a_shape_read_from_values_that_depend_on_parameters_is_flagged_and_not_trusted():
    w = workloads.gated_length()
    device = get_device("cpu", memory_budget=8_000_000)
    result = find_max_micro_batch(w, device, max_batch=65536)
    expected, _ = true_max(w, device, result.usable_bytes, 256)
    assert abs(result.max_micro_batch - expected) <= 1
    assert any("read values it cannot know (4 reads" in n and "depend on parameters" in n and "not trusted" in n
               for n in result.notes), result.notes
    # Runs 1 and 2 take different steps (the line through their peaks is followed half way); the third shares its
    # steps with 2, and the curve through their timelines goes to the answer.
    assert result.real_runs <= 4 and sum(not t.fits for t in result.trials if t.source == "real") <= 1


def test_real_runs_on_the_cpu_never_take_more_than_the_budget():
    w = workloads.trim_padding()
    device = get_device("cpu", memory_budget=8_000_000)
    result = find_max_micro_batch(w, device, max_batch=65536)
    real = [t for t in result.trials if t.source == "real"]
    assert real and all(t.oom or t.peak_bytes <= device.capacity_bytes() for t in real)


def test_the_estimate_device_says_it_cannot_estimate_a_size_with_no_bound():
    from autotune.errors import AutotuneError

    with pytest.raises(AutotuneError, match=r"cannot estimate .*repeat_interleave.*real device"):
        find_max_micro_batch(workloads.unbounded_routing(), get_device("estimate", memory_budget=2**30), max_batch=64)


@pytest.mark.parametrize("read, what", [
    (False, r"repeat_interleave.*depends on the batch's own values, which the estimate does not know"),
    (True, r"read values it cannot know \(\d+ reads .* of values the estimate does not know, computed from the "
           r"batch or from parameters"),  # their sum, read: from the batch, or from parameters for all it can tell
])
def test_a_size_from_the_batchs_own_values_is_not_blamed_on_parameters(read, what):
    from autotune.errors import AutotuneError

    # The batch (64 MiB at micro-batch 2) is built shape-only, so its node counts are not known: repeat_interleave
    # of them cannot run, and a size read from them is not trusted.
    with pytest.raises(AutotuneError, match=what + r" \(the batch holds 64\.0 MiB, more than the 32\.0 MiB built "
                                              r"for real at each estimate, so it is built shape-only\)") as caught:
        find_max_micro_batch(workloads.large_graph_batch(read=read), get_device("estimate", memory_budget=2**34),
                             max_batch=4)
    assert "depend on parameters" not in str(caught.value)


def test_the_estimate_device_estimates_parameter_routing_at_its_bound_and_says_so():
    result = find_max_micro_batch(workloads.moe(), get_device("estimate", memory_budget=2**30), max_batch=64)
    assert result.max_micro_batch == 64
    assert any("upper bound" in n and "nonzero" in n for n in result.notes), result.notes


def real_fits(workload, device, result, batch: int) -> bool:
    """Does ``batch`` fit for real (from the probe's own real runs when it made one there)?"""
    for t in result.trials:
        if t.source == "real" and t.batch == batch:
            return t.fits
    return run_trial(device, workload, batch, result.usable_bytes, source="real", capacity_guard=False).fits


# A GNN whose graphs are padded to the batch's largest: building a batch of n takes an n x n matrix on the
# host (its device batch is small), so the estimate would climb to the largest size allowed.
PADDED_GRAPHS = '''
import torch
from torch import nn
from autotune import Workload


def batch(n, g):
    scores = torch.rand(n, n, generator=g)  # every graph padded to the batch's largest: n x n on the host
    return torch.randn(n, 8, generator=g), scores.argmax(dim=1), torch.randint(0, 2, (n,), generator=g)


def loss(net, data):
    x, neighbour, y = data
    return nn.functional.cross_entropy(net(x + x[neighbour]), y)


def build():
    return Workload(name="padded_graphs", model=lambda: nn.Linear(8, 2), batch=batch, loss=loss)
'''

# The probe under a hard limit of address space: what this process maps once torch is imported, and MiB more.
UNDER_RLIMIT = '''
import contextlib, io, resource, sys
import torch
from autotune.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the code loaded
    main(["probe", "--probe", "mlp", "--device", "cpu", "--max-batch", "2"])  # before the limit, as a job's is
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (int(sys.argv[1]) << 20),) * 2)
sys.exit(main(sys.argv[2:]))
'''


@pytest.mark.slow
def test_a_batch_the_host_cannot_build_limits_the_probe_and_it_says_so(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "padded_graphs.py").write_text(PADDED_GRAPHS)
    (tmp_path / "limited.py").write_text(UNDER_RLIMIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(tmp_path / "limited.py"), "120", "probe", "--probe",
                           str(tmp_path / "padded_graphs.py"), "--device", "cpu", "--json"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    result = json.loads(done.stdout)
    # The capacity is what the limit leaves, not the machine's RAM; the size is set by the host's memory.
    assert result["capacity_bytes"] <= 120 << 20 and result["limited_by"] == "host_memory"
    assert 1000 < result["max_micro_batch"] < 5100  # an n x n float32 matrix in under 0.8 x 120 MiB
    assert not any("out of memory" in n or "DefaultCPUAllocator" in n for n in result["notes"]), result["notes"]
    note = next(n for n in result["notes"] if "on the host takes" in n)
    assert f"up to micro-batch {result['max_micro_batch']}, the largest whose batch this host can build" in note


def test_a_size_predicted_past_the_hosts_memory_is_refused_before_it_is_built():
    import torch

    from autotune.probing.hostbatch import HostBatches, HostMemory

    built: list[int] = []

    def padded(n: int, g: torch.Generator) -> torch.Tensor:
        built.append(n)
        return torch.zeros(n, n).sum(dim=1)  # n x n float32 on the host, n floats kept

    host = HostBatches(room=lambda: 10 << 20)  # 8 MiB of it for one build: n x n x 4 bytes up to n = 1448
    build = host.builder(padded)
    assert build(100, torch.Generator()).shape == (100,)
    assert host.peaks[100] == 100 * 100 * 4 + 100 * 4
    with pytest.raises(HostMemory, match=r"building micro-batch 1600 on the host takes about 9\.8 MiB, more "
                                         r"than the 8\.0 MiB one batch may take \(80% of what this process can "
                                         r"still take") as caught:
        build(65536, torch.Generator())
    # Climbed by doubling from 100, refused at the first size predicted past the room: none built past it.
    assert built[-4:] == [100, 200, 400, 800] and caught.value.largest == 1447
    assert build(1000, torch.Generator()).shape == (1000,) and built[-1] == 1000


def test_ram_is_bounded_by_the_processes_address_space_limit(tmp_path):
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "
            "from autotune.devices.host import ram_bytes; print(*ram_bytes())")
    total, available = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True).stdout.split())
    assert total == 3 << 30 and 0 < available < 3 << 30
