"""The memory trackers the trace uses: PyTorch's, with the two gaps the training step needs filled.

``FSDPMemTracker`` (FSDP2) and ``MemTracker`` (DDP replica, one process) from ``torch.distributed._tools``; the
latter cannot hook a frozen parameter (a LoRA base) and both refuse a second forward of the root module in one
tracked region (gradient accumulation), so those two cases are handled here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

# The trackers' reference types, under the names the report uses (FSDPMemTracker's first, then MemTracker's).
CATEGORY_NAMES = {
    "Sharded Param": "params_sharded", "Unsharded Param": "params_unsharded", "Buffer": "buffers",
    "Sharded Grad": "grads_sharded", "Unsharded Grad": "grads_unsharded", "Activation": "activations",
    "Temp": "temporaries", "All Gather": "all_gather_buffers", "Reduce Scatter": "reduce_scatter_buffers",
    "OptState": "optimizer", "Inputs": "inputs",
    "Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Other": "inputs",
}


def _frozen_aware_mem_tracker():
    """``MemTracker`` that hooks only trainable parameters' gradients (a frozen LoRA base refuses hooks)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            result = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if not install_grad_hooks:
                return result

            def on_grad(grad: torch.Tensor) -> None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

            for param in module.parameters():
                if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(on_grad),
                        param.register_post_accumulate_grad_hook(lambda p: on_grad(p.grad)))
            return result

    return Tracker()


def make_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    tracker = _frozen_aware_mem_tracker()
    tracker.track_external(model, optimizer)
    return tracker


@contextlib.contextmanager
def fresh_module_stats_per_micro_batch(tracker, root: nn.Module) -> Iterator[None]:
    """Clear the per-module stats when the model starts another micro-batch (gradient accumulation).

    The trackers refuse a second forward of the root module without a reset. This global hook is registered
    before the tracker's own, so it runs first; the overall peak is kept, only per-module stats restart.
    """
    from torch.nn.modules.module import register_module_forward_pre_hook

    def reset(module: nn.Module, args) -> None:
        if module is root and root in tracker.memory_tracking:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


def track_inputs(tracker, fsdp: bool, tensors: list[torch.Tensor]) -> None:
    if fsdp:
        tracker.track_inputs(tuple(tensors))
    else:
        tracker.track_external(*tensors)


def module_peaks(tracker) -> list[tuple[str, int]]:
    """Peak bytes while each module ran: FSDP units, or the model's top modules and its decoder layers."""
    out = []
    for stats in tracker.memory_tracking.values():
        parts = stats.mod_fqn.split(".")
        keep = len(parts) <= 1 or parts[-1].isdigit() or (parts[-1] in ("embed_tokens", "lm_head", "norm")
                                                          and "layers" not in parts)
        if keep and stats.local_peak:
            out.append((stats.mod_fqn, max(stats.local_peak.values())))

    def natural(item: tuple[str, int]) -> list:
        return [int(p) if p.isdigit() else p for p in item[0].split(".")]

    return sorted(out, key=natural)


def peak_breakdown(tracker) -> tuple[int, dict[str, int]]:
    snapshot = tracker.get_tracker_snapshot("peak")
    if not snapshot:
        return 0, {}
    _device, per_type = max(snapshot.items(), key=lambda kv: kv[1]["Total"])
    categories: dict[str, int] = {}
    for ref, nbytes in per_type.items():
        if ref == "Total":
            continue
        name = CATEGORY_NAMES.get(getattr(ref, "value", str(ref)), str(ref))
        categories[name] = categories.get(name, 0) + int(nbytes)
    return int(per_type["Total"]), {k: v for k, v in categories.items() if v}
