"""torch.compile's keys: Transformers' ``torch_compile*`` checked, and Accelerate's ``dynamo_*`` read as them.

Accelerate writes its compile settings as a ``dynamo_config`` block (or, in older files and as ``accelerate launch``
flags, as top-level ``dynamo_backend`` / ``dynamo_mode``). Its backend names are torch's in upper case (INDUCTOR,
AOT_EAGER; NO for off). shardtune always compiles each decoder layer with dynamic shapes (packed lengths vary from
batch to batch), which is what Accelerate's regional compilation does; so ``dynamo_use_regional_compilation`` and
``dynamo_use_dynamic`` are accepted whatever they say, and a full graph (``dynamo_use_fullgraph: true``) is refused.
"""

from __future__ import annotations

from typing import Any

from shardtune.config.keys import Problem
from shardtune.config.no_ops import off
from shardtune.config.schema import RunConfig
from shardtune.errors import closest

# Accelerate's keys that become torch_compile, torch_compile_backend and torch_compile_mode.
DYNAMO_KEYS = ("dynamo_config", "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
               "dynamo_use_regional_compilation")


def dynamo_values(key: str, value: Any) -> tuple[dict[str, Any], list[str]]:
    """``key: value`` of Accelerate as shardtune's run keys, and the problems of a value that cannot run here."""
    if key == "dynamo_config":
        if not isinstance(value, dict):
            return {}, [f"dynamo_config={value!r}: expected a mapping (dynamo_backend: INDUCTOR, ...)"]
        if off(value.get("dynamo_backend", "NO")):
            return {"torch_compile": False}, []
        values: dict[str, Any] = {}
        problems: list[str] = []
        for inner, setting in value.items():
            mapped, refused = dynamo_values(inner, setting) if inner in DYNAMO_KEYS else \
                ({}, [f"dynamo_config.{inner}: not an Accelerate dynamo key; remove it"])
            values.update(mapped)
            problems += refused
        return values, problems
    if key == "dynamo_backend":
        if off(value):
            return {"torch_compile": False}, []
        return {"torch_compile": True, "torch_compile_backend": str(value).strip().lower()}, []
    if key == "dynamo_mode":
        return ({} if off(value) else {"torch_compile_mode": str(value).strip().lower()}), []
    if key == "dynamo_use_fullgraph" and not off(value):
        return {}, [f"dynamo_use_fullgraph={value!r}: shardtune compiles each decoder layer and lets the graph break "
                    f"where it must (FSDP's hooks, PEFT); remove it"]
    return {}, []  # dynamo_use_dynamic, dynamo_use_regional_compilation: what always runs (module docstring)


def normalise_compile(run: RunConfig, *, compile_set: bool) -> None:
    """Transformers' rule: a backend or a mode turns torch_compile on, unless torch_compile itself is set (false
    on the command line over an Accelerate file's backend stays false); inductor unless a backend is named."""
    if (run.torch_compile_backend or run.torch_compile_mode) and not compile_set:
        run.torch_compile = True
    if run.torch_compile and not run.torch_compile_backend:
        run.torch_compile_backend = "inductor"


def compile_problems(run: RunConfig) -> list[Problem]:
    """A backend torch does not know, a mode inductor does not know, or a mode given to another backend."""
    if not run.torch_compile:
        return []
    import torch._dynamo
    import torch._inductor

    problems = []
    backends = torch._dynamo.list_backends(exclude_tags=())  # debugging ones too, and any registered here
    if run.torch_compile_backend not in backends:
        usual = sorted({*torch._dynamo.list_backends(), "eager", "aot_eager"})
        hint = closest(str(run.torch_compile_backend), usual)
        problems.append(Problem("torch_compile_backend", f"torch_compile_backend={run.torch_compile_backend!r} is not "
                                f"a torch.compile backend{f'; did you mean {hint!r}?' if hint else ''} (e.g. "
                                f"{', '.join(usual)})"))
    modes = sorted(torch._inductor.list_mode_options())
    if run.torch_compile_mode is not None and run.torch_compile_mode not in modes:
        problems.append(Problem("torch_compile_mode", f"torch_compile_mode={run.torch_compile_mode!r} is not one of "
                                                      f"{', '.join(modes)}"))
    elif run.torch_compile_mode not in (None, "default") and run.torch_compile_backend != "inductor":
        problems.append(Problem(("torch_compile_mode", "torch_compile_backend"), f"torch_compile_mode="
                                f"{run.torch_compile_mode!r} applies to the inductor backend only, not to "
                                f"{run.torch_compile_backend!r}: leave torch_compile_mode out or use inductor"))
    return problems
