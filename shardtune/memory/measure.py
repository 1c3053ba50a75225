"""Measuring what a real forward pass keeps for backward, on any device (CPU included).

Walks the autograd graph after the forward and adds up the distinct storages its nodes saved, leaving out the
parameters. This is the quantity the activation formula predicts, so tests compare the two on small real models.
"""

from __future__ import annotations

import weakref

import torch


def saved_tensor_bytes(loss: torch.Tensor, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages saved for backward in ``loss``'s graph (storages in ``exclude`` left out)."""
    seen: dict[int, int] = {}
    stack, visited = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(node, attr)
            except RuntimeError:  # already freed
                continue
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key not in exclude:
                        seen[key] = storage.nbytes()
        stack.extend(fn for fn, _ in node.next_functions)
    return sum(seen.values())


def parameter_storages(model: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


class LiveStorages:
    """Records every storage created while active; ``live_bytes()`` sums those still alive afterwards.

    After a forward pass, what is still alive (outputs aside) is what autograd keeps for backward, including the
    inputs a non-reentrant checkpoint holds for recomputation, which a walk of the graph cannot see without
    triggering the recomputation itself.
    """

    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def __enter__(self) -> "LiveStorages":
        from torch.utils._python_dispatch import TorchDispatchMode

        refs = self._refs

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        storage = t.untyped_storage()
                        # Overwrite: a freed storage's address is reused by later allocations.
                        refs[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def live_bytes(self, exclude: set[int] = frozenset()) -> int:
        total = 0
        for ptr, (ref, nbytes) in self._refs.items():
            storage = ref()
            if storage is not None and ptr not in exclude and storage.data_ptr() == ptr:
                total += nbytes
        return total
