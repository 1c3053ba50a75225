"""Callbacks: code of yours that runs at fixed points of the training loop, on every rank.

The shape is Transformers' ``TrainerCallback``: each event is a method ``on_<event>(self, args, state, control,
**kwargs)``, where ``args`` is the run's ``TrainConfig`` (its keys read by their flat names too, as
``args.output_dir``), ``state`` the ``TrainState`` (``state.step`` optimizer steps done, also readable as
``state.global_step``; ``state.epoch`` Transformers' float epoch, 1.5 halfway through the second, also
``state.epochs_done``; ``state.epochs_completed`` the whole epochs done; ``state.max_steps``;
``state.log_history``, ``state.best_metric``, ``state.best_model_checkpoint`` as Transformers' ``TrainerState``
has them) and ``control`` a ``TrainerControl`` whose flags a callback may set:
``should_training_stop`` ends the run after this step (with a checkpoint and ``final/``, as reaching ``max_steps``
does), ``should_epoch_stop`` ends this epoch after it (training goes on at the next epoch's first step, as in
Transformers, for ``state.num_train_epochs`` epochs in all), ``should_save``, ``should_evaluate`` and
``should_log`` ask for a checkpoint, an evaluation or a metrics.jsonl record after this step. A callback defines
only the events it needs; a ``transformers.TrainerCallback`` subclass works as it is (its other methods are
no-ops). A flag set on one rank acts on all (``CallbackList.agreed``).

Events and their keyword arguments (each also gets ``model``, ``processing_class``, ``optimizer``,
``lr_scheduler``, ``train_dataloader`` and ``eval_dataloader``, as Transformers hands them to every event, where
its method takes them; ``model`` is not DDP's wrapper but the module in it, as Transformers' ``self.model``; a PEFT
model stays one; the loaders are ``data.loaders``'s):
- ``on_train_begin``: ``model``, ``optimizer``, ``plan`` (the strategy), ``info`` (rank, world size, device)
- ``on_epoch_begin``: no arguments (``state.epochs_completed``: the epochs completed before this one)
- ``on_step_begin``: ``micro_batches`` (this rank's collated micro-batches of the step), ``model``, ``optimizer``
- ``on_step_end``: ``stats`` (loss, grad_norm, tokens, target_tokens of the global batch)
- ``on_epoch_end``: no arguments, before the epoch's log, evaluation and checkpoint (also when ``max_steps``
  ends the run inside an epoch, or ``should_epoch_stop`` the epoch, as Transformers calls it)
- ``on_log``: ``logs`` (the record written to metrics.jsonl)
- ``on_evaluate``: ``metrics`` (eval_loss, eval_perplexity, eval_tokens)
- ``on_save``: ``checkpoint`` (the folder just completed)
- ``on_train_end``: ``model``, ``summary`` (the dict written to summary.json; a callback may add keys), ``log`` (a
  function that appends one record to metrics.jsonl and hands it to ``on_log``)

Give them to ``train(cfg, callbacks=[...])``, or name them in the config (``callbacks: [pkg.module:Class]``, a
file's as ``[path/to/hooks.py:Class]``, or ``--callbacks pkg.module:Class,other.module:Other``) so that every
process torchrun starts makes its own: the class is imported and called with no arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from shardtune.dist import all_reduce_sum, lost_peer
from shardtune.errors import TrainingStopped, UsageError, first_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger("shardtune")

EVENTS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_log", "on_evaluate",
          "on_save", "on_train_end")
# Transformers' TrainerCallback events this loop has no place for: a callback that defines one is refused, not left
# waiting for a call that never comes.
NEVER_CALLED = {"on_init_end": "on_train_begin", "on_substep_end": "on_step_end",
                "on_pre_optimizer_step": "on_step_end", "on_optimizer_step": "on_step_end",
                "on_prediction_step": "on_evaluate", "on_predict": "on_evaluate", "on_push_begin": "on_train_end"}


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the loop clears ``should_save``/``should_evaluate``/``should_log`` once
    acted on and as each step begins (as Transformers' handler does), and ``should_epoch_stop`` as each epoch
    begins."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class TrainerCallback:
    """Base class with every event as a no-op (subclassing it is optional: any object with some ``on_*`` works)."""

    def on_train_begin(self, args, state, control, **kwargs) -> None: ...
    def on_epoch_begin(self, args, state, control, **kwargs) -> None: ...
    def on_step_begin(self, args, state, control, **kwargs) -> None: ...
    def on_step_end(self, args, state, control, **kwargs) -> None: ...
    def on_epoch_end(self, args, state, control, **kwargs) -> None: ...
    def on_log(self, args, state, control, **kwargs) -> None: ...
    def on_evaluate(self, args, state, control, **kwargs) -> None: ...
    def on_save(self, args, state, control, **kwargs) -> None: ...
    def on_train_end(self, args, state, control, **kwargs) -> None: ...


def load_callbacks(specs: Sequence[str], given: Sequence[Any] = ()) -> list[Any]:
    """The config's ``callbacks``, then those ``given`` in code, made before the (long) data and model work so a bad
    name stops the run at once. A class given in code is made with no arguments, as Transformers' Trainer makes
    one in its ``callbacks``."""
    return [*(load_callback(spec) for spec in specs),
            *(made(c, c.__qualname__, named=False) if isinstance(c, type) else c for c in given)]


def load_callback(spec: str) -> Any:
    """An instance of the class ``spec`` names (``package.module:Class``), made with no arguments."""
    module_name, sep, class_name = spec.rpartition(":")  # the last colon: a file's path may hold one
    if not sep or not module_name or not class_name:
        raise UsageError(f"callbacks: {spec!r} is not 'package.module:Class'; name an importable class, e.g. "
                         f"mypkg.hooks:StopOnPlateau")
    if module_name.endswith(".py"):
        module = import_file(Path(module_name).expanduser(), spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UsageError(f"callbacks: cannot import {module_name!r} for {spec!r} ({exc}); install it or put its "
                             f"folder on PYTHONPATH (every process torchrun starts imports it)") from None
    cls = getattr(module, class_name, None)
    if cls is None or not callable(cls):
        raise UsageError(f"callbacks: {module_name} has no class {class_name!r} (for {spec!r})")
    return made(cls, spec, named=True)


def made(cls: Any, spec: str, *, named: bool) -> Any:
    """An instance of the callback class ``cls`` (``spec``: as the config or the code gave it), made with no
    arguments; ``named``: by the config, else passed to ``train`` as a class."""
    class_name = getattr(cls, "__name__", spec)
    try:
        return cls()
    except Exception as exc:  # noqa: BLE001 - the user's class: whatever it raised, the run has not started
        why = f"{type(exc).__name__}: {first_line(str(exc))}" if str(exc).strip() else type(exc).__name__
        given = "a callback named in the config" if named else "a callback class passed to train()"
        fix = (f"{given} is made as {class_name}(): give its arguments defaults (or read them from the "
               f"environment), or pass an instance in code (train(cfg, [{class_name}(...)]))"
               if isinstance(exc, TypeError) else f"fix {class_name}.__init__, or leave it out of callbacks")
        raise UsageError(f"callbacks: {spec} failed as it was made, {class_name}() ({why}); {fix}") from None


def import_file(path: Path, spec: str) -> ModuleType:
    """The module a callback's ``path/to/hooks.py:Class`` names, run from its file (relative to the folder the
    command runs in, as every process torchrun starts runs there)."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise UsageError(f"callbacks: {spec!r} names the file {path}, which {what} (from {Path.cwd()}); give the "
                         f"path of your .py file, or an importable module, mypkg.hooks:StopOnPlateau")
    found = importlib.util.spec_from_file_location(path.stem, path)
    assert found is not None and found.loader is not None  # a .py file always has a source loader
    module = importlib.util.module_from_spec(found)
    try:
        found.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - the user's file: whatever it raised, the run has not started
        raise UsageError(f"callbacks: cannot import {path} for {spec!r} ({type(exc).__name__}: "
                         f"{first_line(str(exc))}); fix the file, or leave it out of callbacks") from None
    # under its file's name, where that names no other module (a class pickled or a dataclass in it finds it there)
    sys.modules.setdefault(path.stem, module)
    return module


class CallbackList:
    """Calls an event on every callback in order: those named in the config first, then those passed in code."""

    def __init__(self, callbacks: Sequence[Any], args, state, *, ranks_device: torch.device | None = None,
                 **common: Any) -> None:
        """``ranks_device``: in a job of several processes, the device its collectives run on (None: one)."""
        self.callbacks = list(callbacks)
        self.args, self.state = args, state
        # Transformers hands every event model, processing_class, optimizer, lr_scheduler and the dataloaders: so
        # does this, to an event that takes them (by name or **kwargs), beside the event's own arguments.
        self.common = common
        self.control = TrainerControl()
        for callback in self.callbacks:
            for event, instead in NEVER_CALLED.items():  # first: a class with only these has none of EVENTS
                if own_method(callback, event):
                    raise UsageError(f"callbacks: {type(callback).__name__}.{event} would never be called: shardtune's "
                                     f"loop has no such event; move its code to {instead} (the events: "
                                     f"{', '.join(EVENTS)})")
            if not any(callable(getattr(callback, event, None)) for event in EVENTS):
                raise UsageError(f"callbacks: {type(callback).__name__} has none of the events {', '.join(EVENTS)}")
        # A save, an evaluation and a stop are collectives: a flag one rank's callback set (rank 0's only, or one
        # decided from that rank's own clock) must act on every rank, or they hang or part ways. Where any rank has
        # callbacks, ``agreed`` sets it on all; one collective, after events ran, each time the loop reads the flags.
        self.device = ranks_device if ranks_device is not None and \
            all_reduce_sum([float(len(self.callbacks))], ranks_device)[0].item() > 0 else None
        self.unagreed = False

    def agreed(self) -> TrainerControl:
        """``control``, each flag set on every rank where a callback set it on any (logical OR over the ranks)."""
        if self.unagreed and self.device is not None:
            flags = [field.name for field in fields(self.control)]
            counts = all_reduce_sum([float(getattr(self.control, flag)) for flag in flags], self.device).tolist()
            for flag, count in zip(flags, counts):
                setattr(self.control, flag, count > 0)
        self.unagreed = False
        return self.control

    def __getattr__(self, event: str):
        if event not in EVENTS:
            raise AttributeError(event)

        def call(**kwargs) -> TrainerControl:
            self.unagreed = True  # every rank calls each event at the same point, callbacks or not
            for callback in self.callbacks:
                method = getattr(callback, event, None)
                if method is not None:
                    extra = {key: value for key, value in self.common.items()
                             if key not in kwargs and takes(method, key)}
                    self.run(f"{type(callback).__module__}:{type(callback).__qualname__}.{event}", method,
                             {**kwargs, **extra})
            return self.control

        return call

    def run(self, where: str, method: Any, kwargs: dict[str, Any]) -> None:
        """One callback's event; what it raises is reported naming it (``where``: module:Class.event), not as a
        traceback from inside the loop. A Transformers attribute ``args`` or ``state`` lacks is bad input (exit 2)."""
        try:
            method(self.args, self.state, self.control, **kwargs)
        except (UsageError, TrainingStopped):
            raise
        except Exception as exc:  # noqa: BLE001 - the user's code: whatever it raised, say whose it was
            if lost_peer(exc):  # a collective of the callback's found another rank gone: the loop says which
                raise
            owner = getattr(exc, "obj", None) if isinstance(exc, AttributeError) else None
            if owner is not None and (owner is self.args or owner is self.state):
                raise UsageError(missing_attribute(where, "args" if owner is self.args else "state",
                                                   exc.name)) from None
            # its own frames, below this call: where in the callback it failed
            log.error("%s", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)).rstrip())
            why = f"{type(exc).__name__}: {first_line(str(exc))}" if str(exc).strip() else type(exc).__name__
            raise TrainingStopped(f"callback {where} raised {why} at step {self.state.step} (its traceback is "
                                  f"above); fix it, or leave it out of callbacks") from exc


# Where a Transformers callback finds here what ``TrainingArguments`` or ``TrainerState`` had under a name shardtune's
# args and state do not have.
INSTEAD = {"to_dict": "args.to_flat() (every key by its flat name)",
           "to_sanitized_dict": "args.to_flat() (every key by its flat name)",
           "world_size": "on_train_begin's info.world_size", "process_index": "on_train_begin's info.rank",
           "local_process_index": "on_train_begin's info.local_rank", "local_rank": "on_train_begin's info.local_rank",
           "device": "on_train_begin's info.device"}


def missing_attribute(where: str, holder: str, name: str | None) -> str:
    """One line for a callback that read ``args.<name>`` or ``state.<name>`` (as Transformers' have it) where
    shardtune's have no such thing: what to read instead."""
    origin = "TrainingArguments" if holder == "args" else "TrainerState"
    offered = INSTEAD.get(name or "") or (
        "a key of the run's config by its name (shardtune train --help-keys lists them)" if holder == "args"
        else "one of state.global_step, epoch, max_steps, num_train_epochs, log_history, best_metric, "
             "best_model_checkpoint, num_input_tokens_seen, is_world_process_zero, is_local_process_zero")
    return (f"callbacks: {where} reads {holder}.{name}, which shardtune's {holder} does not have (Transformers' "
            f"{origin} does); use {offered} (docs/callbacks.md)")


def own_method(callback: Any, event: str) -> bool:
    """Whether ``callback`` defines ``event`` itself, not as the no-op a ``transformers.TrainerCallback`` inherits."""
    owner = next((k for k in type(callback).__mro__ if event in vars(k)), None)
    if owner is None:
        return callable(getattr(callback, event, None))  # set on the instance
    return not owner.__module__.startswith("transformers.")


def takes(method: Any, name: str) -> bool:
    """Whether ``method`` accepts the keyword argument ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): give it only its event's arguments
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
