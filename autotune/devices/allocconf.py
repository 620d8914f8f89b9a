"""The allocator settings (``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``) and the size rules of CUDA's
caching allocator.

A pure-Python reading of PyTorch's ``c10/core/AllocatorConfig.{h,cpp}`` (the
keys every accelerator shares), ``c10/cuda/CUDAAllocatorConfig.{h,cpp}`` (the
CUDA keys) and the size functions of ``c10/cuda/CUDACachingAllocator.cpp``
(``round_size``, ``roundup_power2_next_division``, ``get_allocation_size``),
plus ``format_size``, the pretty-printer of the out-of-memory message, and
:func:`conf_from_environment`, the one place the settings are read from the environment.
:mod:`autotune.devices.allocator` builds the allocator on top of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import BadInput

__all__ = [
    "KMIN_BLOCK_SIZE",
    "KMIN_LARGE_ALLOC",
    "KROUND_LARGE",
    "KSMALL_BUFFER",
    "KSMALL_SIZE",
    "MB",
    "SIZE_MAX",
    "CONF_VARIABLES",
    "AllocatorConfig",
    "conf_from_environment",
    "describe_conf",
    "format_size",
    "get_allocation_size",
    "round_size",
    "roundup_power2_next_division",
]

SIZE_MAX = 2**64 - 1  # std::numeric_limits<size_t>::max(): "no limit"
MB = 1024 * 1024
KMIN_BLOCK_SIZE = 512  # every block is a multiple of 512 bytes
KSMALL_SIZE = MB  # requests up to 1 MiB go to the small pool
KSMALL_BUFFER = 2 * MB  # small-pool segments (and small expandable pages)
KMIN_LARGE_ALLOC = 10 * MB  # large requests under 10 MiB share a large_segment_size segment
KROUND_LARGE = 2 * MB  # larger requests get a segment rounded up to 2 MiB
_DEFAULT_LARGE_SEGMENT = 20 * MB  # large_segment_size_mb's default (was kLargeBuffer)
_INTERVALS = 16  # roundup_power2_divisions has one entry per power of two, 1 MiB .. 32 GiB
_INTERVAL_START = 20  # log2(1 MiB)

# Keys the common parser handles, then the ones CUDA's parser knows (torch 2.13).
_COMMON_KEYS = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                "garbage_collection_threshold", "roundup_power2_divisions",
                "expandable_segments", "pinned_use_background_threads")
_CUDA_KEYS = ("backend", "release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
              "release_lock_on_hipmalloc", "pinned_use_hip_host_register",
              "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb",
              "pinned_num_register_threads", "per_process_memory_fraction",
              "pinned_free_catch_all", "throw_on_cudamalloc_oom")
KNOWN_KEYS = _COMMON_KEYS + _CUDA_KEYS

#: The variables torch reads the allocator's settings from, in its order: the first one set wins, even when
#: set to "" (torch 2.13, ``AcceleratorAllocatorConfig::instance`` and ``CUDAAllocatorConfig::instance``).
#: ``PYTORCH_ALLOC_CONF`` is the device-generic name (torch 2.9 on); the CUDA one, older, wins over it.
#: ROCm's ``PYTORCH_HIP_ALLOC_CONF`` is not read: the simulation stands in for a CUDA GPU.
CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def conf_from_environment(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(the allocator settings torch runs with under ``environ`` (default: this process's environment), the
    variable they came from); ``("", None)`` when no variable of :data:`CONF_VARIABLES` is set."""
    env = os.environ if environ is None else environ
    for name in CONF_VARIABLES:
        if name in env:
            return env[name], name
    return "", None


def describe_conf(conf: str, variable: str | None) -> str:
    """The settings and where they came from, for people: ``PYTORCH_ALLOC_CONF=expandable_segments:True``."""
    if variable is not None:
        return f"{variable}={conf}" if conf else f"{variable} set to ''"
    return f"allocator settings {conf!r}" if conf else f"{' and '.join(CONF_VARIABLES)} unset"


def format_size(size: int) -> str:
    """``format_size``: '512 bytes', '1.50 KiB', '20.00 MiB', '1.25 GiB' (two decimals, as C++'s std::fixed)."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= MB:
        return f"{size / 1024:.2f} KiB"
    if size <= 1024 * MB:
        return f"{size / MB:.2f} MiB"
    return f"{size / (1024 * MB):.2f} GiB"


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """The settings that change what the caching allocator reserves. Sizes in bytes.

    ``max_split_size`` and ``SIZE_MAX`` mean "no limit", as in PyTorch.
    ``roundup_power2_divisions`` has 16 entries: entry ``i`` holds the divisions
    for sizes in ``[2**(20+i), 2**(21+i))`` (sizes under 1 MiB use entry 0, sizes
    from 32 GiB up use entry 15); 0 or 1 means "round to 512 bytes only".
    """

    max_split_size: int = SIZE_MAX
    max_non_split_rounding_size: int = _DEFAULT_LARGE_SEGMENT
    large_segment_size: int = _DEFAULT_LARGE_SEGMENT
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    expandable_segments: bool = False
    per_process_memory_fraction: float = 1.0

    @classmethod
    def parse(cls, conf: str) -> AllocatorConfig:
        """Read an allocator settings string (``PYTORCH_CUDA_ALLOC_CONF``'s) the way PyTorch 2.13 does; BadInput
        names what is wrong."""
        if not isinstance(conf, str):
            raise BadInput(f"conf={conf!r} is not allocator settings: pass a string such as "
                           "'expandable_segments:True' ('' for PyTorch's defaults) or an AllocatorConfig")
        return _Parser(conf).config()

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the divisions that apply to a request of ``size`` bytes."""
        index = size.bit_length() - 1 - _INTERVAL_START
        return self.roundup_power2_divisions[min(max(index, 0), _INTERVALS - 1)]


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: ``size`` rounded up to the next of ``divisions`` steps between two
    powers of two."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def round_size(size: int, config: AllocatorConfig) -> int:
    """``round_size``: at least 512 bytes, a multiple of 512, or the next power-of-two division when configured."""
    if size < KMIN_BLOCK_SIZE:
        return KMIN_BLOCK_SIZE
    divisions = config.divisions(size)
    if divisions > 1 and size > KMIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return -(-size // KMIN_BLOCK_SIZE) * KMIN_BLOCK_SIZE


def get_allocation_size(size: int, config: AllocatorConfig) -> int:
    """``get_allocation_size``: the segment cudaMalloc is asked for when no cached block fits a rounded request."""
    if size <= KSMALL_SIZE:
        return KSMALL_BUFFER
    if size < KMIN_LARGE_ALLOC:
        return config.large_segment_size
    return -(-size // KROUND_LARGE) * KROUND_LARGE


def _tokens(conf: str) -> list[str]:
    """``ConfigTokenizer``: keys, values and the separators ``: , [ ]``; whitespace dropped."""
    out: list[str] = []
    word = ""
    for ch in conf:
        if ch in ",:[]":
            if word:
                out.append(word)
                word = ""
            out.append(ch)
        elif not ch.isspace():
            word += ch
    if word:
        out.append(word)
    return out


class _Parser:
    """``AcceleratorAllocatorConfig::parseArgs`` then ``CUDAAllocatorConfig::parseArgs`` on one string."""

    def __init__(self, conf: str):
        self.conf = conf
        self.tok = _tokens(conf)
        self.values: dict[str, object] = {}

    def fail(self, what: str) -> BadInput:
        return BadInput(f"conf {self.conf!r}: {what} (allocator settings syntax: "
                        "key:value pairs separated by commas, e.g. 'expandable_segments:True,max_split_size_mb:128')")

    def at(self, i: int, key: str) -> str:
        if i >= len(self.tok):
            raise self.fail(f"expected a value for {key}")
        return self.tok[i]

    def expect(self, i: int, token: str, key: str) -> None:
        if self.at(i, key) != token:
            raise self.fail(f"expected '{token}' after {key}, got '{self.tok[i]}'")

    def integer(self, i: int, key: str) -> int:
        text = self.at(i, key)
        if not text.isdigit():
            raise self.fail(f"{key} needs a whole number, got '{text}'")
        return int(text)

    def number(self, i: int, key: str) -> float:
        text = self.at(i, key)
        try:
            return float(text)
        except ValueError:
            raise self.fail(f"{key} needs a number, got '{text}'") from None

    def boolean(self, i: int, key: str) -> bool:
        text = self.at(i, key)
        if text not in ("True", "False"):
            raise self.fail(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{text}' (key {key})")
        return text == "True"

    def skip_value(self, i: int, key: str) -> int:
        """``ConfigTokenizer::skipKey``: the index of the value, or of the ']' closing a list value."""
        self.expect(i + 1, ":", key)
        i += 2
        if self.at(i, key) != "[":
            return i
        while i + 1 < len(self.tok) and self.tok[i + 1] != "]":
            i += 1
        if i + 1 >= len(self.tok):
            raise self.fail(f"Expected closing bracket ']' for {key} but reached end of config")
        return i + 1

    def config(self) -> AllocatorConfig:
        tok = self.tok
        large = _DEFAULT_LARGE_SEGMENT
        # large_segment_size_mb first: the minimum of the two *_mb keys below depends on it.
        i = 0
        while i < len(tok):
            if tok[i] == "large_segment_size_mb":
                self.expect(i + 1, ":", tok[i])
                mb = self.integer(i + 2, tok[i])
                if mb <= KMIN_LARGE_ALLOC // MB:
                    raise self.fail("CachingAllocator option large_segment_size_mb must be > "
                                    f"{KMIN_LARGE_ALLOC // MB} MB")
                large = min(mb, SIZE_MAX // MB) * MB
            i += 1
        values: dict[str, object] = {"large_segment_size": large, "max_non_split_rounding_size": large}
        i = 0
        while i < len(tok):
            key = tok[i]
            i = self.key(key, i, values, large)
            if i + 1 < len(tok):
                self.expect(i + 1, ",", key)
                i += 1
            i += 1
        return AllocatorConfig(**values)  # type: ignore[arg-type]

    def key(self, key: str, i: int, values: dict[str, object], large: int) -> int:
        """Parse one ``key:value``; returns the index of its last token."""
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            self.expect(i + 1, ":", key)
            mb = self.integer(i + 2, key)
            if mb < large // MB:
                raise self.fail(f"CachingAllocator option {key} too small, must be >= {large // MB}")
            name = "max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding_size"
            values[name] = min(mb, SIZE_MAX // MB) * MB
            return i + 2
        if key == "garbage_collection_threshold":
            self.expect(i + 1, ":", key)
            value = self.number(i + 2, key)
            if not 0.0 < value < 1.0:
                raise self.fail("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
            values["garbage_collection_threshold"] = value
            return i + 2
        if key == "roundup_power2_divisions":
            return self.divisions(i, values)
        if key == "expandable_segments":
            self.expect(i + 1, ":", key)
            values["expandable_segments"] = self.boolean(i + 2, key)
            return i + 2
        if key == "per_process_memory_fraction":
            self.expect(i + 1, ":", key)
            value = self.number(i + 2, key)
            if not 0.0 <= value <= 1.0:
                raise self.fail("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
            values["per_process_memory_fraction"] = value
            return i + 2
        if key == "backend":
            self.expect(i + 1, ":", key)
            backend = self.at(i + 2, key)
            if backend == "cudaMallocAsync":
                raise self.fail("backend:cudaMallocAsync is CUDA's own pool allocator, which this "
                                "simulation does not model; use backend:native")
            if backend != "native":
                raise self.fail("Unknown allocator backend, options are native and cudaMallocAsync")
            return i + 2
        if key == "throw_on_cudamalloc_oom":
            self.expect(i + 1, ":", key)
            if self.boolean(i + 2, key):
                raise self.fail("throw_on_cudamalloc_oom:True (rejecting requests before cudaMalloc) is "
                                "not simulated; leave it False")
            return i + 2
        if key in ("large_segment_size_mb",):
            return self.skip_value(i, key)  # read in the first pass
        if key in ("pinned_use_background_threads", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
                   "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
                   "graph_capture_record_stream_reuse", "pinned_free_catch_all"):
            self.expect(i + 1, ":", key)
            self.boolean(i + 2, key)  # host-side or locking options: checked, no effect on what is reserved
            return i + 2
        if key in KNOWN_KEYS:
            return self.skip_value(i, key)
        raise self.fail(f"Unrecognized key '{key}' in Accelerator allocator config; "
                        f"known keys: {', '.join(KNOWN_KEYS)}")

    def divisions(self, i: int, values: dict[str, object]) -> int:
        """``parseRoundUpPower2Divisions``: one power of two for all sizes, or ``[MB:divisions,...,>:divisions]``."""
        key = "roundup_power2_divisions"
        self.expect(i + 1, ":", key)
        i += 2
        table = [0] * _INTERVALS
        if self.at(i, key) != "[":
            value = self.integer(i, key)
            if value == 0 or value & (value - 1):
                raise self.fail("For roundups, the divisions has to be power of 2")
            values[key] = (value,) * _INTERVALS
            return i
        first, last = True, 0
        i += 1
        while i < len(self.tok) and self.tok[i] != "]":
            bound = self.tok[i]
            self.expect(i + 1, ":", key)
            value = self.integer(i + 2, key)
            i += 2
            if value and value & (value - 1):
                raise self.fail("For roundups, the divisions has to be power of 2 or 0 to disable roundup")
            if bound == ">":
                table[last + 1:] = [value] * (_INTERVALS - last - 1)
            else:
                mb = self.integer(i - 2, key)
                if mb == 0 or mb & (mb - 1):
                    raise self.fail("For roundups, the intervals have to be power of 2")
                index = min(mb.bit_length() - 1, _INTERVALS - 1)
                if first:
                    table[:index] = [value] * index
                    first = False
                table[index] = value
                last = index
            if self.at(i + 1, key) != "]":
                self.expect(i + 1, ",", key)
                i += 1
            i += 1
        if i >= len(self.tok):
            raise self.fail("Expected closing bracket ']' in ConfigTokenizer but reached end of config")
        values[key] = tuple(table)
        return i
