"""The allocator settings (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) and the size rules of the
caching-allocator replica.

Expected figures follow PyTorch 2.13's C++ (c10/core/AllocatorConfig.cpp,
c10/cuda/CUDAAllocatorConfig.cpp, c10/cuda/CUDACachingAllocator.cpp); the
function each table mirrors is in its name. The parser is also checked against
PyTorch's own: the CPU build of torch ships the accelerator-wide parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autotune.devices import allocconf
from autotune.devices.allocconf import (
    CONF_VARIABLES,
    AllocatorConfig,
    conf_from_environment,
    format_size,
    get_allocation_size,
    round_size,
    roundup_power2_next_division,
)
from autotune.errors import BadInput

MiB = 2**20
LIST8 = "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"

# round_size(nbytes) under a conf: (id, conf, nbytes, rounded)
ROUND_SIZE = [
    ("512-minimum", "", 1, 512),
    ("exact-512", "", 512, 512),
    ("up-to-512", "", 513, 1024),
    ("1MiB+1", "", MiB + 1, MiB + 512),
    ("div4-not-above-512x4", "roundup_power2_divisions:4", 2048, 2048),
    ("div4-5200", "roundup_power2_divisions:4", 5200, 6144),  # floor 4096, step 1024
    ("div4-power-of-two-kept", "roundup_power2_divisions:4", 64 * MiB, 64 * MiB),
    ("div4-84MiB", "roundup_power2_divisions:4", 84 * MiB, 96 * MiB),
    ("list-div8-84MiB", LIST8, 84 * MiB, 88 * MiB),  # [64 MiB, 128 MiB) has 8 divisions
    ("list-div2-400MiB", LIST8, 400 * MiB, 512 * MiB),  # [256 MiB, 512 MiB) has 2
    ("list-0-disables", "roundup_power2_divisions:[128:1,256:0,512:4]", 281018368, 281018368),
    ("list-div4-520MB", "roundup_power2_divisions:[128:1,256:0,512:4]", 545259520, 640 * MiB),
    ("div1-is-512", "roundup_power2_divisions:1", 1312500, 1312768),
    ("first-entry-fills-below", "roundup_power2_divisions:[256:1,>:4]", 100 * MiB, 100 * MiB),
    ("gt-fills-after-last", "roundup_power2_divisions:[256:1,>:4]", 600 * MiB, 640 * MiB),
    ("gt-leaves-the-last", "roundup_power2_divisions:[256:1,>:4]", 300 * MiB + 512, 300 * MiB + 512),
    ("under-1MiB-uses-entry-0", "roundup_power2_divisions:[1:4]", 5200, 6144),
    ("entry-1-unset", "roundup_power2_divisions:[1:4]", 3 * MiB + 1, 3 * MiB + 512),
]

# get_allocation_size(rounded size): (id, conf, size, segment)
ALLOCATION_SIZE = [
    ("small-512", "", 512, 2 * MiB),
    ("small-1MiB", "", MiB, 2 * MiB),
    ("large-under-10MiB", "", MiB + 512, 20 * MiB),
    ("large-just-under-10MiB", "", 10 * MiB - 512, 20 * MiB),
    ("10MiB-own-segment", "", 10 * MiB, 10 * MiB),
    ("rounded-to-2MiB", "", 10 * MiB + 512, 12 * MiB),
    ("21MiB", "", 21 * MiB, 22 * MiB),
    ("large_segment_size_mb", "large_segment_size_mb:64", 5 * MiB, 64 * MiB),
    ("large_segment_size_mb-not-above-10MiB", "large_segment_size_mb:64", 10 * MiB, 10 * MiB),
]


@pytest.mark.parametrize(("conf", "nbytes", "expected"), [r[1:] for r in ROUND_SIZE], ids=[r[0] for r in ROUND_SIZE])
def test_round_size(conf, nbytes, expected):
    """round_size and roundup_power2_next_division, with roundup_power2_divisions read as
    parseRoundUpPower2Divisions."""
    assert round_size(nbytes, AllocatorConfig.parse(conf)) == expected


@pytest.mark.parametrize(("conf", "size", "expected"), [r[1:] for r in ALLOCATION_SIZE],
                         ids=[r[0] for r in ALLOCATION_SIZE])
def test_get_allocation_size(conf, size, expected):
    """get_allocation_size: 2 MiB small; large_segment_size (20 MiB) under 10 MiB; else 2 MiB multiples."""
    assert get_allocation_size(size, AllocatorConfig.parse(conf)) == expected


def _disagreements(table, function) -> list[str]:
    """The rows of ``table`` (id, conf, size, expected) on which allocconf's ``function`` (looked up now, so that
    a planted fault is the one called) gives another figure."""
    return [name for name, conf, size, want in table
            if getattr(allocconf, function)(size, AllocatorConfig.parse(conf)) != want]


def _wrap(monkeypatch, name, fault):
    """Plant ``fault(real, *args)`` in place of allocconf's ``name``: the real code, called wrongly."""
    real = getattr(allocconf, name)
    monkeypatch.setattr(allocconf, name, lambda *args: fault(real, *args))


#: Faults planted in the real rounding code: each is a rule of PyTorch's round_size got wrong.
ROUND_SIZE_FAULTS = {
    "divisions-ignored": lambda mp: mp.setattr(AllocatorConfig, "divisions", lambda self, size: 1),
    "interval-off-by-one": lambda mp: mp.setattr(allocconf, "_INTERVAL_START", 21),  # [1 MiB, 2 MiB) read as entry -1
    "256-byte-blocks": lambda mp: mp.setattr(allocconf, "KMIN_BLOCK_SIZE", 256),
    "twice-the-divisions": lambda mp: _wrap(mp, "roundup_power2_next_division", lambda real, n, d: real(n, 2 * d)),
}

#: Faults planted in the real segment-size code: each a rule of PyTorch's get_allocation_size got wrong.
ALLOCATION_SIZE_FAULTS = {
    "no-large-segments": lambda mp: mp.setattr(allocconf, "KMIN_LARGE_ALLOC", 0),
    "1MiB-counted-as-large": lambda mp: mp.setattr(allocconf, "KSMALL_SIZE", MiB - 1),
    "large-not-rounded-to-2MiB": lambda mp: mp.setattr(allocconf, "KROUND_LARGE", 512),
    "conf-ignored": lambda mp: _wrap(mp, "get_allocation_size", lambda real, n, cfg: real(n, AllocatorConfig())),
}


def test_the_tables_agree_with_the_code_as_it_is():
    assert _disagreements(ROUND_SIZE, "round_size") == []
    assert _disagreements(ALLOCATION_SIZE, "get_allocation_size") == []


@pytest.mark.parametrize("fault", ROUND_SIZE_FAULTS)
def test_the_round_size_table_catches_a_fault_planted_in_the_code(fault, monkeypatch):
    ROUND_SIZE_FAULTS[fault](monkeypatch)
    assert _disagreements(ROUND_SIZE, "round_size") != []


@pytest.mark.parametrize("fault", ALLOCATION_SIZE_FAULTS)
def test_the_allocation_size_table_catches_a_fault_planted_in_the_code(fault, monkeypatch):
    ALLOCATION_SIZE_FAULTS[fault](monkeypatch)
    assert _disagreements(ALLOCATION_SIZE, "get_allocation_size") != []


def test_roundup_power2_next_division_edges():
    """roundup_power2_next_division: powers of two stay; a step of zero rounds to the next power of two."""
    assert roundup_power2_next_division(1024, 4) == 1024
    assert roundup_power2_next_division(1200, 4) == 1280  # the C++ comment's example
    assert roundup_power2_next_division(3, 4) == 4


@pytest.mark.parametrize(("size", "text"), [
    (0, "0 bytes"), (1024, "1024 bytes"), (1025, "1.00 KiB"), (MiB, "1024.00 KiB"), (MiB + 1, "1.00 MiB"),
    (20 * MiB, "20.00 MiB"), (1024 * MiB, "1024.00 MiB"), (80 * 1024 * MiB, "80.00 GiB"), (1536 * MiB, "1.50 GiB"),
])
def test_format_size(size, text):
    """format_size: bytes up to 1024, then KiB/MiB/GiB with two decimals (limits inclusive)."""
    assert format_size(size) == text


# What parseArgs reads: (id, conf, fields of AllocatorConfig)
PARSED = [
    ("defaults", "", {"max_split_size": 2**64 - 1, "max_non_split_rounding_size": 20 * MiB,
                      "large_segment_size": 20 * MiB, "expandable_segments": False}),
    ("issue-example", ("max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.6,"
     "expandable_segments:True"), {"max_split_size": 128 * MiB, "roundup_power2_divisions": (4,) * 16,
                                  "garbage_collection_threshold": 0.6, "expandable_segments": True}),
    ("list-form", "roundup_power2_divisions:[256:1,512:2,>:4]",
     {"roundup_power2_divisions": (1,) * 9 + (2,) + (4,) * 6}),
    ("large-segment-sets-rounding-limit", "large_segment_size_mb:64",
     {"large_segment_size": 64 * MiB, "max_non_split_rounding_size": 64 * MiB}),
    ("rounding-limit", "max_non_split_rounding_mb:40", {"max_non_split_rounding_size": 40 * MiB}),
    ("whitespace-ignored", " max_split_size_mb : 200 , expandable_segments : False ", {"max_split_size": 200 * MiB}),
    ("fraction", "per_process_memory_fraction:0.5", {"per_process_memory_fraction": 0.5}),
    ("host-options-accepted", ("pinned_use_background_threads:True,release_lock_on_cudamalloc:True,"
     "pinned_num_register_threads:8,backend:native"), {}),
]


@pytest.mark.parametrize(("conf", "fields"), [r[1:] for r in PARSED], ids=[r[0] for r in PARSED])
def test_parse(conf, fields):
    """AcceleratorAllocatorConfig::parseArgs then CUDAAllocatorConfig::parseArgs."""
    cfg = AllocatorConfig.parse(conf)
    assert {k: getattr(cfg, k) for k in fields} == fields


# Strings PyTorch refuses: (id, conf, words of the message)
REFUSED = [
    ("unknown-key", "foo:1", "Unrecognized key 'foo'"),
    ("max-split-below-segment", "max_split_size_mb:19", "max_split_size_mb too small, must be >= 20"),
    ("max-split-below-own-segment", "max_split_size_mb:63,large_segment_size_mb:64", "must be >= 64"),
    ("rounding-limit-small", "max_non_split_rounding_mb:10", "max_non_split_rounding_mb too small"),
    ("segment-not-above-10MB", "large_segment_size_mb:10", "large_segment_size_mb must be > 10 MB"),
    ("gc-threshold-1", "garbage_collection_threshold:1.0", "garbage_collect_threshold is invalid"),
    ("bool-lowercase", "expandable_segments:true", "Expected 'True' or 'False'"),
    ("divisions-not-power-of-2", "roundup_power2_divisions:3", "has to be power of 2"),
    ("list-interval-not-power-of-2", "roundup_power2_divisions:[3:2]", "intervals have to be power of 2"),
    ("list-unclosed", "roundup_power2_divisions:[256:1,512:2", "roundup_power2_divisions"),
    ("missing-value", "max_split_size_mb", "expected a value for max_split_size_mb"),
    ("no-comma", "expandable_segments:True max_split_size_mb:200", "Expected 'True' or 'False'"),
    ("fraction-above-1", "per_process_memory_fraction:1.5", "per_process_memory_fraction is invalid"),
    ("cudaMallocAsync", "backend:cudaMallocAsync", "does not model"),
    ("throw-on-oom", "throw_on_cudamalloc_oom:True", "not simulated"),
]


@pytest.mark.parametrize(("conf", "words"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_parse_refuses(conf, words):
    """Each refusal is a one-line BadInput (a ValueError) that quotes the conf and PyTorch's reason."""
    with pytest.raises(BadInput) as info:
        AllocatorConfig.parse(conf)
    message = str(info.value)
    assert words in message and repr(conf) in message and "\n" not in message
    assert isinstance(info.value, ValueError)


@pytest.fixture
def torch_parser():
    """PyTorch's own AcceleratorAllocatorConfig::parseArgs; restores the defaults it keeps between calls."""
    parse = torch._C._accelerator_setAllocatorSettings
    reset = "large_segment_size_mb:20,expandable_segments:False,pinned_use_background_threads:False"
    parse(reset)
    yield parse
    parse(reset)
    parse("")


@pytest.mark.parametrize("conf", [r[1] for r in PARSED[:6]] + [r[1] for r in REFUSED[1:12]] + [
    "garbage_collection_threshold:0.999", "roundup_power2_divisions:1", "roundup_power2_divisions:[]",
    "roundup_power2_divisions:[>:2]", "roundup_power2_divisions:[256:0]", ("large_segment_size_mb:64,"
    "max_split_size_mb:64"), "max_split_size_mb:200,", "roundup_power2_divisions:[256:3]"])
def test_parser_agrees_with_pytorch(conf, torch_parser):
    """Accepts and refuses what torch 2.13's C++ parser does (keys it shares with CUDA; the CPU build has no
    CUDA hook)."""
    try:
        torch_parser(conf)
        torch_says = None
    except (ValueError, RuntimeError) as exc:
        torch_says = str(exc).splitlines()[0]
    try:
        AllocatorConfig.parse(conf)
        ours = None
    except BadInput as exc:
        ours = str(exc)
    assert (torch_says is None) == (ours is None), (torch_says, ours)
    if torch_says is not None and "INTERNAL ASSERT" not in torch_says:
        assert torch_says.strip() in ours


# -- where the settings come from: (id, environment, (settings, variable)) ---------------------------------------

CUDA, GENERIC = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"
ENVIRONMENTS = [
    ("neither", {}, ("", None)),
    ("the-cuda-name", {CUDA: "max_split_size_mb:30"}, ("max_split_size_mb:30", CUDA)),
    ("the-generic-name", {GENERIC: "max_split_size_mb:40"}, ("max_split_size_mb:40", GENERIC)),
    ("both:-the-cuda-name-wins", {CUDA: "max_split_size_mb:30", GENERIC: "max_split_size_mb:40"},
     ("max_split_size_mb:30", CUDA)),
    ("the-cuda-name-set-empty-still-wins", {CUDA: "", GENERIC: "max_split_size_mb:40"}, ("", CUDA)),
    ("the-generic-name-set-empty", {GENERIC: ""}, ("", GENERIC)),
]


@pytest.mark.parametrize(("env", "expected"), [r[1:] for r in ENVIRONMENTS], ids=[r[0] for r in ENVIRONMENTS])
def test_the_settings_come_from_the_first_variable_set(env, expected):
    assert conf_from_environment({"PATH": "/bin", **env}) == expected


#: One interpreter imports torch (which reads the variables at the first ask for its settings, not at import),
#: then forks a child per environment (argv[1], JSON) that sets it and prints what torch read.
EACH_IN_A_CHILD = """
import json, os, sys
import torch
for env in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        os.environ.update(env)
        print(repr(torch._C._accelerator_getAllocatorSettings()), flush=True)
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
"""


@pytest.mark.slow
def test_torch_reads_the_same_variable():
    """Each environment above, in a process of its own that has not yet asked torch for its settings (torch reads
    the variables once, at the first ask): torch's own settings are the ones conf_from_environment gives."""
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip(f"torch {torch.__version__} cannot say which settings it read")
    base = {k: v for k, v in os.environ.items() if k not in CONF_VARIABLES}
    envs = json.dumps([env for _, env, _ in ENVIRONMENTS])
    done = subprocess.run([sys.executable, "-c", EACH_IN_A_CHILD, envs], env=base, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    torch_read = done.stdout.splitlines()
    assert torch_read == [repr(conf_from_environment({**base, **env})[0]) for _, env, _ in ENVIRONMENTS]
