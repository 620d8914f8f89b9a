"""GPUs by name, for estimates of a GPU you don't have: ``--device estimate:H100-80GB``.

No torch here (``autotune devices --presets`` lists them without importing it).

Each preset gives:

- ``total_bytes``: the GPU's memory as NVML reports it (``nvidia-smi``'s
  ``Memory-Usage`` total, ``nvmlDeviceGetMemoryInfo().total``), which is what
  the capacity of ``cuda:N`` starts from on a real device;
- ``capability``: the CUDA compute capability, which decides the kernels the
  estimate stands in for (attention backends, the cuBLAS workspace size);
- ``allowance_bytes``: memory taken off the top for what lives outside
  PyTorch's caching allocator: the CUDA context with its lazily loaded kernels,
  the cuBLAS and cuDNN handles, and what the driver keeps for itself. This is an
  assumption (typical of torch 2.x with CUDA 12 and lazy loading, where a
  fresh process holds 0.4-0.6 GiB after its first kernel); ``bench/gpu_check.sh``
  measures it on a real GPU (NVML's figure for the process minus what the
  allocator reserved).

Sources for the NVML totals (MiB as nvidia-smi prints them):

=============  =========  ====  ===========================================================
preset         NVML MiB   SM    source
=============  =========  ====  ===========================================================
H100-80GB      81559      9.0   modal-labs/modal-client PR 2797; thundergolfer.com/blog/
                                nvidia-gpu-memory-capacity (H100 SXM 80GB HBM3)
H200-141GB     143771     9.0   thundergolfer.com/blog/nvidia-gpu-memory-capacity
A100-80GB      81920      8.0   modal-client PR 2797; NVIDIA/mig-parted issue 31 (A100-SXM4-80GB)
A100-40GB      40960      8.0   modal-client PR 2797 (A100-SXM4-40GB)
A10G-24GB      23028      8.6   modal-client PR 2797 ("A10": the AWS A10G); NVML total
                                24146608128 B in mayooot/detect-gpu issue 3
L4-24GB        23034      8.9   modal-client PR 2797
L40S-48GB      46068      8.9   modal-client PR 2797
T4-16GB        15360      7.5   modal-client PR 2797
RTX3090-24GB   24576      8.6   noonghunna/club-3090 issue 1128 (nvidia-smi output)
RTX4090-24GB   24564      8.9   RLinf/RLinf issue 255 (nvidia-smi output)
RTX5090-32GB   32607      12.0  noonghunna/club-3090 issue 1261 (nvidia-smi output)
=============  =========  ====  ===========================================================

Compute capabilities: NVIDIA's CUDA GPU list (developer.nvidia.com/cuda-gpus).

For the roofline model of a step's time (:mod:`autotune.devices.roofline`), each
preset also gives its peak dense FLOP/s in fp32 (CUDA cores, no TF32: PyTorch's
default for matmuls) and on the tensor cores in bf16/fp16 with fp32
accumulation (what PyTorch runs under autocast), without sparsity, and its
memory bandwidth, from the vendor's datasheet or architecture whitepaper:

=============  ========  ===========  ========  ==================================================
preset         fp32 TF   bf16/fp16 TF TB/s      source
=============  ========  ===========  ========  ==================================================
H100-80GB      67        989.4        3.35      NVIDIA H100 datasheet (SXM5; 1,979 TF with sparsity)
H200-141GB     67        989.4        4.8       NVIDIA H200 datasheet (SXM; 1,979 TF with sparsity)
A100-80GB      19.5      312          2.039     NVIDIA A100 datasheet (SXM4 80GB; 624 with sparsity)
A100-40GB      19.5      312          1.555     NVIDIA A100 datasheet (SXM4 40GB)
A10G-24GB      35        70           0.6       NVIDIA publishes no A10G datasheet: AWS's figures as
                                                baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference
                                                lists them
L4-24GB        30.3      121          0.3       NVIDIA L4 datasheet (242 with sparsity)
L40S-48GB      91.6      362.05       0.864     NVIDIA L40S datasheet (733 with sparsity)
T4-16GB        8.1       65 (fp16)    0.32      NVIDIA T4 datasheet (mixed precision); no bf16 tensor
                                                cores: bf16 counts at the fp32 rate
RTX3090-24GB   35.6      71           0.936     NVIDIA Ampere GA102 whitepaper (fp32 accumulate)
RTX4090-24GB   82.6      165.2        1.008     NVIDIA Ada Lovelace whitepaper (fp32 accumulate)
RTX5090-32GB   104.8     209.5        1.792     NVIDIA RTX Blackwell whitepaper (fp32 accumulate)
=============  ========  ===========  ========  ==================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DeviceError

MiB = 1024**2
TFLOPS = 1e12
TB_S = 1e12

#: Memory outside PyTorch's allocator on a GPU (context, libraries, driver): the assumption every preset
#: and ``--device estimate --memory-budget SIZE`` make unless told otherwise.
CONTEXT_ALLOWANCE = 640 * MiB


@dataclass(frozen=True, kw_only=True)
class GpuPreset:
    """A GPU the estimate can stand in for by name."""

    name: str  # what --device estimate:NAME takes (case-insensitive)
    model: str  # how NVML names the GPU
    total_bytes: int  # NVML's total memory
    capability: tuple[int, int]  # CUDA compute capability (major, minor)
    fp32_flops: float  # peak dense fp32 FLOP/s (CUDA cores, no TF32)
    tensor_flops: float  # peak dense bf16/fp16 tensor-core FLOP/s, fp32 accumulation
    bandwidth: float  # memory bandwidth, bytes/s
    bf16: bool = True  # bf16 runs on the tensor cores (else at the fp32 rate)
    allowance_bytes: int = CONTEXT_ALLOWANCE

    @property
    def sm(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"


PRESETS: tuple[GpuPreset, ...] = (
    GpuPreset(name="H100-80GB", model="NVIDIA H100 80GB HBM3", total_bytes=81559 * MiB, capability=(9, 0),
              fp32_flops=67 * TFLOPS, tensor_flops=989.4 * TFLOPS, bandwidth=3.35 * TB_S),
    GpuPreset(name="H200-141GB", model="NVIDIA H200", total_bytes=143771 * MiB, capability=(9, 0),
              fp32_flops=67 * TFLOPS, tensor_flops=989.4 * TFLOPS, bandwidth=4.8 * TB_S),
    GpuPreset(name="A100-80GB", model="NVIDIA A100-SXM4-80GB", total_bytes=81920 * MiB, capability=(8, 0),
              fp32_flops=19.5 * TFLOPS, tensor_flops=312 * TFLOPS, bandwidth=2.039 * TB_S),
    GpuPreset(name="A100-40GB", model="NVIDIA A100-SXM4-40GB", total_bytes=40960 * MiB, capability=(8, 0),
              fp32_flops=19.5 * TFLOPS, tensor_flops=312 * TFLOPS, bandwidth=1.555 * TB_S),
    GpuPreset(name="A10G-24GB", model="NVIDIA A10G", total_bytes=23028 * MiB, capability=(8, 6),
              fp32_flops=35 * TFLOPS, tensor_flops=70 * TFLOPS, bandwidth=0.6 * TB_S),
    GpuPreset(name="L4-24GB", model="NVIDIA L4", total_bytes=23034 * MiB, capability=(8, 9),
              fp32_flops=30.3 * TFLOPS, tensor_flops=121 * TFLOPS, bandwidth=0.3 * TB_S),
    GpuPreset(name="L40S-48GB", model="NVIDIA L40S", total_bytes=46068 * MiB, capability=(8, 9),
              fp32_flops=91.6 * TFLOPS, tensor_flops=362.05 * TFLOPS, bandwidth=0.864 * TB_S),
    GpuPreset(name="T4-16GB", model="Tesla T4", total_bytes=15360 * MiB, capability=(7, 5),
              fp32_flops=8.1 * TFLOPS, tensor_flops=65 * TFLOPS, bandwidth=0.32 * TB_S, bf16=False),
    GpuPreset(name="RTX3090-24GB", model="NVIDIA GeForce RTX 3090", total_bytes=24576 * MiB, capability=(8, 6),
              fp32_flops=35.6 * TFLOPS, tensor_flops=71 * TFLOPS, bandwidth=0.936 * TB_S),
    GpuPreset(name="RTX4090-24GB", model="NVIDIA GeForce RTX 4090", total_bytes=24564 * MiB, capability=(8, 9),
              fp32_flops=82.6 * TFLOPS, tensor_flops=165.2 * TFLOPS, bandwidth=1.008 * TB_S),
    GpuPreset(name="RTX5090-32GB", model="NVIDIA GeForce RTX 5090", total_bytes=32607 * MiB, capability=(12, 0),
              fp32_flops=104.8 * TFLOPS, tensor_flops=209.5 * TFLOPS, bandwidth=1.792 * TB_S),
)

#: The GPU ``--device estimate --memory-budget SIZE`` stands in for when no preset is named: its kernel
#: choices (compute capability 8.0, as an A100) with the budget as its memory.
DEFAULT_CAPABILITY = (8, 0)


def find_preset(name: str) -> GpuPreset:
    """The preset called ``name`` (case-insensitive; ``-`` and ``_`` alike), or DeviceError listing them."""
    wanted = _key(name)
    for preset in PRESETS:
        if _key(preset.name) == wanted:
            return preset
    raise DeviceError(f"unknown GPU {name!r} for {{device='estimate:GPU'}}", field="device",
                      choices=tuple(p.name for p in PRESETS),
                      fix=f"use one of {', '.join(p.name for p in PRESETS)} (autotune devices --presets lists them), "
                          "or {device='estimate'} with {memory_budget} for any other GPU")


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")
