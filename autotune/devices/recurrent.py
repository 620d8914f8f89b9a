"""Recurrent layers on ``meta`` tensors, run as the CPU runs them.

``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh`` and ``torch.rnn_relu`` are
composite ops: aten/src/ATen/native/RNN.cpp picks the kernels by device. On
``meta`` tensors they would take another path than on the CPU (the input
projection step by step instead of once for the whole sequence, no oneDNN), so
the estimate registers, while it runs, stand-ins that take the CPU's path for
the same arguments:

- an LSTM that oneDNN takes (:func:`autotune.devices.onednn.uses_onednn`) runs
  as one ``mkldnn_rnn_layer`` per layer and direction, which keeps oneDNN's
  workspace for the backward (:mod:`autotune.devices.onednn`);
- everything else (GRU, plain RNN, LSTM with projections or in float64, packed
  sequences, oneDNN disabled) runs RNN.cpp's cells and layers op for op: the
  input projection of the whole sequence first, then each step's cell, with the
  in-place gate activations the CPU uses, so autograd keeps what it keeps there.

Packed sequences need their ``batch_sizes`` as the real CPU tensor PyTorch gives
the kernel; without it the layer raises
:class:`~autotune.devices.meta.NeedsFakeTensors`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from ..compat import ONEDNN_PACKED_LSTM, FakeTensor, register_kernel
from . import onednn
from .meta import NeedsFakeTensors

Hidden = Any  # a tensor, or (h, c) for an LSTM


class _Params:
    """``CellParams``: one layer and direction's weights."""

    __slots__ = ("b_hh", "b_ih", "w_hh", "w_hr", "w_ih")

    def __init__(self, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor | None = None,
                 b_hh: torch.Tensor | None = None, w_hr: torch.Tensor | None = None):
        self.w_ih, self.w_hh, self.b_ih, self.b_hh, self.w_hr = w_ih, w_hh, b_ih, b_hh, w_hr

    def linear_ih(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w_ih, self.b_ih)

    def linear_hh(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.w_hh, self.b_hh)

    def matmul_hr(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.w_hr is None else torch.matmul(h, self.w_hr.t())


def _gather(params: Sequence[torch.Tensor], has_biases: bool, has_projections: bool = False) -> list[_Params]:
    """``gather_params``: the flat weight list, grouped per layer and direction."""
    n = (4 if has_biases else 2) + has_projections
    groups = [params[i:i + n] for i in range(0, len(params), n)]
    if has_biases:
        return [_Params(*g) for g in groups]
    return [_Params(g[0], g[1], w_hr=g[2] if has_projections else None) for g in groups]


# -- cells: the CPU branch, the input projection already computed (``pre_compute_input``) -----------------

def _lstm_cell(x: torch.Tensor, hidden: Hidden, p: _Params) -> Hidden:
    hx, cx = hidden
    gates = p.linear_hh(hx).add_(x)
    chunked = gates.unsafe_chunk(4, 1)
    ingate = chunked[0].sigmoid_()
    forgetgate = chunked[1].sigmoid_()
    cellgate = chunked[2].tanh_()
    outgate = chunked[3].sigmoid_()
    cy = (forgetgate * cx).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    return p.matmul_hr(hy), cy


def _gru_cell(x: torch.Tensor, hidden: torch.Tensor, p: _Params) -> torch.Tensor:
    igates = x.unsafe_chunk(3, 1)
    hgates = p.linear_hh(hidden).unsafe_chunk(3, 1)
    reset_gate = hgates[0].add_(igates[0]).sigmoid_()
    input_gate = hgates[1].add_(igates[1]).sigmoid_()
    new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_()
    return (hidden - new_gate).mul_(input_gate).add_(new_gate)


def _simple_cell(nonlinearity: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def cell(x: torch.Tensor, hidden: torch.Tensor, p: _Params) -> torch.Tensor:
        return nonlinearity(p.linear_hh(hidden).add_(x))

    return cell


def _as_output(hidden: Hidden) -> torch.Tensor:
    return hidden[0] if isinstance(hidden, tuple) else hidden


# Where RNN.cpp builds a pair (h, c) in one call, the second is computed first: the order in which GCC, which
# builds PyTorch for Linux, evaluates a call's arguments (right to left).

def _slice(hidden: Hidden, start: int, end: int) -> Hidden:
    if isinstance(hidden, tuple):
        c = hidden[1].narrow(0, start, end - start)
        return hidden[0].narrow(0, start, end - start), c
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: list[Hidden]) -> Hidden:
    if isinstance(hiddens[0], tuple):
        c = torch.cat([h[1] for h in hiddens], 0)
        return torch.cat([h[0] for h in hiddens], 0), c
    return torch.cat(hiddens, 0)


# -- layers -------------------------------------------------------------------------------------------

def _release(items: list) -> None:
    """Drop a list's references first to last, as a C++ vector destroys its elements (a Python list drops
    them last to first)."""
    for i in range(len(items)):
        items[i] = None


def _steps(cell: Callable, inputs: Sequence[torch.Tensor], hidden: Hidden, p: _Params) -> tuple[list, Hidden]:
    outputs = []
    for x in inputs:
        hidden = cell(x, hidden, p)
        outputs.append(_as_output(hidden))
    return outputs, hidden


def _full(cell: Callable, x: torch.Tensor, hidden: Hidden, p: _Params) -> tuple[torch.Tensor, Hidden]:
    """``FullLayer`` on the CPU: the whole sequence's input projection, then the steps."""
    x_w = p.linear_ih(x)
    outputs, hidden = _steps(cell, x_w.unbind(0), hidden, p)
    out = torch.stack(outputs, 0)
    _release(outputs)  # C++ destroys its locals last declared first
    del x_w
    return out, hidden


def _full_bidirectional(cell: Callable, x: torch.Tensor, hidden: tuple, params: tuple) -> tuple[torch.Tensor, tuple]:
    """``FullBidirectionalLayer`` on the CPU."""
    x_w = params[0].linear_ih(x)
    steps = x_w.unbind(0)
    fw, fw_hidden = _steps(cell, steps, hidden[0], params[0])
    fw_output = torch.stack(fw, 0)
    x_w = params[1].linear_ih(x)
    steps = x_w.unbind(0)[::-1]
    rev, rev_hidden = _steps(cell, steps, hidden[1], params[1])
    rev.reverse()
    rev_output = torch.stack(rev, 0)
    out = torch.cat([fw_output, rev_output], fw_output.dim() - 1)
    del rev_output  # C++ destroys its locals last declared first
    _release(rev)
    del steps, fw_output
    _release(fw)
    del x_w
    return out, (fw_hidden, rev_hidden)


def _packed(cell: Callable, data: torch.Tensor, sizes: list[int], hidden: Hidden, p: _Params) -> tuple:
    """``PackedLayer`` on the CPU: finished sequences' states set aside as the batch shrinks."""
    x_w = p.linear_ih(data)
    outputs: list[torch.Tensor] = []
    hiddens: list[Hidden] = []
    offset, last = 0, sizes[0]
    for size in sizes:
        step = x_w.narrow(0, offset, size)
        offset += size
        if last > size:
            hiddens.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = cell(step, hidden, p)
        outputs.append(_as_output(hidden))
        del step
    hiddens.append(hidden)
    hiddens.reverse()
    out, final = torch.cat(outputs, 0), _concat(hiddens)
    del hidden, x_w
    _release(hiddens)
    _release(outputs)
    return out, final


def _reversed_packed(cell: Callable, data: torch.Tensor, sizes: list[int], initial: Hidden, p: _Params) -> tuple:
    """``ReversedPackedLayer`` on the CPU: from the last step back, states joining as the batch grows."""
    x_w = p.linear_ih(data)
    outputs: list[torch.Tensor] = []
    offset, last = data.size(0), sizes[-1]
    hidden = _slice(initial, 0, last)
    for size in reversed(sizes):
        if size > last:
            hidden = _concat([hidden, _slice(initial, last, size)])
        step = x_w.narrow(0, offset - size, size)
        offset -= size
        last = size
        hidden = cell(step, hidden, p)
        outputs.append(_as_output(hidden))
        del step
    outputs.reverse()
    out = torch.cat(outputs, 0)
    del x_w
    _release(outputs)
    return out, hidden


def _packed_bidirectional(cell: Callable, data: torch.Tensor, sizes: list[int], hidden: tuple,
                          params: tuple) -> tuple:
    fw, fw_hidden = _packed(cell, data, sizes, hidden[0], params[0])
    rev, rev_hidden = _reversed_packed(cell, data, sizes, hidden[1], params[1])
    return torch.cat([fw, rev], -1), (fw_hidden, rev_hidden)


def _layers(cell: Callable, x: torch.Tensor, hiddens: list, params: list[_Params], num_layers: int, dropout: float,
            train: bool, bidirectional: bool, sizes: list[int] | None) -> tuple[torch.Tensor, list]:
    """``_rnn_impl`` with ``apply_layer_stack``: the layers in turn, dropout between them; the final states
    of every layer and direction."""
    per_layer: list[Any] = params
    if bidirectional:  # pair_vec: (forward, reverse) per layer
        hiddens = [(hiddens[i], hiddens[i + 1]) for i in range(0, len(hiddens), 2)]
        per_layer = [(params[i], params[i + 1]) for i in range(0, len(params), 2)]
    finals: list[Hidden] = []
    for index in range(num_layers):
        layer: Callable
        if sizes is None:
            layer = _full_bidirectional if bidirectional else _full
            x, final = layer(cell, x, hiddens[index], per_layer[index])
        else:
            layer = _packed_bidirectional if bidirectional else _packed
            x, final = layer(cell, x, sizes, hiddens[index], per_layer[index])
        finals.extend(final if bidirectional else (final,))
        if dropout != 0 and train and index < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return x, finals


# -- the ops --------------------------------------------------------------------------------------------

def _batch_sizes(batch_sizes: torch.Tensor) -> list[int]:
    """A packed sequence's step sizes, which the CPU's kernel reads from the real CPU tensor."""
    if batch_sizes.is_meta or batch_sizes.device.type != "cpu" or isinstance(batch_sizes, FakeTensor):
        raise NeedsFakeTensors("a packed sequence's batch sizes are not known on meta tensors")
    return [int(b) for b in batch_sizes.tolist()]


def _one_hidden(cell: Callable) -> tuple[Callable, Callable]:
    """``gru`` / ``rnn_tanh`` / ``rnn_relu``: the ``input`` and ``data`` overloads (``ONE_HIDDEN_RNN``)."""
    def on_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        x = input.transpose(0, 1) if batch_first else input
        out, finals = _layers(cell, x, list(hx.unbind(0)), _gather(params, has_biases), num_layers, dropout, train,
                              bidirectional, None)
        hy = torch.stack(finals, 0)
        _release(finals)
        if batch_first:
            out.transpose_(0, 1)
        return out, hy

    def on_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        sizes = _batch_sizes(batch_sizes)
        out, finals = _layers(cell, data, list(hx.unbind(0)), _gather(params, has_biases), num_layers, dropout,
                              train, bidirectional, sizes)
        hy = torch.stack(finals, 0)
        _release(finals)
        return out, hy

    return on_input, on_data


def _lstm_layers(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, sizes) -> tuple:
    """``_lstm_impl``: (h, c) per layer and direction, the final ones stacked."""
    hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0)))
    projections = hx[0].size(2) != hx[1].size(2)
    out, finals = _layers(_lstm_cell, x, hiddens, _gather(params, has_biases, projections), num_layers, dropout, train,
                          bidirectional, sizes)
    hs, cs = [h for h, _ in finals], [c for _, c in finals]  # moved out of the final states
    del finals
    cy = torch.stack(cs, 0)
    hy = torch.stack(hs, 0)
    _release(cs)
    _release(hs)
    return out, hy, cy


def _lstm(confirm: Callable[[int, int, torch.dtype], Any]) -> tuple[Callable, Callable]:
    def on_input(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        if onednn.uses_onednn(input, hx):
            return onednn.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                               confirm)
        x = input.transpose(0, 1) if batch_first else input
        out, hy, cy = _lstm_layers(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, None)
        return (out.transpose(0, 1) if batch_first else out), hy, cy

    def on_data(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, bidirectional):
        sizes = _batch_sizes(batch_sizes)
        if ONEDNN_PACKED_LSTM and onednn.uses_onednn(data, hx) and all(size == sizes[0] for size in sizes):
            # Sequences all of one length: the packed data is a (steps, batch, features) tensor for oneDNN.
            x = data.view(len(sizes), sizes[0], data.size(1))
            out, hy, cy = onednn.lstm(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, False,
                                      confirm)
            return out.view(data.size(0), out.size(2)), hy, cy
        return _lstm_layers(data, hx, params, has_biases, num_layers, dropout, train, bidirectional, sizes)

    return on_input, on_data


def register_cpu_recurrent(library: torch.library.Library, pause: Callable[[], Any] = contextlib.nullcontext) -> None:
    """Register in ``library`` the CPU's recurrent layers for ``meta`` tensors (above autograd, as the composites
    run) and the ``meta`` kernels of oneDNN's LSTM layer. ``pause``: a context manager under which the real
    kernel that confirms oneDNN's workspace runs uncounted."""
    def confirm(input_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        with pause():
            try:
                onednn.confirm_workspace(input_size, hidden_size, dtype)
            except onednn.WorkspaceMismatch as exc:
                raise NeedsFakeTensors(str(exc)) from None

    kernels = {"lstm": _lstm(confirm), "gru": _one_hidden(_gru_cell),
               "rnn_tanh": _one_hidden(_simple_cell(torch.tanh)), "rnn_relu": _one_hidden(_simple_cell(torch.relu))}
    for name, (on_input, on_data) in kernels.items():
        register_kernel(library, f"{name}.input", on_input, "AutogradMeta")
        register_kernel(library, f"{name}.data", on_data, "AutogradMeta")
    onednn.register_meta_kernels(library)
