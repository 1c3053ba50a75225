"""LoRA's trainable parameters, counted from a table of the model's adaptable weights by PEFT's own target rules.

The table lists every module and parameter LoRA can wrap, with its shape: ``nn.Linear`` and ``nn.Embedding``
modules, and (transformers 5) the 3-D expert tensors and router weights of mixture-of-experts layers; and every
bias, which ``lora_bias`` may train. It is built once from the model on the meta device (``module_table``) and is
plain data, so counting needs neither torch nor PEFT: the catalog ships it (shardtune/memory/catalog_counts.json),
and tests/test_estimate_catalog_data.py checks that the counts equal ``get_peft_model`` injected on meta.

The rules are PEFT's (peft 0.21):
- ``all-linear`` is every ``nn.Linear`` except the output head (tuners_utils._maybe_include_all_linear_layers);
- a listed name matches a module whose full name equals it or ends with ``.name`` (check_target_module_exists);
- an adapter of rank r adds A (r x in) and B (out x r) (Hu et al. 2021, sec. 4);
- transformers 5 fused Mixtral's experts into 3-D tensors; PEFT maps the transformers-4 names onto them
  (utils/transformers_weight_conversion.py, ``_MOE_TARGET_MODULE_MAPPING``): ``w1`` and ``w3`` onto
  ``gate_up_proj`` at rank 2r (both must be targeted), ``w2`` onto ``down_proj``, ``gate`` onto the router's
  weight, and ``all-linear`` onto all of them; the same for the model types transformers converts by qwen2_moe's
  names (qwen3_moe, olmoe, ...: ``moe_family``). A 3-D tensor of E experts gets A (E*r x in) and B (out x E*r);
- ``bias`` (lora_bias) trains base parameters too (tuners_utils._mark_only_adapters_as_trainable): ``all`` every
  parameter named ``bias`` or ending in ``.bias``, norms' included; ``lora_only`` the ``bias`` of each module that
  carries an adapter. A module of ``modules_to_save`` trains its copy, bias and all, never its original.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardtune.config.keys import Problem
from shardtune.errors import UsageError
from shardtune.moe import MOE_FUSED, MOE_TARGETS, moe_dora_problem, moe_family
from shardtune.peft_names import did_you_mean, saves_module, targets_module, unmatched


@dataclass(frozen=True)
class LoraCount:
    """Trainable LoRA parameters, split the way the memory formula needs them."""

    r: int
    target_modules: tuple[str, ...]
    per_layer: tuple[int, ...]  # trained inside each decoder layer: adapters, copies, the base's trained biases
    outside_layers: int  # trained outside the decoder stack (e.g. lm_head's adapter if targeted)
    # The base model's own biases that train (lora_bias), counted in per_layer and outside_layers too: they are
    # held in the trainable dtype instead of the frozen one, and add nothing to the model's parameters.
    bias_per_layer: tuple[int, ...] = ()
    bias_outside: int = 0

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.outside_layers

    def layer_bias(self, i: int) -> int:
        """The base's trained biases in decoder layer ``i``."""
        return self.bias_per_layer[i] if self.bias_per_layer else 0


def module_table(model, layers, model_type: str) -> dict:
    """The adaptable weights of ``model`` (built on meta) as plain data: see the module docstring.

    Rows are ``[name, kind, dim_in, dim_out, experts]`` with kind ``linear``, ``embedding``, ``param`` (a tensor
    PEFT wraps as a parameter; a 3-D expert tensor has ``experts`` > 1 and its last two dims) or ``bias`` (a
    parameter PEFT's ``bias`` option trains, named ``bias`` or ``*.bias``: its size is ``dim_in``, ``dim_out`` is
    1). Decoder-layer rows are stored once, relative to the layer, when every layer has the same rows.
    """
    import torch.nn as nn

    prefix = next(name for name, module in model.named_modules() if module is layers) + "."
    output = model.get_output_embeddings()
    output_name = next((n for n, m in model.named_modules() if m is output), None) if output is not None else None
    family = moe_family(model_type)
    moe_params = set(MOE_TARGETS.get(family, {}).values())
    rows: list[list] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            rows.append([name, "linear", module.in_features, module.out_features, 1])
        elif isinstance(module, nn.Embedding):
            rows.append([name, "embedding", module.num_embeddings, module.embedding_dim, 1])
        else:
            for pname, p in module.named_parameters(recurse=False):
                full = f"{name}.{pname}"
                if any(full.endswith("." + t) for t in moe_params):
                    experts, d1, d2 = (p.shape[0], p.shape[1], p.shape[2]) if p.dim() == 3 else (1, p.shape[1],
                                                                                                p.shape[0])
                    rows.append([full, "param", int(d1), int(d2), int(experts)])
    rows += [[name, "bias", p.numel(), 1, 1] for name, p in model.named_parameters()
             if name == "bias" or name.endswith(".bias")]
    per_layer: list[list[list]] = [[] for _ in layers]
    outside: list[list] = []
    for row in rows:
        index, _, relative = row[0][len(prefix):].partition(".") if row[0].startswith(prefix) else ("", "", "")
        if index.isdigit():
            per_layer[int(index)].append([relative, *row[1:]])
        else:
            outside.append(row)
    uniform = all(r == per_layer[0] for r in per_layer)
    return {"layers_prefix": prefix, "num_layers": len(layers), "output_name": output_name,
            "model_type": model_type, "moe_family": family, "outside_rows": outside,
            "layer_rows": per_layer[0] if uniform else per_layer, "uniform": uniform}


def _layer_rows(table: dict, i: int) -> list[list]:
    return table["layer_rows"] if table["uniform"] else table["layer_rows"][i]


def _moe_targets(table: dict, targets: tuple[str, ...]) -> dict[str, int]:
    """PEFT's MoE remapping: parameter short name -> rank multiplier, for the targets that name MoE weights."""
    mapping = MOE_TARGETS.get(table["moe_family"], {})
    if not mapping:
        return {}
    named = set(mapping) if targets == ("all-linear",) else {t for t in targets if t in mapping}
    out: dict[str, int] = {}
    for old in named:
        out[mapping[old]] = 1
    for fused, members in MOE_FUSED.get(table["moe_family"], {}).items():
        present = [m for m in members if m in named]
        if 0 < len(present) < len(members):
            raise UsageError(f"--lora-target-modules names {', '.join(present)} but not "
                             f"{', '.join(m for m in members if m not in present)}: they are fused into one "
                             f"'{fused}' tensor, so target all of {', '.join(members)} or none.")
        if present:
            out[fused] = len(members)
    return out


def _matches(full_name: str, kind: str, targets: tuple[str, ...], output_name: str | None) -> bool:
    if targets == ("all-linear",):
        return kind == "linear" and full_name != output_name
    if kind not in ("linear", "embedding"):
        return False
    if len(targets) == 1 and targets[0].startswith("re:"):  # the trainer's regex form: PEFT full-matches it
        return re.fullmatch(targets[0][3:], full_name) is not None
    return any(targets_module(full_name, t) for t in targets)


def count_lora(table: dict, r: int, targets: tuple[str, ...], model_name: str, *, dora: bool = False,
               modules_to_save: tuple[str, ...] = (), bias: str = "none") -> LoraCount:
    """Trainable parameters of LoRA rank ``r`` on ``targets`` for the model described by ``table``.

    ``dora``: each adapted linear or embedding also trains a magnitude per output feature (PEFT's
    ``lora_magnitude_vector``). ``modules_to_save``: PEFT trains a full copy of each module whose name ends with
    one of these (``ModulesToSaveWrapper``), beside the frozen original. ``bias``: PEFT's (none, all, lora_only),
    which of the base's biases train.
    """
    if dora and (problem := moe_dora_problem(table["model_type"], table["moe_family"], targets)):
        raise UsageError(Problem(("use_dora", "lora_target_modules"), problem))
    moe = _moe_targets(table, targets)
    saved = _saved_rows(table, modules_to_save)
    _refuse_unmatched_names(table, targets, model_name)

    def added(full_name: str, row: list, biases: dict[str, int]) -> int:
        _, kind, d_in, d_out, experts = row
        if kind == "bias":
            return 0
        if full_name in saved:
            return d_in * d_out + biases.get(full_name, 0)
        if kind == "param":
            times = next((n for t, n in moe.items() if full_name.endswith("." + t)), 0)
            return r * times * experts * (d_in + d_out)
        if not _matches(full_name, kind, targets, table["output_name"]):
            return 0
        return r * (d_in + d_out) + (d_out if dora else 0)

    def scope(rows: list[tuple[str, list]]) -> tuple[int, int, int]:
        """(adapters and copies, trained biases, modules adapted) of one decoder layer's rows, or of those outside
        the layers."""
        biases = {name.rpartition(".")[0]: row[2] for name, row in rows if row[1] == "bias"}  # by their module
        adapters, adapted = 0, set()
        for name, row in rows:
            count = added(name, row, biases)
            adapters += count
            if count and name not in saved:  # the module that holds a wrapped tensor carries its adapter
                adapted.add(name.rpartition(".")[0] if row[1] == "param" else name)
        if bias == "all":  # a saved module's original stays frozen; its copy's bias trains with the copy
            return adapters, sum(n for module, n in biases.items() if module not in saved), len(adapted)
        if bias == "lora_only":
            return adapters, sum(biases.get(module, 0) for module in adapted), len(adapted)
        return adapters, 0, len(adapted)

    prefix = table["layers_prefix"]
    layers = [scope([(f"{prefix}{i}.{row[0]}", row) for row in _layer_rows(table, i)])
              for i in range(table["num_layers"])]
    outside = scope([(row[0], row) for row in table["outside_rows"]])
    if sum(adapted for _, _, adapted in layers) + outside[2] == 0:
        if saved and any(_matches(name, kind, targets, table["output_name"])
                         for name, kind in _named_kinds(table) if name in saved):
            # PEFT leaves a module it trains whole unadapted, and refuses a config that adapts nothing.
            raise UsageError(Problem(("lora_target_modules", "lora_modules_to_save"),
                f"lora_target_modules {','.join(targets)}: every module it names is also in lora_modules_to_save "
                f"({','.join(modules_to_save)}), trained whole, so PEFT adapts none and refuses the job; target "
                f"other modules too (e.g. all-linear) or leave them out of lora_modules_to_save"))
        raise UsageError(Problem("lora_target_modules",
            f"lora_target_modules {','.join(targets)} matches no linear layer of {model_name}; "
            f"use all-linear or names such as {', '.join(linear_names(table)[:6])}."
        ))
    return LoraCount(r=r, target_modules=targets,
                     per_layer=tuple(adapters + trained for adapters, trained, _ in layers),
                     outside_layers=outside[0] + outside[1], bias_per_layer=tuple(trained for _, trained, _ in layers),
                     bias_outside=outside[1])


def _refuse_unmatched_names(table: dict, targets: tuple[str, ...], model_name: str) -> None:
    """A listed target that names no linear layer or embedding of the model (a typo among q_proj,v_porj; a module
    PEFT cannot adapt, such as qwen2_moe's router 'gate'): refused, as train refuses it, where PEFT would adapt
    the other names alone or refuse the model."""
    if targets == ("all-linear",) or (len(targets) == 1 and targets[0].startswith("re:")):
        return
    mapped = MOE_TARGETS.get(table["moe_family"], {})  # transformers-4 expert names PEFT maps onto tensors
    names = [name for name, kind in _named_kinds(table) if kind in ("linear", "embedding")]
    missing = unmatched([t for t in targets if t not in mapped], names)
    if missing and len(missing) < len(targets):  # none matching at all is said below, with the names to use
        raise UsageError(Problem("lora_target_modules",
            f"lora_target_modules {','.join(targets)}: no linear layer of {model_name} is named {', '.join(missing)}"
            + did_you_mean(missing, linear_names(table))
            + "; give the names of the model's linear layers (e.g. q_proj,v_proj), all-linear or re:<regex>"))


def _named_kinds(table: dict) -> list[tuple[str, str]]:
    """(full name, kind) of every row of the table."""
    prefix = table["layers_prefix"]
    rows = [(row[0], row[1]) for row in table["outside_rows"]]
    for i in range(table["num_layers"]):
        rows += [(f"{prefix}{i}.{row[0]}", row[1]) for row in _layer_rows(table, i)]
    return rows


def _saved_rows(table: dict, modules_to_save: tuple[str, ...]) -> set[str]:
    """Full names of the table's modules that ``modules_to_save`` names (PEFT: the name ends with the entry)."""
    if not modules_to_save:
        return set()
    prefix = table["layers_prefix"]
    names = [row[0] for row in table["outside_rows"] if row[1] != "bias"]
    for i in range(table["num_layers"]):
        names += [f"{prefix}{i}.{row[0]}" for row in _layer_rows(table, i) if row[1] != "bias"]
    found = {n for n in names if any(saves_module(n, m) for m in modules_to_save)}
    missing = unmatched(modules_to_save, found, saved=True)
    if missing:
        raise UsageError(f"lora_modules_to_save {','.join(missing)}: the estimator counts linear and embedding "
                         f"modules only, and no such module has that name (e.g. lm_head, embed_tokens); use "
                         f"--trace for any other module")
    return found


def linear_names(table: dict) -> list[str]:
    """Distinct short names of the linear layers inside a decoder layer (what LoRA can target)."""
    names: list[str] = []
    for row in _layer_rows(table, 0):
        short = row[0].rsplit(".", 1)[-1]
        if row[1] == "linear" and short not in names:
            names.append(short)
    return names
