"""What a run reports: one JSON line per logged step, a progress bar on rank 0, peak memory per device."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from shardtune.train.dist import DistInfo


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: CUDA's reserved memory (what nvidia-smi sees minus the context), else peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def start_peak_memory(device: torch.device) -> None:
    """Count the training peak from here: loading left cached blocks (FSDP's unsharded staging of each unit,
    rank 0's broadcasts) and a peak that belong to no step; CUDA only (the CPU's peak RSS cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def max_over_ranks(value: int, device: torch.device) -> int:
    if torch.distributed.is_initialized():
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())
    return value


class MetricsLog:
    """``metrics.jsonl`` in the output folder, appended (a resumed run continues the same file); rank 0 writes."""

    def __init__(self, output_dir: str | Path, info: DistInfo, tensorboard: bool = False) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.enabled = info.is_main
        self._tb = None
        if self.enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from shardtune.errors import UsageError

                raise UsageError("report_to=tensorboard needs the tensorboard package: pip install tensorboard "
                                 "(or set report_to none)") from None

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def progress_bar(total: int, initial: int, enabled: bool):
    """A tqdm bar with loss, tokens/s and ETA on rank 0; a silent stand-in elsewhere."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled, dynamic_ncols=True,
                file=sys.stderr)


# Dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets, matched on the CUDA device name in
# this order (a variant before the name it contains: "H100 PCIe" before "H100", "L40S" and "L40" before "L4").
# None: a variant whose peak we do not state (no MFU rather than a wrong one).
PEAK_BF16_FLOPS = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12),
                   ("A100", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A6000", 155e12),
                   ("4090", 165e12), ("3090", 71e12), ("A10G", None), ("A10", 125e12))


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (and on CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS if key in name), None)


def flops_per_token(config, parameters: int, trainable: int, seq_len: int) -> float:
    """Model FLOPs per trained token (PaLM's accounting, appendix B; recomputation not counted).

    Matmuls cost 2 FLOPs per weight per token forward and 4 backward; a frozen weight skips its own gradient
    (2 of the 4), which is what LoRA saves. Attention adds 12 * layers * hidden * seq_len.
    """
    frozen = parameters - trainable
    layers = getattr(config, "num_hidden_layers", 0)
    hidden = getattr(config, "hidden_size", 0)
    return 6.0 * trainable + 4.0 * frozen + 12.0 * layers * hidden * seq_len
