"""Shared fixtures. Tests run on the CPU; real-GPU tests carry the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch


def _has_gpu() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not item.keywords: it holds folder names too
            item.add_marker(skip)


@pytest.fixture
def mlp():
    from autotune.workload import load_workload

    return load_workload("mlp")


@pytest.fixture
def gpt():
    from autotune.workload import load_workload

    return load_workload("gpt")


def pytest_configure(config):
    # The suite runs many tiny training steps: one intra-op thread avoids OpenMP
    # oversubscription (and its spin-waits) on small or shared machines.
    torch.set_num_threads(1)


def pytest_collection_finish(session):
    # What collection imported (torch, transformers, lightning, ...) lives as long as the run: kept out of
    # the cyclic garbage collector, a full collection (autotune's cleanup after a run, the tests' own) then
    # walks only what the tests made, not a heap of every imported module.
    import gc

    gc.collect()
    gc.freeze()
