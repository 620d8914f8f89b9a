"""QLoRA's 4-bit base weights by shape: bitsandbytes' NF4 ``Linear4bit`` stood in for, without bitsandbytes.

``--lora ...,bits=4`` plans what ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=...)``, peft's ``prepare_model_for_kbit_training``
and ``get_peft_model`` make of the model, counted by shape (the estimate never needs the kernels' values):

- every ``nn.Linear`` but the output head holds its weight packed, two 4-bit values a byte (uint8), its
  blocks' absolute maxima quantized again (uint8, one per 64 weights) with their own fp32 maxima (one per
  256 blocks) and a 256-entry fp32 code; bitsandbytes' ``Params4bit``, frozen;
- the rest (embeddings, norms, the head) is cast to fp32, as ``prepare_model_for_kbit_training`` casts every
  fp16/bf16 parameter that is not 4-bit;
- the forward casts the input to the compute dtype, dequantizes the weight to a full-size temporary of the
  dtype it was loaded in (cast to the input's when they differ), multiplies, and returns the output in the
  input's dtype; backward dequantizes again for the input's gradient and saves nothing but the packed weight
  (bitsandbytes' ``MatMul4Bit``).

What is not stood in for: peft's bitsandbytes LoRA layer clones the base output before adding the adapters'
(one transient of a layer's output); the dequantized values (zeros here: a real run trains, its loss stays
finite, but its base weights are not a model's).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

#: Weights a block's absolute maximum covers (bitsandbytes' 4-bit blocksize), and blocks a second-level
#: maximum covers under double quantization.
BLOCK, NESTED_BLOCK = 64, 256


class _MatMul4Bit(torch.autograd.Function):
    """``x @ dequantize(weight).T + bias`` saving nothing but the (already held) packed weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Linear4bit, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.layer = layer
        return nn.functional.linear(x, layer.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return grad @ ctx.layer.dequantized(grad.dtype), None, None


class Linear4bit(nn.Linear):
    """A frozen NF4 linear layer of ``in_features`` x ``out_features`` by its bytes (see the module)."""

    absmax: torch.Tensor

    def __init__(self, linear: nn.Linear, *, compute_dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype, self.quant_dtype = compute_dtype, linear.weight.dtype
        n, device = linear.weight.numel(), linear.weight.device
        self.weight = nn.Parameter(torch.zeros(math.ceil(n / 2), 1, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        blocks = math.ceil(n / BLOCK)
        self.register_buffer("absmax", torch.zeros(blocks, dtype=torch.uint8, device=device))
        self.register_buffer("nested_absmax", torch.zeros(math.ceil(blocks / NESTED_BLOCK), device=device))
        self.register_buffer("nested_code", torch.zeros(256, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(),
                                                                  requires_grad=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as bitsandbytes' ``dequantize_4bit`` makes it (the blocks' maxima first), in ``dtype``."""
        device = self.weight.device
        torch.zeros(self.absmax.numel(), device=device)  # the maxima, dequantized for the kernel, freed after it
        weight = torch.zeros(self.out_features, self.in_features, dtype=self.quant_dtype, device=device)
        return weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return _MatMul4Bit.apply(x.to(self.compute_dtype), self, bias).to(given)


def quantize(model: nn.Module, *, compute_dtype: torch.dtype) -> int:
    """Every ``nn.Linear`` of ``model`` but its output head made :class:`Linear4bit` (in place), then every
    fp16/bf16 parameter left cast to fp32 and all frozen, as peft's ``prepare_model_for_kbit_training``
    does; the number of weights quantized."""
    heads = getattr(model, "get_output_embeddings", None)
    head = heads() if callable(heads) else None
    quantized = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(module, child_name, Linear4bit(child, compute_dtype=compute_dtype))
                quantized += child.weight.numel()
    for param in model.parameters():
        param.requires_grad_(False)
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)
    return quantized
