"""oneDNN's LSTM on ``meta`` tensors: the kernel the CPU runs an LSTM with, and its workspace.

On the CPU, ``torch.lstm`` hands each layer and direction to oneDNN
(``mkldnn_rnn_layer``, aten/src/ATen/native/mkldnn/RNN.cpp) when
:func:`uses_onednn` holds. In training the kernel returns, besides the output and
the final states, a workspace of bytes that autograd keeps for the backward
(``mkldnn_rnn_layer_backward``). Its size is oneDNN's, computed here by
:func:`lstm_workspace_bytes` as oneDNN computes it, and confirmed against the
real kernel once per layer shape (:func:`confirm_workspace`).

The ``meta`` kernels here stand in for both ops: they allocate what the CPU's
kernels return, with their exact sizes (the backward returns the bias gradient
twice, as two tensors).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..compat import library_alive, mkldnn_half_supported, register_kernel, torch_meta_kernel

LSTM_MODE = 2  # ideep::rnn_kind::LSTM, the ``mode`` argument of mkldnn_rnn_layer
PAGE = 4096  # oneDNN aligns every part of an RNN workspace to a page (rnn_utils.cpp set_offsets)
CHECK_SEQUENCE, CHECK_BATCH = 3, 17  # where the rule is confirmed: a few steps of a batch whose padding shows


def uses_onednn(input: torch.Tensor, hx: Sequence[torch.Tensor]) -> bool:
    """``use_mkldnn`` in aten/src/ATen/native/RNN.cpp for an LSTM whose tensors are all on the CPU, and no
    projections (``lstm`` takes its own path for those): oneDNN enabled, float32 (bfloat16 where the CPU has
    it, float16 in inference where it has that) and a non-empty input."""
    if not torch.backends.mkldnn.is_available() or not torch.backends.mkldnn.enabled:
        return False
    if hx[0].size(2) != hx[1].size(2):
        return False
    dtype = input.dtype
    supported = (dtype == torch.float32
                 or (dtype == torch.bfloat16 and mkldnn_half_supported(dtype))
                 or (dtype == torch.float16 and not torch.is_grad_enabled() and mkldnn_half_supported(dtype)))
    return supported and input.numel() != 0


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _good_ld(dim: int, itemsize: int) -> int:
    """``rnn_utils::get_good_ld``: a leading dimension 64-byte aligned and not a multiple of 256 elements."""
    ld = _round_up(dim, 64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def lstm_workspace_bytes(seq: int, batch: int, input_size: int, hidden_size: int, itemsize: int) -> int:
    """The training workspace of one oneDNN LSTM layer and direction (``n_layer = n_dir = 1``).

    oneDNN 3 (v3.12 in PyTorch 2.13; src/cpu/rnn/rnn_utils.hpp ``set_workspace_sizes``, rnn_utils.cpp
    ``set_offsets``) lays out, each part starting on a 4096-byte page: the gates
    of every step, the hidden states of every step, the layer states and cell
    states of the ``seq + 1`` steps of the input and output layer, and their
    float32 gradients. States and gates are in the input's dtype, gradients in
    float32; leading dimensions are padded by ``get_good_ld``.
    """
    acc = 4  # gemm_acc_t: float32
    states = 2 * (seq + 1) * batch  # (n_layer + 1) * n_dir * (n_iter + 1) * mb
    diff_ld = _good_ld(max(input_size, hidden_size), acc)
    parts = (
        seq * batch * _good_ld(4 * hidden_size, itemsize) * itemsize,  # ws_gates
        seq * batch * _good_ld(hidden_size, itemsize) * itemsize,  # ws_ht
        states * _good_ld(max(input_size, hidden_size), itemsize) * itemsize,  # ws_states_layer (= iter)
        states * hidden_size * itemsize,  # ws_states_iter_c
        states * diff_ld * acc,  # ws_diff_states_layer
        states * diff_ld * acc,  # ws_diff_states_iter
        states * hidden_size * acc,  # ws_diff_states_iter_c
        0,  # ws_grid_comp: linear-before-reset GRU only
    )
    offset = 0
    for size in parts:
        offset = _round_up(offset, PAGE) + size
    return offset


class WorkspaceMismatch(Exception):
    """oneDNN's workspace on this machine is not the one :func:`lstm_workspace_bytes` computes."""


@functools.cache
def confirm_workspace(input_size: int, hidden_size: int, dtype: torch.dtype) -> None:
    """Run the real kernel once for this layer shape (a few steps of a small batch, real weights) and check
    that its workspace is the rule's; raises :class:`WorkspaceMismatch` otherwise. Remembered per shape."""
    seq, batch = CHECK_SEQUENCE, CHECK_BATCH
    rule = lstm_workspace_bytes(seq, batch, input_size, hidden_size, dtype.itemsize)
    real = _real_workspace(seq, batch, input_size, hidden_size, dtype)
    if real != rule:
        raise WorkspaceMismatch(
            f"oneDNN's LSTM workspace for input size {input_size}, hidden size {hidden_size} ({dtype}) is {real} "
            f"bytes at {seq} steps of {batch}, the rule says {rule}")


def _real_workspace(seq: int, batch: int, input_size: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The bytes of the workspace the CPU's ``mkldnn_rnn_layer`` returns in training."""
    gates = 4 * hidden_size

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device="cpu")

    with torch.enable_grad():
        state = zeros(batch, hidden_size)
        out = torch.ops.aten.mkldnn_rnn_layer.default(
            zeros(seq, batch, input_size), zeros(gates, input_size), zeros(gates, hidden_size), zeros(gates),
            zeros(gates), state, state, False, [], LSTM_MODE, hidden_size, 1, True, False, False, True)
    return out[3].untyped_storage().nbytes()


def _layer_meta(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size, num_layers, has_biases,
                bidirectional, batch_first, train) -> tuple:
    """``mkldnn_rnn_layer`` on ``meta`` (PyTorch runs only LSTMs on oneDNN): output (seq, batch, hidden), final
    states, and in training the workspace oneDNN fills for the backward."""
    seq, batch, input_size = input.shape
    output = torch.empty((seq, batch, hidden_size), dtype=input.dtype, device=input.device)
    hy = torch.empty(hx.shape, dtype=hx.dtype, device=hx.device)
    cy = torch.empty(cx.shape, dtype=cx.dtype, device=cx.device)
    if not torch.is_grad_enabled():
        return output, hy, cy, None
    size = lstm_workspace_bytes(seq, batch, input_size, hidden_size, input.dtype.itemsize)
    return output, hy, cy, torch.empty(size, dtype=torch.uint8, device=input.device)


def _layer_backward_meta(input, weight0, weight1, weight2, weight3, hx, cx, output, hy, cy, grad_output, grad_hy,
                         grad_cy, reverse, mode, hidden_size, num_layers, has_biases, train, bidirectional,
                         batch_sizes, batch_first, workspace) -> tuple:
    """``mkldnn_rnn_layer_backward`` on ``meta``: float32 gradients of the input, both weights, the bias (twice,
    a clone for the second bias) and both initial states."""
    if grad_output is None and grad_hy is None and grad_cy is None:
        return (None,) * 7

    def new(shape: Sequence[int]) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=torch.float32, device=input.device)

    bias = new((4 * hidden_size,))
    return new(input.shape), new(weight0.shape), new(weight1.shape), bias, new(bias.shape), new(hx.shape), \
        new(cx.shape)


def register_meta_kernels(library: torch.library.Library) -> None:
    """The ``meta`` kernels of ``mkldnn_rnn_layer`` and its backward, in ``library``, for as long as it lives.

    Once a ``meta`` kernel was registered, FakeTensorMode keeps calling it even after the library is destroyed
    (torch 2.13), so a kernel whose library is gone hands the call to PyTorch's own ``meta`` kernel: estimates
    under FakeTensorMode do not depend on whether a meta-engine estimate ran before them."""
    for name, kernel in (("mkldnn_rnn_layer", _layer_meta), ("mkldnn_rnn_layer_backward", _layer_backward_meta)):
        op = getattr(torch.ops.aten, name).default
        register_kernel(library, name, _while_registered(library, op, kernel), "Meta")


def _while_registered(library: torch.library.Library, op: Any, kernel: Callable[..., Any]) -> Callable[..., Any]:
    def meta(*args: Any, **kwargs: Any) -> Any:
        if not library_alive(library):
            return torch_meta_kernel(op)(*args, **kwargs)
        return kernel(*args, **kwargs)

    return meta


def lstm(input: torch.Tensor, hx: Sequence[torch.Tensor], params: Sequence[torch.Tensor], has_biases: bool,
         num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
         confirm: Callable[[int, int, torch.dtype], Any] = confirm_workspace) -> tuple:
    """``mkldnn_rnn`` (aten/src/ATen/native/mkldnn/RNN.cpp): the layers and directions one oneDNN kernel each,
    op for op as the CPU runs them. ``confirm(input_size, hidden_size, dtype)`` checks each layer's workspace
    rule first."""
    hidden_size = hx[0].size(2)
    x = input.transpose(0, 1) if batch_first else input
    x = x.contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    per_layer = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    hy: list[torch.Tensor] = []
    cy: list[torch.Tensor] = []
    outputs: list[Any] = [None] * directions  # as in C++, each kept until the next layer's replaces it
    for layer in range(num_layers):
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * per_layer:(index + 1) * per_layer]
            if torch.is_grad_enabled():  # the workspace is made in training only
                confirm(x.size(2), hidden_size, x.dtype)
            h, c = h0[index], c0[index]
            if has_biases:
                b0, b1 = w[2], w[3]
            else:  # zeros of the weights' shapes, the second first (GCC evaluates a call's arguments right to left)
                b1 = torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
                b0 = torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            out = _layer(x, w[0], w[1], b0, b1, h, c, direction > 0, hidden_size, num_layers, has_biases,
                         bidirectional, batch_first, train)
            outputs[direction] = out[0]
            hy.append(out[1])
            cy.append(out[2])
            del out, b0, b1
        x = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return (x.transpose(0, 1) if batch_first else x), torch.stack(hy, 0), torch.stack(cy, 0)


def _layer(x, w0, w1, b0, b1, h, c, reverse, hidden_size, num_layers, has_biases, bidirectional, batch_first,
           train) -> tuple:
    """One ``mkldnn_rnn_layer``. Without grad mode the CPU's kernel returns no workspace; its three outputs
    are made directly (the same allocations), so that remembered meta outputs never mix the two modes."""
    if torch.is_grad_enabled():
        return torch.ops.aten.mkldnn_rnn_layer.default(x, w0, w1, b0, b1, h, c, reverse, [], LSTM_MODE, hidden_size,
                                                       num_layers, has_biases, bidirectional, batch_first, train)
    seq, batch, _ = x.shape
    return (torch.empty((seq, batch, hidden_size), dtype=x.dtype, device=x.device),
            torch.empty(h.shape, dtype=h.dtype, device=h.device), torch.empty(c.shape, dtype=c.dtype, device=c.device))
