"""The JSON Schema of a recipe, made from the keys' declarations: editors validate and complete recipe YAML with it.

    shardtune config schema > shardtune.schema.json
    # yaml-language-server: $schema=shardtune.schema.json      (a recipe's first line, for VS Code's YAML support)

It holds what a recipe file may say: every key (its type, values, bounds, default and description), the other
tools' names for keys, Accelerate's ``fsdp_config`` and ``deepspeed_config`` blocks and dynamo keys, and the keys
accepted as no-ops. Rules between keys (``validation``) are left to ``shardtune train``, which also reads a choice
in any case: the schema offers the canonical spellings and accepts the others.
"""

from __future__ import annotations

import re
from typing import Any

from shardtune.config.compile import DYNAMO_KEYS
from shardtune.config.keys import Declared
from shardtune.config.loading import KWARGS, kwargs_key
from shardtune.config.no_ops import NO_OPS, TRAINED_TOKEN_KEYS
from shardtune.config.schema import ALIASES, all_keys, published_defaults
from shardtune.config.validation import LORA_INITS

JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _spelled(word: str) -> str:
    """A pattern matching ``word`` in any case (JSON Schema's regular expressions have no flag for it)."""
    return "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else re.escape(c) for c in word)


def _any_case(words: list[str]) -> str:
    """A pattern matching any of ``words`` in any case."""
    return f"^(?:{'|'.join(map(_spelled, words))})$"


def _value_schema(d: Declared) -> dict[str, Any]:
    """One value of ``d`` (one item of a list key)."""
    if not d.choices:
        bounds = {BOUNDS[name]: getattr(d.meta, name) for name in BOUNDS if getattr(d.meta, name) is not None}
        return {"type": JSON_TYPES[d.base], **bounds}
    numbers = [int(word) for word in d.meta.spellings if word.isdigit()]  # FSDP1's sharding numbers
    canonical = {"enum": [*d.choices, *numbers]}
    if d.base is not str:
        return canonical
    words = [str(c) for c in d.choices] + [word for word, meant in d.meta.spellings.items() if meant in d.choices]
    booleans = [{"const": False}] if "FALSE" in d.meta.spellings else []  # YAML's unquoted no (save_strategy: no)
    return {"anyOf": [canonical, {"type": "string", "pattern": _any_case(words)}, *booleans]}


def _literal_values(values: tuple[Any, ...] | None) -> dict[str, Any]:
    """The schema of a value that must be one of ``values`` (booleans, numbers and null as they are, words in any
    case); none where any value goes."""
    if values is None:
        return {}
    words = [v for v in values if isinstance(v, str)]
    scalar = [{"enum": [v for v in values if not isinstance(v, str)]},
              {"type": "string", "pattern": _any_case(words)}]
    nested = [{"type": "array", "items": {"anyOf": scalar}},
              {"type": "object", "additionalProperties": {"anyOf": scalar}}]
    return {"anyOf": [*scalar, *(nested if False in values else [])]}  # off: a list or block of off values too


def key_schema(d: Declared, default: Any) -> dict[str, Any]:
    """The schema of key ``d``: its values, unset where allowed, a list's comma-separated form, its default."""
    one = _value_schema(d)
    if d.is_list or d.meta.commas:
        one = {"anyOf": [{"type": "array", "items": one}, {"type": "string"},
                         *([{"type": "null"}] if d.optional else [])]}
    elif d.optional:
        one = {"anyOf": [one, {"type": "null"}]}
    return {**one, "default": default, "description": d.described()}


def recipe_schema() -> dict[str, Any]:
    """The whole document (draft 2020-12)."""
    cfg = published_defaults()
    keys = {d.name: key_schema(d, getattr(getattr(cfg, d.section), d.name)) for d in all_keys()}
    aliases = {alias: {**keys[key], "description": f"Another name for {key}: {keys[key]['description']}"}
               for alias, key in ALIASES.items()}
    refused = {name: f" Values: {entry.inert.says}; any other is refused." for name, entry in NO_OPS.items()
               if entry.instead}
    accepted = {name: {**_literal_values(entry.inert.values),
                       "description": f"Accepted, changing nothing: {entry.why}.{refused.get(name, '')}"}
                for name, entry in NO_OPS.items()}
    # What train accepts and refuses beyond a key's type (config/validation.py): YAML's true for a folder-or-true
    # key, a PEFT init given as a boolean, max_steps 0, pickled weights.
    for name in ("resume_from_checkpoint", "init_lora_weights"):
        schema = keys[name]
        one = schema.pop("anyOf") if "anyOf" in schema else [{"type": schema.pop("type")}]
        keys[name] = {**schema, "anyOf": [*one, {"type": "boolean"}]}
    named = "|".join(_spelled(init) for init in LORA_INITS if init != "pissa_niter_N")
    keys["init_lora_weights"]["anyOf"][0] |= {"pattern": f"^(?:{named}|{_spelled('pissa_niter_')}[1-9][0-9]*)$"}
    keys["max_steps"] |= {"minimum": -1, "not": {"const": 0}}
    keys["save_safetensors"] |= {"const": True}
    dynamo = {name: {"description": "Accelerate's torch.compile setting, read as torch_compile, torch_compile_backend "
                                    "and torch_compile_mode."} for name in DYNAMO_KEYS}
    # Other spellings of declared keys (loading._transformers_form)
    steps = {k: v for k, v in keys["warmup_steps"].items() if k not in ("type", "minimum")}
    keys["warmup_steps"] = {**steps, "anyOf": [{"type": "integer", "minimum": 0},
                                               {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}]}
    for name, (read, _) in KWARGS.items():
        dynamo[name] = {"type": "object", "properties": {entry: keys[kwargs_key(name, entry)] for entry in read},
                        "additionalProperties": False,
                        "description": f"Transformers' {name}: {', '.join(read)} read as the key of its name."}
    fsdp = {name: schema for name, schema in {**keys, **accepted}.items() if name.startswith("fsdp_")}
    blocks = {"fsdp_config": {"type": "object", "properties": fsdp, "additionalProperties": False,
                              "description": "Accelerate's FSDP block: its keys are read as top-level keys."},
              "deepspeed_config": {"type": "object", "description": "Accelerate's DeepSpeed block, mapped onto FSDP2 "
                                                                    "(docs/deepspeed.md)."}}
    # TRL's assistant_only_loss / completion_only_loss false asks for every token's loss: what train_on_prompt true
    # trains, so false is taken beside it in the same recipe (a rule between keys the schema can say).
    prompt_trained = [{"if": {"properties": {name: {"enum": [False, "false"]}}, "required": [name]},
                       "then": {"properties": {"train_on_prompt": {"enum": [True, "true"]}},
                                "required": ["train_on_prompt"]}} for name in TRAINED_TOKEN_KEYS]
    for name in TRAINED_TOKEN_KEYS:
        accepted[name] = {"anyOf": [accepted[name], {"enum": [False, "false"]}],
                          "description": accepted[name]["description"] + " false: with train_on_prompt true."}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "shardtune recipe",
            "description": "A recipe for shardtune train: flat keys (docs/config.md).", "type": "object",
            "properties": {**keys, **aliases, **dynamo, **blocks, **accepted}, "additionalProperties": False,
            "allOf": prompt_trained}
