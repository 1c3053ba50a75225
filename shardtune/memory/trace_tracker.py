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
from torch.utils._python_dispatch import TorchDispatchMode

# The trackers' reference types, under the names the report uses (FSDPMemTracker's first, then MemTracker's).
CATEGORY_NAMES = {
    "Sharded Param": "params_sharded", "Unsharded Param": "params_unsharded", "Buffer": "buffers",
    "Sharded Grad": "grads_sharded", "Unsharded Grad": "grads_unsharded", "Activation": "activations",
    "Temp": "temporaries", "All Gather": "all_gather_buffers", "Reduce Scatter": "reduce_scatter_buffers",
    "OptState": "optimizer", "Inputs": "inputs",
    "Parameter": "params", "Gradient": "grads", "Optstate": "optimizer", "Other": "inputs",
}


class _PeaksOfRunningModules:
    """Mixin for the trackers: after each op, update the peaks of the modules that are running, not of all.

    PyTorch's ``_update_peak_stats`` visits every tracked module on every op to ask whether it is running; on a
    70B model that is ~30 s of a trace. Same result: the running modules are looked up by name.
    """

    def _update_peak_stats(self, peak_state) -> None:
        from copy import deepcopy

        from torch.distributed._tools.mem_tracker import _TOTAL_KEY

        if getattr(self, "_by_name_size", -1) != len(self.memory_tracking):
            self._by_name = {stats.mod_fqn: stats for stats in self.memory_tracking.values()}
            self._by_name_size = len(self.memory_tracking)
        snapshot = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            stats = self._by_name.get(name)
            if stats is None or peak_state not in stats.snapshots:
                continue
            for dev, dev_snap in snapshot.items():
                if stats.local_peak.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    stats.local_peak[dev] = dev_snap[_TOTAL_KEY]
                    stats.snapshots[peak_state][-1][dev] = deepcopy(dev_snap)
        for dev, dev_snap in snapshot.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(dev_snap)


def _frozen_aware_mem_tracker():
    """``MemTracker`` that hooks only trainable parameters' gradients (a frozen LoRA base refuses hooks)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(_PeaksOfRunningModules, MemTracker):
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


def _post_backward_without_leak(self, fsdp_mod: nn.Module, orig_post_backward):
    """``FSDPMemTracker``'s wrapper of a unit's post-backward (torch 2.13), less a leak: its loop over the unit's
    parameters leaves the last one's unsharded gradient in a local variable through the whole post-backward. The
    root unit's last parameter is an untied head, so the trace held the head's gradient, in the compute dtype,
    beside the root's reduce-scatter buffers, where a training step on a shard group of one GPU (NO_SHARD) has
    freed it once copied in (on more GPUs FSDP2's own reduce-scatter keeps it until it returns)."""
    from functools import wraps

    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState, _FSDPRefType, _FSDPState

    def note(ref_type, param_of) -> None:
        group = fsdp_mod._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group else ():
            grad = param_of(fsdp_param).grad
            if grad is not None:
                self._update_and_maybe_create_winfos(grad, ref_type,
                                                     update_existing=ref_type is _FSDPRefType.UNSHARDED_GRAD)

    @wraps(orig_post_backward)
    def inner(*args, **kwargs) -> None:
        note(_FSDPRefType.UNSHARDED_GRAD, lambda p: p._unsharded_param)
        stats = self.memory_tracking[fsdp_mod]
        stats.snapshots.setdefault(_FSDPModState.BEF_POST_BW, []).append(self.get_tracker_snapshot())
        self._fsdp_state = _FSDPState.POST_BW
        orig_post_backward(*args, **kwargs)
        note(_FSDPRefType.SHARDED_GRAD, lambda p: p.sharded_param)
        stats.snapshots.setdefault(_FSDPModState.AFT_POST_BW, []).append(self.get_tracker_snapshot())

    return inner


def make_tracker(model: nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool):
    if fsdp:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        class Tracker(_PeaksOfRunningModules, FSDPMemTracker):
            _fsdp_param_group_post_backward = _post_backward_without_leak

        return Tracker(model, optimizer)
    tracker = _frozen_aware_mem_tracker()
    tracker.track_external(model, optimizer)
    return tracker


@contextlib.contextmanager
def fresh_module_stats_per_micro_batch(tracker, root: nn.Module) -> Iterator[None]:
    """Clear the per-module stats when the model starts another micro-batch (gradient accumulation).

    The trackers refuse a second forward of the outermost module called without a reset: the model, or under DDP
    its wrapper (the run's memory check holds the model unwrapped, as callbacks get it, while the runner calls
    the wrapper). This global hook is registered before the tracker's own, so it runs first; the overall peak is
    kept, only per-module stats restart.
    """
    from torch.nn.modules.module import register_module_forward_pre_hook

    def reset(module: nn.Module, args) -> None:
        outermost = module is root or getattr(module, "module", None) is root
        if outermost and module in tracker.memory_tracking:
            tracker.reset_mod_stats()

    handle = register_module_forward_pre_hook(reset)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def dropped_graphs_freed(root: nn.Module) -> Iterator[None]:
    """Free, after each DoRA module's forward, the graph it built and dropped, as a step without a tracker does.

    PEFT's DoRA computes its LoRA weight by running lora_A and lora_B on an identity matrix, then uses it detached:
    backward never reaches that graph. The trackers' module hooks (``register_multi_grad_hook``) hang closures on
    it that refer back to its tensors, so under a tracker the dropped graph, the identity and its bf16 cast
    (in_features squared, per adapted linear) included, is a reference cycle that lives until Python's cyclic
    garbage collector runs: the traced peak then depends on when it runs (+0.6 GiB per layer of backward with the
    collector off, on Llama-3.1-8B's widths at 2048 tokens), where a training step without a tracker leaves no
    cycle and frees the graph when the module returns.
    """
    import gc

    from peft.tuners.lora.dora import DoraLinearLayer  # the embedding's and convolutions' subclass it

    dora = [m for m in root.modules() if isinstance(m, DoraLinearLayer)]
    if not dora:
        yield
        return
    # A full collection reaches the cycles wherever their objects sit; what exists before the step is frozen out
    # of it, so each costs what the step made (a 32-layer model's trace stays under a minute).
    gc.collect()
    gc.freeze()

    def collect(*_) -> None:  # returns nothing: a forward hook's return value would replace the module's output
        gc.collect()

    handles = [m.register_forward_hook(collect) for m in dora]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        gc.unfreeze()


class GradientsSummedInPlace(TorchDispatchMode):
    """Autograd's sums of two gradients of one tensor made in place, as a GPU step makes them.

    When backward reaches a tensor by two paths (a tied embedding and its head, the head over the fused loss's
    chunks, the residual stream), autograd's input buffer adds the new gradient to the one it holds, in place when
    that one is its own (PyTorch's ``InputBuffer::accumulate``) and no Python dispatch mode is active. Under the
    trace's trackers one always is, so every such sum is made out of place and a third tensor of the gradient's size
    is held for a moment: one fp32 embedding at the end of a tied model's backward, one head-sized gradient at each
    chunk of the loss, that a training step never holds. This mode, entered inside the trackers, makes those sums in
    place again before the trackers see them.

    The buffer's sum is told apart from an addition inside a backward formula by where its operands come from: the
    held gradient was made by an earlier autograd node than the one running, the new one by the running node. Only
    fake tensors are summed in place (their values mean nothing); real ones are left as autograd made them.
    """

    _MADE_BY = "_shardtune_made_by_node"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented
        node = torch._C._current_autograd_node()
        if node is None:
            return func(*args, **(kwargs or {}))
        running = (node.name(), node._sequence_nr())
        if (func is torch.ops.aten.add.Tensor and not kwargs and len(args) == 2 and not torch.is_grad_enabled()
                and all(isinstance(a, FakeTensor) for a in args)):
            held, new = args
            if (getattr(new, self._MADE_BY, None) == running and getattr(held, self._MADE_BY, running) != running
                    and held.shape == new.shape and held.dtype == new.dtype and held.is_contiguous()):
                return torch.ops.aten.add_.Tensor(held, new)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                setattr(t, self._MADE_BY, running)
        return out


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


class AllocationLog(TorchDispatchMode):
    """Every storage the traced step allocates, resizes and frees, in order, as ``(key, bytes, stream)`` events
    (bytes 0: freed; stream 0 is the default stream, others number the streams FSDP2 switches to).

    The trackers above keep totals by category; the CUDA caching allocator's reserved memory depends on the order
    and sizes of the requests, so this records them for :class:`shardtune.memory.allocator.CachingAllocatorModel`.
    New storages are seen as op outputs (DTensor ops are let through to their local ops first, and the global-shape
    tensors of DTensor's sharding propagation, which exist only to compute output shapes, are not counted: under
    fake tensors they are made in the trace's own fake mode and linger until a garbage collection), resizes through
    ``UntypedStorage.resize_`` (FSDP2 frees and refills its unsharded parameters that way) and frees by a
    finalizer on the storage. ``add`` registers tensors that exist before the log starts. The trace runs on the
    CPU, where FSDP2 selects its streams through ``torch.cpu``'s stand-ins exactly as it selects CUDA streams on a
    GPU, so the stream current at each allocation is read from there.
    """

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.weak import WeakIdKeyDictionary

        self.events: list[tuple[int, int, int]] = []
        self._keys = WeakIdKeyDictionary()  # storage -> (key, bytes)
        self._finalizers: dict[int, object] = {}
        self._next_key = 0
        self._streams: dict[int, int] = {}  # id of a torch.cpu.Stream -> its number
        self._fake_mode_on_entry = None
        self._original_resize = self._original_propagation = None
        self._paused = 0

    def add(self, *tensors: torch.Tensor | None) -> None:
        from torch.distributed._tools.common_utils import get_untyped_storages

        for t in tensors:
            if isinstance(t, torch.Tensor):
                for storage in sorted(get_untyped_storages(t), key=id):
                    self._see(storage)

    def _see(self, storage: torch.UntypedStorage) -> None:
        import weakref

        if self._paused:
            return
        nbytes = storage.nbytes()
        known = self._keys.get(storage)
        if known is None:
            key = self._next_key
            self._next_key += 1
            self._keys[storage] = (key, nbytes)
            self._finalizers[key] = weakref.finalize(storage, self._freed, key)
        elif known[1] != nbytes:
            key = known[0]
            self._keys[storage] = (key, nbytes)
        else:
            return
        self.events.append((key, nbytes, self._stream()))

    def _stream(self) -> int:
        current = torch.cpu.current_stream()
        if current is torch.cpu._default_cpu_stream:
            return 0
        return self._streams.setdefault(id(current), len(self._streams) + 1)

    def _freed(self, key: int) -> None:
        self._finalizers.pop(key, None)
        self.events.append((key, 0, 0))

    def __enter__(self) -> AllocationLog:
        from torch._guards import active_fake_mode

        self._fake_mode_on_entry = active_fake_mode()
        self._original_resize = original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int):
            out = original(storage, size)
            if storage in self._keys:
                self._see(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        self._original_propagation = propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def shapes_only(propagator, *args, **kwargs):
            self._paused += 1
            try:
                return propagate(propagator, *args, **kwargs)
            finally:
                self._paused -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = shapes_only
        return super().__enter__()

    def __exit__(self, *args) -> None:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        torch.UntypedStorage.resize_ = self._original_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagation
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._guards import active_fake_mode
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_map_only

        if any(t is DTensor for t in types):
            return NotImplemented
        if func is torch.ops._c10d_functional.wait_tensor.default and active_fake_mode():
            out = args[0]  # the fake kernel returns a new tensor; the real op waits on its input in place
        else:
            out = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:
            tree_map_only(torch.Tensor, self.add, out)
        return out
