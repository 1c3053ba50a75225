"""What ``parallelize`` applied to the model besides the strategy's wrapping, as the end of a run reports it.

torch_compile, use_liger_kernel and activation_offloading each change how a step runs but none changes its
numbers, so a run that silently went without one looks like a run that had it. Each leaves its record here, the
runner keeps it, and summary.json (``run_end.run_summary``) says what ran: the compile report, the Liger kernels
patched in (none, and why, on a CPU), the decoder layers whose inputs were offloaded and the bytes moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardtune.train.compile import CompileReport
from shardtune.train.offload import ActivationOffloader


@dataclass
class LigerReport:
    """The Liger kernels patched into the model; ``fallback`` says why none were, where they could not run."""

    kernels: list[str]
    fallback: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"kernels": self.kernels, "fallback": self.fallback}


@dataclass
class Applied:
    """The records of the switches ``parallelize`` applied; None for each one the run did not ask for."""

    compiled: CompileReport | None = None
    liger: LigerReport | None = None
    offloader: ActivationOffloader | None = None

    def summary(self) -> dict[str, Any]:
        """summary.json's ``liger`` (the kernels, or why none) and ``activation_offloading`` (the decoder layers
        the offloader was installed on, the whole model's before PP splits it, and the bytes this process moved to
        host memory); None for a switch that was off."""
        offloading = None if self.offloader is None else {"layers": self.offloader.layers,
                                                          "bytes_moved": self.offloader.packed_bytes}
        return {"liger": self.liger and self.liger.summary(), "activation_offloading": offloading}
