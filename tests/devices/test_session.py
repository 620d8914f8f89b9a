"""The estimate session: every change to torch's global state made and undone in one place, one measurement at
a time; nothing at import; a leak caught."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.nn.modules import module as nn_module

from autotune import compat
from autotune.devices import session
from autotune.devices.cpu import CpuDevice
from autotune.devices.estimate import EstimateDevice
from autotune.devices.measurement import Measurement
from autotune.devices.recorder import Recorder, record_with
from autotune.devices.session import EstimateSession, LeftBehind, leftovers
from autotune.probing.fitrule import fit_rule_work
from autotune.probing.fsdp import Sharding, fake_engine
from autotune.workload import Workload, load_workload

from ..helpers import fake_groups

GiB = 2**30


def torch_state() -> dict[str, object]:
    """What of torch's process-wide state autotune could change, read from torch itself."""
    return {
        "resize_": torch.UntypedStorage.resize_,
        "resize_ patched": "resize_" in vars(torch.UntypedStorage),
        "python kernels": compat.python_kernels(),
        "module hooks": (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "fake tensor logger disabled": __import__("logging").getLogger(compat.FAKE_TENSOR_LOGGER).disabled,
    }


@pytest.fixture(scope="module")
def gpt() -> Workload:
    return load_workload("gpt")


def slow_start(workload: Workload, events: list[tuple[str, int]]) -> object:
    """The fit rule, noting when it starts and ends (and pausing at the start, so that a second thread tries
    to measure meanwhile)."""
    work = fit_rule_work(workload, 2)

    def run(s):
        events.append(("start", threading.get_ident()))
        time.sleep(0.2)
        work(s)
        events.append(("end", threading.get_ident()))

    return run


@pytest.mark.slow
def test_two_threads_estimating_at_once_get_the_single_thread_answer(gpt):
    """A CPU stand-in and a GPU stand-in at once: each registers its own attention kernel for the same operator,
    which the other would run (the GPU stand-in's timeline came out wrong when they interleaved)."""
    devices = [lambda: EstimateDevice(capacity=GiB, round_to=1, cuda_like=False), lambda: EstimateDevice.for_gpu(GiB)]
    alone = [make().measure(fit_rule_work(gpt, 2))[1] for make in devices]
    events: list[tuple[str, int]] = []
    start = threading.Barrier(2)

    def estimate(i: int) -> tuple[Measurement, str]:
        estimator = devices[i]()
        start.wait()
        return estimator.measure(slow_start(gpt, events))[1], estimator.engine

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(estimate, i) for i in range(2)]
    for i, future in enumerate(futures):
        m, engine = future.result()  # a thread's error is raised here
        assert engine == "meta"
        assert (m.peak_bytes, m.timeline, m.breakdown) == (alone[i].peak_bytes, alone[i].timeline, alone[i].breakdown)
    # One measurement after the other: never interleaved.
    assert [kind for kind, _ in events] == ["start", "end", "start", "end"]
    assert events[0][1] == events[1][1] != events[2][1] == events[3][1]
    assert leftovers() == []


@pytest.mark.slow
def test_after_any_measurement_nothing_of_autotunes_is_left_in_torch(gpt):
    before = torch_state()
    gpu = EstimateDevice.for_gpu(GiB)
    gpu.measure(fit_rule_work(gpt, 2))  # CUDA's kernel choices, the shape rules, the resize watcher
    assert torch_state() == before and leftovers() == []
    record_with(Recorder(), lambda: gpu.measure(fit_rule_work(gpt, 2)))  # the recorder's module hooks
    assert torch_state() == before and leftovers() == []
    cpu_like = EstimateDevice(capacity=GiB, round_to=1, cuda_like=False)
    fsdp = fake_engine(cpu_like)
    fsdp.measure(fit_rule_work(gpt, 2, sharding=Sharding(2)))  # a fake process group, DTensor's shape propagation
    assert torch_state() == before and leftovers() == [] and fake_groups() == []
    lookups = [getattr(owner, name) for owner, name in compat.fsdp_device_lookups()]
    cpu_like.measure(fit_rule_work(gpt, 2, sharding=Sharding(2)))  # FSDP on the meta engine
    assert cpu_like.engine == "meta" and [getattr(owner, name) for owner, name in compat.fsdp_device_lookups()] \
        == lookups
    assert torch_state() == before and leftovers() == [] and fake_groups() == []
    assert not compat.process_group_registered("autotune-fake-2-0-cpu")
    assert not compat.shape_propagation_patched()
    cpu_like.measure(fit_rule_work(gpt, 2))  # the CPU's kernel choices, oneDNN's meta kernels
    CpuDevice(memory_budget=GiB).measure(fit_rule_work(gpt, 2))
    assert torch_state() == before and leftovers() == []


def test_a_measurement_that_raises_leaves_nothing_either():
    before = torch_state()

    def work(s):
        raise KeyError("the user's bug")

    with pytest.raises(KeyError):
        EstimateDevice.for_gpu(GiB).measure(work)
    assert torch_state() == before and leftovers() == []


def test_a_part_that_does_not_undo_itself_is_caught_and_undone(monkeypatch):
    """Plant the leak the session exists to catch: the resize watcher left installed."""
    before = torch_state()
    monkeypatch.setattr(session, "_unwatch_resizes", lambda: None)
    cpu = CpuDevice(memory_budget=GiB)
    with pytest.raises(LeftBehind, match="UntypedStorage.resize_ is patched"):
        cpu.measure(lambda s: torch.zeros(3).untyped_storage().resize_(4))
    monkeypatch.undo()
    assert torch_state() == before and leftovers() == []  # removed when caught


def test_kernels_left_registered_are_caught_and_named(monkeypatch):
    destroy = compat.destroy_library
    monkeypatch.setattr(compat, "destroy_library", lambda library: None)
    with pytest.raises(LeftBehind, match="aten kernels registered: .*aten/scaled_dot_product_attention/AutogradMeta"):
        EstimateDevice.for_gpu(GiB).measure(lambda s: None)
    assert any("aten kernels" in left for left in leftovers())  # the planted bug keeps them: still listed
    monkeypatch.setattr(compat, "destroy_library", destroy)
    session._remove_leftovers()
    assert leftovers() == []


def test_an_error_on_its_way_is_not_replaced_by_the_leak_report(monkeypatch):
    monkeypatch.setattr(session, "_unwatch_resizes", lambda: None)
    with pytest.raises(ValueError, match="the work's own"):
        CpuDevice(memory_budget=GiB).measure(lambda s: (_ for _ in ()).throw(ValueError("the work's own")))
    monkeypatch.undo()
    assert leftovers() == []


def test_sessions_nest_on_one_thread_and_only_the_outermost_checks():
    with EstimateSession(), EstimateSession(quiet=True):
        assert session.active()
        with session.aten_kernels() as library:
            assert compat.library_alive(library)
        assert leftovers() == []
    assert not session.active()


def test_another_thread_waits_for_the_session_to_end():
    entered = threading.Event()
    order: list[str] = []

    def other() -> None:
        entered.wait()
        with EstimateSession():
            order.append("other")

    thread = threading.Thread(target=other)
    thread.start()
    with EstimateSession():
        entered.set()
        time.sleep(0.2)
        order.append("first")
    thread.join()
    assert order == ["first", "other"]


IMPORT_EVERYTHING = """
import importlib, logging, pkgutil, sys
import torch
from torch.nn.modules import module as nn_module

def state():
    ours = {k for k in torch.library._impls if k.startswith("aten/") and
            (k.endswith(("/AutogradMeta", "/AutogradCPU")) or "mkldnn_rnn_layer" in k)}
    return ("resize_" in vars(torch.UntypedStorage), ours, len(nn_module._global_forward_pre_hooks),
            len(nn_module._global_forward_hooks), torch._C._len_torch_dispatch_stack(),
            logging.getLogger("torch._subclasses.fake_tensor").disabled, torch.distributed.is_initialized())

before = state()
import autotune
names = [m.name for m in pkgutil.walk_packages(autotune.__path__, "autotune.")]
for name in names:
    importlib.import_module(name)
after = state()
assert len(names) > 100, names
print("imported:", after == before, (before, after))
from autotune.devices import session
session._watch_resizes()  # then an import-time patch, as the check must catch
planted = state()
print("planted:", planted == before, (before, planted))
"""


@pytest.mark.slow
def test_importing_every_autotune_module_changes_nothing_in_torch():
    """One fresh interpreter imports every module (the state of torch unchanged), then plants a patch as an import
    could (the same check sees it)."""
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, planted = done.stdout.splitlines()
    assert imported.startswith("imported: True "), imported
    assert planted.startswith("planted: False ((False"), planted


def test_a_cuda_stand_in_left_installed_is_caught_and_undone(monkeypatch):
    """Plant the leak: the stand-in's torch.cuda answers and device lists left in place."""
    before = torch_state()
    monkeypatch.setattr(session, "_unpatch", lambda: None)
    with pytest.raises(LeftBehind, match="torch.cuda.is_available is the CUDA stand-in's"):
        EstimateDevice.for_gpu(GiB).measure(lambda s: None)
    monkeypatch.undo()
    assert torch_state() == before and leftovers() == []  # removed when caught
    assert not torch.cuda.is_available()
