"""``torch_compile``: each decoder layer compiled on its own, as torchtitan does, and the compilations counted.

Compiling layer by layer, rather than the whole model, keeps the parts that do not trace well out of the graph
(FSDP2's gather hooks on the root, the fused loss's chunk loop, PEFT's wrappers around the model) and compiles one
graph that every layer reuses (dynamo treats a module's parameters as inputs, so the layers share one code
object). ``parallelize`` calls ``apply_compile`` after checkpointing and before FSDP2, torchtitan's order.

Packed batches change length from batch to batch. A forward pre-hook marks the sequence dimension of each layer's
inputs dynamic before dynamo sees them, so the first graph serves every length. Dynamo still compiles again where
a guard fails (evaluation runs without grad, a batch of another size); ``CompileReport``
counts every compilation and recompilation through dynamo's compile-start callback, for the end-of-run log and
summary.json.

Only the layer's ``forward`` is compiled, not the module call: its hooks (FSDP2's all-gathers, the dynamic mark)
run eager, and checkpointing (transformers checkpoints inside ``forward``) is traced into the graph, as torchtitan
does by compiling the checkpointed block. With activation offloading the checkpoint call sits inside the
offloader's ``saved_tensors_hooks``, which dynamo cannot trace, so there the function the checkpoint runs is what
is compiled (``_compile_inside_offloaded_checkpoint``). If the backend cannot compile (no C++ compiler for
inductor, a backend that raises), the first call says why in one warning and the run goes on eager, with the same
results.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardtune.train.plan import Plan, layer_class_names

log = logging.getLogger("shardtune")

# Guards that legitimately fail once each in a run: evaluation runs without grad, its layers' inputs need no
# gradient (and then need one again back in training), and a batch of another size (evaluation's, a last one)
# specialises the batch dimension. More than this per compiled code object means something recompiles every step.
RECOMPILES_PER_GRAPH = 3


class _CompileEvents:
    """Process-wide count of dynamo's compilations, from its compile-start callback (registered once)."""

    def __init__(self) -> None:
        self.compiles = 0  # every dynamo compilation of a frame
        self.recompiles = 0  # compilations of a frame compiled before (a guard failed): compile id "frame/n>0"
        self.frames: set[str] = set()
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        from torch._dynamo.callback import CallbackTrigger, on_compile_start

        def started(args) -> None:
            if args.callback_trigger != CallbackTrigger.DYNAMO:
                return  # the lazy backward compile of a graph dynamo already counted
            frame, _, attempt = str(args.compile_id).partition("/")
            with self._lock:
                self.compiles += 1
                self.frames.add(frame)
                self.recompiles += attempt.isdigit() and int(attempt) > 0

        on_compile_start(started)
        self._installed = True

    def snapshot(self) -> tuple[int, int, frozenset[str], int]:
        """Compilations, recompilations, frames, and the graphs dynamo handed a backend: a frame that breaks
        everywhere (a context manager dynamo cannot trace) compiles without handing any, and then runs eager."""
        from torch._dynamo.utils import counters

        with self._lock:
            return self.compiles, self.recompiles, frozenset(self.frames), counters["stats"]["unique_graphs"]


EVENTS = _CompileEvents()


@dataclass
class CompileReport:
    """What ``torch_compile`` did in this run: the layers compiled, or why the run went eager."""

    backend: str
    mode: str | None
    layers: int = 0
    fallback: str | None = None  # why the run is eager although torch_compile was asked for
    _start: tuple[int, int, frozenset[str], int] = field(default_factory=EVENTS.snapshot, repr=False)

    def fall_back(self, reason: str) -> None:
        """Go eager for the rest of the run, saying why once."""
        self.fallback = reason
        log.warning("torch_compile: cannot compile with backend %s (%s); training goes on eager", self.backend,
                    reason)

    def restart_count(self) -> None:
        self._start = EVENTS.snapshot()

    def counts(self) -> dict[str, int]:
        """Compilations since the layers were compiled: graphs (frames), compiles, recompiles and their bound."""
        compiles, recompiles, frames, backend_graphs = EVENTS.snapshot()
        graphs = len(frames - self._start[2])
        return {"graphs": graphs, "compiles": compiles - self._start[0],
                "recompiles": recompiles - self._start[1], "recompile_bound": RECOMPILES_PER_GRAPH * graphs,
                "backend_graphs": max(backend_graphs - self._start[3], 0)}

    def compiled_nothing(self) -> bool:
        """Dynamo ran on the layers but handed no graph to the backend: they ran eager, with no fallback said."""
        c = self.counts()
        return not self.fallback and c["compiles"] > 0 and not c["backend_graphs"]

    def summary(self) -> dict[str, Any]:
        """summary.json's ``compile`` record."""
        record: dict[str, Any] = {"backend": self.backend, "mode": self.mode, "layers": self.layers,
                                  "fallback": self.fallback}
        if not self.fallback:
            record.update(self.counts())
        return record

    def describe(self) -> str:
        """The end-of-run line."""
        if self.fallback:
            return f"torch_compile: eager ({self.fallback})"
        c = self.counts()
        if self.compiled_nothing():
            return (f"torch_compile: {self.layers} decoder layers on {self.backend}: dynamo compiled {c['compiles']} "
                    f"time(s) but broke every graph before any operation, so the layers ran eager")
        return (f"torch_compile: {self.layers} decoder layers on {self.backend}: {c['graphs']} graph(s), "
                f"{c['compiles']} compilation(s), {c['recompiles']} recompilation(s) (expected at most "
                f"{c['recompile_bound']})")


def decoder_layers(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The decoder layers: the classes fsdp_transformer_layer_cls_to_wrap names, else the model's own
    ``_no_split_modules`` (the same layers FSDP2 shards one by one)."""
    names = layer_class_names(model, plan)
    return [m for m in model.modules() if type(m).__name__ in names]


class _GuardedForward:
    """A layer's compiled forward that falls back to its eager forward when compiling fails.

    Dynamo compiles on the first call (and again when a guard fails); a backend that cannot compile raises a
    ``TorchDynamoException`` then. The layer's hooks (FSDP2's gathers) run outside this call, so running the eager
    forward instead leaves every other part of the step as it was: the results are the ones an eager run gets.
    """

    def __init__(self, eager, compiled, report: CompileReport) -> None:
        self.eager, self.compiled, self.report = eager, compiled, report

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.report.fallback:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as exc:
            self.report.fall_back(_reason(exc))
            return self.eager(*args, **kwargs)


def _reason(exc: BaseException) -> str:
    """The first informative lines of a compile failure (dynamo wraps the backend's error in its own)."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith(("Set TORCHDYNAMO_VERBOSE", "from user code"))]
    # "backend='name' raised:" leads the backend's own error line.
    first = " ".join(lines[:2]) if lines and lines[0].endswith(":") else " ".join(lines[:1])
    return first[:300] or type(exc).__name__


def _sequence_dims_dynamic(_layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Mark the sequence dimension of every input of a layer dynamic before dynamo sees it (hooks run eager: the
    compiled function is the layer's forward), so the first graph already serves every packed length."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        return
    seq_len = hidden.shape[1]
    tensors = [*args, *kwargs.values(), *(t for v in kwargs.values() if isinstance(v, tuple) for t in v)]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for dim, size in enumerate(tensor.shape):
                if size == seq_len and dim > 0:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def _under_fake_tensors(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in model.parameters())


def _compile_inside_offloaded_checkpoint(layer: nn.Module, plan: Plan, report: CompileReport) -> None:
    """With activation offloading, compile the function the layer's checkpoint runs, not only its forward.

    Offloading wraps the checkpoint call in ``saved_tensors_hooks``, which dynamo cannot trace: traced from the
    compiled forward, the layer broke into graphs that held none of its math and ran eager. So the offloaded
    checkpoint call stays eager (dynamo is told not to trace it), and what it checkpoints, transformers'
    ``partial(forward, layer, **kwargs)``, is compiled: once per forward function, shared by the layers as their
    compiled forward is. Without grad (evaluation) the layer's compiled forward serves as before.
    """
    checkpoint_fn = layer._gradient_checkpointing_func
    compiled: dict[Any, _GuardedForward] = {}

    @torch._dynamo.disable
    def run(function, *args: Any, **kwargs: Any) -> Any:
        inner = function.func if isinstance(function, functools.partial) else function
        if inner not in compiled:
            compiled[inner] = _GuardedForward(inner, torch.compile(inner, backend=plan.compile_backend,
                                                                   mode=plan.compile_mode), report)
        call = (functools.partial(compiled[inner], *function.args, **function.keywords)
                if isinstance(function, functools.partial) else compiled[inner])
        return checkpoint_fn(call, *args, **kwargs)

    layer._gradient_checkpointing_func = run


def apply_compile(model: nn.Module, plan: Plan) -> CompileReport | None:
    """Compile each decoder layer's forward in place (state-dict keys unchanged); None when torch_compile is off
    or the model is being traced on fake tensors (``shardtune estimate``, ``--dry_run``: nothing runs there)."""
    if plan.compile_backend is None or _under_fake_tensors(model):
        return None
    report = CompileReport(plan.compile_backend, plan.compile_mode)
    layers = decoder_layers(model, plan)
    if not layers:
        report.fall_back("no decoder layer found; name its class with fsdp_transformer_layer_cls_to_wrap")
        return report
    EVENTS.install()
    report.restart_count()
    for layer in layers:
        layer.register_forward_pre_hook(_sequence_dims_dynamic, with_kwargs=True)
        # The forward, not the module call: hooks (FSDP2's gathers, the one above) stay eager, outside the graph.
        compiled = torch.compile(layer.forward, backend=plan.compile_backend, mode=plan.compile_mode)
        layer.forward = _GuardedForward(layer.forward, compiled, report)
        if plan.activation_offloading:
            _compile_inside_offloaded_checkpoint(layer, plan, report)
    report.layers = len(layers)
    log.info("torch_compile: %d decoder layers (%s) compiled with %s%s, on their first call", len(layers),
             type(layers[0]).__name__, plan.compile_backend,
             f", mode {plan.compile_mode}" if plan.compile_mode else "")
    return report
