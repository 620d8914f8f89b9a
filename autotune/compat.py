"""Every private PyTorch API autotune uses, in one place, with the torch versions it differs by.

autotune supports torch >= 2.11 (CI runs 2.11.0 and the newest release). What
it needs that torch offers only under a private name (``torch._C``,
``torch.utils._*``, ``torch._subclasses``, ``torch.distributed`` internals,
private attributes of torch's objects) is reached from here and nowhere else,
so that a torch release that moves one breaks one module, and where its
behaviour differs by version the check is here (:data:`TORCH`). This module
only reaches: it installs and registers nothing (the estimate session,
:mod:`autotune.devices.session`, owns every change to torch's global state).

Aten op names that begin with an underscore (``aten._to_copy``) are not here:
they are the operators torch dispatches, which a dispatch mode sees by name.
"""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

__all__ = ["FAKE_TENSOR_ERRORS", "FAKE_TENSOR_LOGGER", "KERNEL_ERRORS", "TORCH", "DataDependentOutputException",
           "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode", "TorchDispatchMode",
           "disable_current_modes", "is_traceable_wrapper_subclass", "is_traceable_wrapper_subclass_type",
           "tree_flatten", "tree_leaves", "tree_map", "unset_fake_temporarily"]


def version(text: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (``2.13.0+cpu`` is ``(2, 13)``)."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(found.group(1)), int(found.group(2))


#: The installed torch's ``(major, minor)``: what the version checks below read.
TORCH = version(torch.__version__)

#: Does the CPU run a packed LSTM whose sequences are all of one length as oneDNN's kernels (torch 2.13 on; before,
#: every packed sequence runs as cells)?
ONEDNN_PACKED_LSTM = TORCH >= (2, 13)

# -- dispatch modes and fake tensors ---------------------------------------------------------------------

#: Inside, ops run on real tensors: no dispatch mode sees them (``torch.utils._python_dispatch``).
disable_current_modes = _disable_current_modes

#: What ``FakeTensorMode`` raises for an op it cannot run on fakes (all RuntimeErrors).
FAKE_TENSOR_ERRORS: tuple[type[Exception], ...] = (DataDependentOutputException, DynamicOutputShapeException,
                                                   UnsupportedOperatorException)

#: The Python types torch's C++ errors come as (``c10::Error`` and its kinds: NotImplementedError and
#: OutOfMemoryError are RuntimeErrors), what a kernel that refuses its inputs raises.
KERNEL_ERRORS: tuple[type[Exception], ...] = (RuntimeError, IndexError, ValueError, TypeError)

#: The logger that reports, with a traceback, the error a fake-tensor kernel raises.
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


def active_fake_mode() -> FakeTensorMode | None:
    """The ``FakeTensorMode`` on this thread's dispatch-mode stack, if any."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


# -- operators, kernels and libraries ---------------------------------------------------------------------

def op_schema(op: Any) -> Any:
    """An ``OpOverload``'s ``FunctionSchema`` (its arguments, returns, alias annotations)."""
    return op._schema


def storage_key(storage: torch.UntypedStorage) -> int:
    """The identity of the C++ storage behind a Python storage object (two wrappers of one storage agree)."""
    return storage._cdata


def aten_library() -> torch.library.Library:
    """A new library of kernels for aten's operators (``IMPL``); :func:`destroy_library` removes them."""
    return torch.library.Library("aten", "IMPL")


def register_kernel(library: torch.library.Library, name: str, kernel: Callable[..., Any], key: str) -> None:
    """Register ``kernel`` for aten's ``name`` under dispatch key ``key`` in ``library``, over any kernel torch
    registered from Python (torch < 2.13 refuses that unless asked: its ``Meta`` kernels of oneDNN's LSTM are
    Python ones); :func:`destroy_library` brings torch's back."""
    with warnings.catch_warnings():  # torch warns once per process that a C++ kernel (autocast's) is overridden
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        library.impl(name, kernel, key, allow_override=True)


def destroy_library(library: torch.library.Library) -> None:
    """Remove every kernel ``library`` registered (no-op when it is gone already)."""
    if library_alive(library):
        library._destroy()


def library_alive(library: torch.library.Library) -> bool:
    """Are ``library``'s kernels still registered?"""
    return library.m is not None


def library_kernels(library: torch.library.Library) -> list[str]:
    """The kernels ``library`` registered, as ``"ns/op.overload/DispatchKey"``."""
    return sorted(library._op_impls)


def python_kernels() -> frozenset[str]:
    """Every kernel registered from Python now, as ``"ns/op.overload/DispatchKey"``."""
    return frozenset(torch.library._impls)


def torch_meta_kernel(op: Any) -> Callable[..., Any]:
    """torch's own Python ``Meta`` kernel of ``op`` (``torch._meta_registrations``)."""
    return op.py_kernels[torch._C.DispatchKey.Meta]


def pack_padded_sequence(data: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[Any, Any]:
    """The aten op behind ``nn.utils.rnn.pack_padded_sequence``: packed rows and ``batch_sizes``."""
    return torch._VF._pack_padded_sequence(data, lengths, batch_first)


def fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """The backend (``SDPBackend`` value) ``scaled_dot_product_attention`` picks for real tensors."""
    return int(torch._fused_sdp_choice(*args, **kwargs))


def sdp_priority_order() -> list[int] | None:
    """``at::globalContext().sDPPriorityOrder()`` as ``SDPBackend`` values, None where torch cannot say."""
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return None if get is None else [int(i) for i in get()]


def mkldnn_half_supported(dtype: torch.dtype) -> bool:
    """Does oneDNN run ``dtype`` (bfloat16 or float16) on this CPU?"""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# -- autograd --------------------------------------------------------------------------------------------

def current_autograd_node() -> Any:
    """The autograd node whose backward runs on this thread now, else None."""
    return torch._C._current_autograd_node()


def node_sequence_nr(node: Any) -> int:
    """The sequence number the forward gave the op that made ``node``."""
    return int(node._sequence_nr())


def next_sequence_nr() -> int:
    """The sequence number the next op recorded by autograd on this thread gets."""
    return int(torch._C._autograd._get_sequence_nr())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass running now ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in one multi-tensor kernel (all on one device)."""
    return list(torch._foreach_norm(tensors))


#: Normalisation layers with per-batch statistics, and dropout layers (their private base classes).
BATCH_NORM: type[torch.nn.Module] = torch.nn.modules.batchnorm._BatchNorm
INSTANCE_NORM: type[torch.nn.Module] = torch.nn.modules.instancenorm._InstanceNorm
DROPOUT: type[torch.nn.Module] = torch.nn.modules.dropout._DropoutNd

#: The module that loads PyTorch's compiler stack (optimizers import it on first use).
COMPILER_MODULE = "torch._dynamo"


def import_compiler() -> None:
    """Import PyTorch's compiler stack now, rather than on the first optimizer step."""
    importlib.import_module(COMPILER_MODULE)


def compiled_module(module: torch.nn.Module) -> bool:
    """Was ``module`` compiled: ``torch.compile(module)`` (an ``OptimizedModule``), ``module.compile()``, or its
    ``forward`` replaced by a compiled function?"""
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    if optimized is not None and isinstance(module, optimized):
        return True
    return getattr(module, "_compiled_call_impl", None) is not None or \
        compiled_function(module.__dict__.get("forward"))


def compiled_function(fn: Any) -> bool:
    """Is ``fn`` a function ``torch.compile`` returned (dynamo's wrapper keeps the original)?"""
    return callable(fn) and hasattr(fn, "_torchdynamo_orig_callable")


def dynamo_counters() -> dict[str, dict[str, int]]:
    """``torch._dynamo.utils.counters``: frames compiled, graphs captured, Inductor's cache hits."""
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def allocator_events(profile: Any) -> list[int]:
    """The CPU allocator's byte counts a ``torch.profiler.profile(profile_memory=True)`` recorded, in time order
    (positive: allocated, negative: freed)."""
    events = [(e.start_ns(), i, e.nbytes()) for i, e in enumerate(profile.profiler.kineto_results.events())
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    return [n for _, _, n in sorted(events)]


# -- CUDA ------------------------------------------------------------------------------------------------

def nvml_device_index(index: int) -> int:
    """NVML's index of CUDA device ``index`` (``CUDA_VISIBLE_DEVICES`` may renumber them)."""
    return int(torch.cuda._get_nvml_device_index(index))


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per handle (a CPU-only build has none)."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def record_memory_history(memory: Any, enabled: str | None, **kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history`` (``memory``: that module, or a fake of it)."""
    memory._record_memory_history(enabled=enabled, **kwargs)


def memory_snapshot(memory: Any) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` (``memory``: that module, or a fake of it)."""
    return memory._snapshot()


# -- torch.distributed -------------------------------------------------------------------------------------

def sequence_number(group: Any) -> Callable[[], int]:
    """A function reading ``group``'s collective sequence number (it grows with every collective)."""
    return group._get_sequence_number_for_group


def fake_process_group(name: str, rank: int, world_size: int, device_types: set[str]) -> Any:
    """A process group of ``world_size`` ranks, this one ``rank``, on c10d's ``FakeProcessGroup`` backend (every
    collective completes at once and moves no data), named ``name`` for ``device_types``; not registered."""
    c10d: Any = torch._C._distributed_c10d
    group = c10d.ProcessGroup(rank, world_size)
    backend = c10d.FakeProcessGroup._create_internal(rank, world_size)
    group._set_default_backend(c10d.ProcessGroup.BackendType.CUSTOM)
    for kind in sorted(device_types):
        group._register_backend(torch.device(kind), c10d.ProcessGroup.BackendType.CUSTOM, backend)
    group._set_group_name(name)
    return group


def register_process_group(name: str, group: Any) -> None:
    """Make ``group`` findable by ``name`` (DTensor's collectives look groups up by name)."""
    c10d: Any = torch._C._distributed_c10d
    c10d._register_process_group(name, group)


def unregister_process_group(name: str) -> None:
    c10d: Any = torch._C._distributed_c10d
    c10d._unregister_process_group(name)


def process_group_registered(name: str) -> bool:
    """Is a process group registered under ``name``?"""
    c10d: Any = torch._C._distributed_c10d
    try:
        c10d._resolve_process_group(name)
    except (RuntimeError, ValueError):
        return False
    return True


def device_mesh_on(group: Any, name: Any, device_type: str, world_size: int, rank: int) -> Any:
    """A one-dimensional DeviceMesh of ``world_size`` ranks over ``group`` (registered as ``name``), seen from
    ``rank``, its dimension named ``autotune_fake``; no backend is initialised and no default group needed."""
    from torch.distributed.device_mesh import DeviceMesh

    with unset_fake_temporarily():
        mesh = DeviceMesh(device_type, torch.arange(world_size), mesh_dim_names=("autotune_fake",),
                          _init_backend=False, _rank=rank)
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    return mesh


_SHARDING_PROP = "torch.distributed.tensor._sharding_prop"


def shape_propagation() -> tuple[type, str]:
    """DTensor's sharding propagator and the name of its method that runs an op on fake global-shape tensors
    (to learn the output's shape), which every dispatch mode sees."""
    module = importlib.import_module(_SHARDING_PROP)
    return module.ShardingPropagator, "_propagate_tensor_meta_non_cached"


def strided_shard_flag() -> tuple[Any, str, Callable[[Any], bool]] | None:
    """DTensor's sharding propagation module, the name of its function that carries ``_StridedShard``'s flag from
    an op's inputs to its strategies (called once per output of a foreach op, each time reading every input), and
    a test of whether an op schema's inputs carry a ``_StridedShard`` at all (without one, that function does
    nothing); None where torch has no such function (torch 2.11 carries no flag)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    owner, name = importlib.import_module(_SHARDING_PROP), "_propagate_use_strided_shard_flag"
    if not hasattr(owner, name):
        return None

    def strided(op_schema: Any) -> bool:
        return any(isinstance(p, _StridedShard) for spec in op_schema.args_spec for p in spec.placements)

    return owner, name, strided


def shape_propagation_patched() -> bool:
    """Is DTensor's shape propagation replaced by a wrapper (one with an ``original``)? False when DTensor was
    never imported (it is not imported to ask)."""
    if _SHARDING_PROP not in sys.modules:
        return False
    owner, method = shape_propagation()
    return hasattr(getattr(owner, method), "original")


def fsdp_param_groups(module: Any) -> tuple[Any, ...]:
    """FSDP2's parameter groups of one ``FSDPModule``: several per module from torch 2.12, at most one before."""
    state = module._get_fsdp_state()
    if TORCH >= (2, 12):
        return tuple(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return () if group is None else (group,)


def unsharded_param(param: Any) -> torch.Tensor | None:
    """An ``FSDPParam``'s unsharded parameter, once it has been made."""
    return getattr(param, "_unsharded_param", None)


def drop_all_gather_result(group: Any) -> None:
    """Forget an FSDP parameter group's all-gather output still waiting to be copied out."""
    group._all_gather_result = None


def fsdp_default_reduce_scatter() -> type:
    """FSDP2's own reduce-scatter, the base class of a counting one."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter


def fsdp_default_all_gather() -> type:
    """FSDP2's own all-gather, the base class of one that runs on copies."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    return DefaultAllGather


#: The FSDP2 modules that look up a device's stream API by the device's type (``_get_device_handle``).
_FSDP_HANDLE_USERS = ("_fsdp_collectives", "_fsdp_init", "_fsdp_param_group", "_fsdp_state")
_FSDP = "torch.distributed.fsdp._fully_shard."


def fsdp_device_lookups() -> list[tuple[Any, str]]:
    """Where FSDP2 finds its device and that device's stream API, and its check that no parameter is left on
    ``meta``: (owner, attribute) pairs, for a session that runs FSDP on ``meta`` tensors."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    places: list[tuple[Any, str]] = [(importlib.import_module(_FSDP + name), "_get_device_handle")
                                     for name in _FSDP_HANDLE_USERS]
    return [*places, (importlib.import_module(_FSDP + "_fully_shard"), "_get_device_from_mesh"),
            (FSDPParamGroup, "_validate_no_meta_params")]


def fsdp_offload_places() -> tuple[tuple[Any, str], tuple[Any, str], tuple[Any, str]]:
    """Where FSDP2's CPU offload copies a unit's parameter shards to the device (``FSDPParam.all_gather_inputs``,
    a property), the function that reduce-scatters and copies the gradient shards to the host (``foreach_reduce``
    as the parameter group calls it), and its check that the shards were made on the CPU: (owner, attribute)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return ((FSDPParam, "all_gather_inputs"), (_fsdp_param_group, "foreach_reduce"),
            (_fsdp_param_group.FSDPParamGroup, "_validate_cpu_offload_params"))


def device_handle(device_type: str) -> Any:
    """The module of a device type's streams and events as DeviceMesh and FSDP2 find it (``torch.cuda``)."""
    from torch.distributed import device_mesh

    return device_mesh._get_device_handle(device_type)


def group_backend(group: Any, device: torch.device) -> Any:
    """The backend object ``group`` runs collectives for ``device`` with (gloo's, NCCL's, ...)."""
    return group._get_backend(device)


def parameter_slots(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """``module``'s own parameters by name, the dict itself: a slot assigned here swaps the parameter in place."""
    return module._parameters


def buffer_slots(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by name, the dict itself."""
    return module._buffers


# -- the CUDA stand-in of an estimate: autocast's dispatch key, the optimizers' device lists ------------------

#: The dispatch key of CUDA's autocast (``DispatchKey::Autocast`` in C++; torch's Python name for it).
AUTOCAST_CUDA = "AutocastCUDA"


def include_autocast_cuda(included: bool) -> None:
    """Add (or take back) CUDA's autocast key to every dispatch on this thread, whatever the tensors' device:
    while ``torch.is_autocast_enabled("cuda")`` (the key is then not excluded), the kernels registered for it
    run on ``meta`` tensors too."""
    torch._C._dispatch_tls_set_dispatch_key_included(torch._C.DispatchKey.AutocastCUDA, included)


def autocast_cuda_included() -> bool:
    """Is CUDA's autocast key added to this thread's dispatches (:func:`include_autocast_cuda`)?"""
    return bool(torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.AutocastCUDA))


def without_autocast_cuda() -> Any:
    """A guard under which CUDA's autocast key is excluded (what its C++ kernels hold while they run the op)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA))


def autocast_cuda_ops() -> frozenset[str]:
    """The aten operators (``name.overload``, ``default`` for none) with a kernel for CUDA's autocast key in the
    installed torch."""
    found = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(name, AUTOCAST_CUDA):
            op = name[len("aten::"):]
            found.add(op if "." in op else f"{op}.default")
    return frozenset(found)


#: Where torch.optim asks which devices have fused, foreach and capturable kernels: (module, function name).
OPTIMIZER_DEVICE_LISTS = (
    ("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices"),
    ("torch.utils._foreach_utils", "_get_foreach_kernels_supported_devices"),
    ("torch.optim.optimizer", "_get_capturable_supported_devices"),
)


def optimizer_device_lists() -> list[tuple[Any, str, Callable[..., list[str]]]]:
    """Every binding of :data:`OPTIMIZER_DEVICE_LISTS` in torch's loaded modules (each optimizer module imports
    them by name): ``(module, attribute, torch's function)``."""
    import torch.optim  # noqa: F401  (every optimizer module loaded)

    originals: dict[str, Callable[..., list[str]]] = {
        name: getattr(importlib.import_module(module), name) for module, name in OPTIMIZER_DEVICE_LISTS}
    found: list[tuple[Any, str, Callable[..., list[str]]]] = []
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith(("torch.optim", "torch.utils._foreach")):
            continue
        for name, original in originals.items():
            bound = vars(module).get(name)
            if bound is original or getattr(bound, "original", None) is original:
                found.append((module, name, original))
    return found


def checkpoint_device_type() -> tuple[Any, str]:
    """Where activation checkpointing reads the device type of its inputs (whose autocast state and random
    state it saves for the recomputation): ``(module, function name)``."""
    return importlib.import_module("torch.utils.checkpoint"), "_infer_device_type"


def nested_internals() -> tuple[Any, Any, type]:
    """torch's nested tensors of jagged layout, inside: (its ``nested_tensor`` module, its ``sdpa`` module, the
    ``NestedTensor`` class)."""
    from torch.nested._internal import nested_tensor, sdpa

    return nested_tensor, sdpa, nested_tensor.NestedTensor


def nested_view_dummy() -> Callable[[], Any] | None:
    """torch's maker of the dummy NJT it passes to every view of values as an NJT; None in a torch with none."""
    try:
        from torch.nested._internal.nested_tensor import _nt_view_dummy
    except ImportError:
        return None
    return _nt_view_dummy
