"""Probing: the largest micro-batch that fits a device, estimated first and confirmed for real.

Owns: the fit rule, the peak curve and the bracketed search, the probe itself. May import: the
foundation (errors, units, options, log), results, workload, devices.
"""

from __future__ import annotations

from .finder import find_max_micro_batch

__all__ = ["find_max_micro_batch"]
