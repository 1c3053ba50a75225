"""Activation offloading: the inputs that gradient checkpointing keeps of each decoder layer wait in host memory.

With checkpointing, a decoder layer keeps only its input (batch x seq x hidden) for backward, which recomputes the
rest; over all layers those inputs are what activation memory is made of. Offloading copies each one to pinned CPU
memory as the forward saves it and brings it back when backward recomputes the layer, so the GPU holds about two
layers' inputs instead of all of them (torchtune calls this ``enable_activation_offloading``).

How (learned from torchtune's ``OffloadActivations``, written anew around checkpointing):
- A ``saved_tensors_hooks`` pair around each layer's checkpoint call sees exactly the tensors the checkpoint saves
  (its positional inputs); inside the layer, checkpoint's own hooks take over, so nothing else is offloaded.
- CUDA: the device-to-host copy runs on a side stream that first waits for the compute stream, so the forward goes
  on while the copy runs; ``record_stream`` keeps the allocator from reusing the GPU block before it is done.
- In backward the layers come last to first. Unpacking layer k's input starts the host-to-device copy of layer
  k-1's on the side stream (a prefetch that overlaps layer k's recompute and backward); the compute stream waits on
  that copy's event before it reads the tensor.
- CPU: the hooks still run and save a copy, so the tests check that offloading changes no number.
- Under fake tensors (``shardtune estimate --trace``) nothing is copied: pack lets the tensor go and unpack (or the
  prefetch, one layer ahead) makes an empty one of the same layout, so the trace sees the device memory that
  offloading frees and the prefetch holds.

Each offloaded tensor lives in the handle autograd keeps for it, so a graph that is freed without a backward
(an evaluation under ``no_grad`` saves nothing anyway) frees its host copies too.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class _Stashed:
    """One offloaded tensor: its host copy (None under fake tensors), its layout, and the copies' events (CUDA)."""

    __slots__ = ("seq", "host", "device", "dtype", "shape", "stride", "copied", "back", "ready", "__weakref__")

    def __init__(self, seq: int, tensor: torch.Tensor, host: torch.Tensor | None, copied) -> None:
        self.seq, self.host, self.copied = seq, host, copied
        self.device, self.dtype, self.shape, self.stride = tensor.device, tensor.dtype, tensor.shape, tensor.stride()
        self.back: torch.Tensor | None = None  # the tensor brought back to the device ahead of its unpack
        self.ready = None  # the event that marks ``back`` complete (CUDA)

    @property
    def travels(self) -> bool:
        """Whether it left its device (CUDA) or is modelled as leaving it (fake): not a CPU copy."""
        return self.host is None or self.copied is not None


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


class ActivationOffloader:
    """Moves the tensors saved under ``hooks()`` to host memory and brings them back for backward.

    ``packed_bytes`` counts the bytes moved to the host since the offloader was made (tests and benches read it).
    """

    def __init__(self) -> None:
        self.packed_bytes = 0
        self.layers = 0  # the checkpointed decoder layers whose saved inputs it moves
        self._seq = 0
        self._live: weakref.WeakValueDictionary[int, _Stashed] = weakref.WeakValueDictionary()
        self._streams: dict[torch.device, Any] = {}

    @property
    def held(self) -> int:
        """Offloaded tensors whose graph is still alive (0 after every backward: no host copy outlives its step)."""
        return len(self._live)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Stashed:
        # Parameters are kept where they are: they outlive the step, and FSDP manages their memory itself.
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        copied = host = None
        if _is_fake(tensor):
            pass  # values mean nothing under fake tensors: unpack makes an empty tensor of the same layout
        elif tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is complete
            with torch.cuda.stream(stream):
                host = torch.empty_like(tensor, device="cpu", pin_memory=True)
                host.copy_(tensor, non_blocking=True)
                copied = stream.record_event()
            tensor.record_stream(stream)  # its block is not reused before the copy has read it
        else:
            host = tensor.detach().to("cpu", copy=True)  # on a CPU nothing is freed; the copy shows no number changes
        self.packed_bytes += tensor.numel() * tensor.element_size()
        self._seq += 1
        stashed = _Stashed(self._seq, tensor, host, copied)
        self._live[stashed.seq] = stashed
        return stashed

    def _bring_back(self, stashed: _Stashed) -> None:
        """Start bringing ``stashed`` back to its device: on the side stream (CUDA), or as an empty tensor (fake)."""
        if stashed.host is None:
            stashed.back = torch.empty_strided(stashed.shape, stashed.stride, dtype=stashed.dtype,
                                               device=stashed.device)
            return
        stream = self._side_stream(stashed.device)
        with torch.cuda.stream(stream):
            stream.wait_event(stashed.copied)
            stashed.back = stashed.host.to(stashed.device, non_blocking=True)
            stashed.ready = stream.record_event()

    def _prefetch_before(self, seq: int) -> None:
        """Bring back the newest tensor saved before ``seq``: the next one backward will ask for."""
        earlier = [s for s in self._live.keys() if s < seq]
        previous = self._live.get(max(earlier)) if earlier else None
        if previous is not None and previous.back is None and previous.travels:
            self._bring_back(previous)

    def unpack(self, stashed: torch.Tensor | _Stashed) -> torch.Tensor:
        if not isinstance(stashed, _Stashed):
            return stashed
        if not stashed.travels:  # CPU: the copy itself
            return stashed.host.to(stashed.device)
        if stashed.back is None:
            self._bring_back(stashed)
        self._prefetch_before(stashed.seq)
        tensor, stashed.back = stashed.back, None
        if stashed.ready is not None:
            compute = torch.cuda.current_stream(stashed.device)
            compute.wait_event(stashed.ready)
            tensor.record_stream(compute)  # made on the side stream, read and freed on the compute stream
            stashed.ready = None
        return tensor


def offload_checkpointed_inputs(model: nn.Module) -> ActivationOffloader:
    """Offload the inputs each checkpointed decoder layer saves (call after checkpointing is enabled).

    transformers' layers call ``_gradient_checkpointing_func(forward, *args)``; wrapping that call in the
    offloader's hooks scopes them to the checkpoint's saved inputs. Returns the offloader (one per model).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    offloader = ActivationOffloader()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)
              and getattr(m, "_gradient_checkpointing_func", None) is not None]
    if not layers:
        raise RuntimeError("activation offloading found no checkpointed decoder layer (enable checkpointing first)")
    for layer in layers:
        layer._gradient_checkpointing_func = _offloaded(layer._gradient_checkpointing_func, offloader)
    offloader.layers = len(layers)
    return offloader


def _offloaded(checkpoint_fn: Callable, offloader: ActivationOffloader) -> Callable:
    @functools.wraps(checkpoint_fn)
    def run(function, *args, **kwargs):
        with offloader.hooks():
            return checkpoint_fn(function, *args, **kwargs)

    return run
