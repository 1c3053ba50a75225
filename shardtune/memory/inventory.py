"""What a model is made of: exact parameter counts from the real model class built on the meta device.

The model is built with ``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``: no memory, no weights,
but the exact modules transformers would create (so an untied LM head counts, and tied embeddings count once).
LoRA's trainable count applies PEFT's target rules to a table of the model's adaptable weights (lora_count.py);
injecting the adapters with ``get_peft_model`` on meta gives the same number (the tests check it on catalog models),
but importing PEFT and injecting takes ~8 s on 405B where this takes milliseconds.

Where the answer comes from, fastest first: the on-disk cache of an earlier run; for a catalog model, the counts
shipped with the package (catalog_data.py: computed by this same code, and rebuilt and compared by a test); else
the model built on meta (importing torch and transformers costs ~3 s).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

from shardtune import catalog
from shardtune.errors import UsageError
from shardtune.files import cache_root, write_text
from shardtune.gguf_source import GgufFile, find_gguf, load_config, parameter_count
from shardtune.hardware import expert_shape
from shardtune.memory.lora_count import LoraCount, count_lora, linear_names, module_table

__all__ = ["LoraCount", "ModelAnalysis", "ModelInventory", "normalize_targets", "spoken_count"]


def spoken_count(n: int) -> str:
    """A parameter count as people say it: 3.2 M, 8.0 B (not 0.0 B for a tiny model)."""
    for exponent, unit in ((9, "B"), (6, "M"), (3, "k")):
        if n >= 10**exponent:
            return f"{n / 10**exponent:.1f} {unit}"
    return str(n)


@dataclass(frozen=True)
class ModelInventory:
    """Exact parameter counts and the shape facts the activation formula needs."""

    name: str
    model_type: str
    parameters: int
    num_layers: int
    hidden_size: int
    intermediate_size: int  # per expert for mixture-of-experts models
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    embedding_params: int
    head_params: int  # 0 when tied to the embeddings
    other_params: int  # outside the decoder layers, embeddings and head (final norm, ...)
    layer_params: tuple[int, ...]
    layer_linear_params: tuple[int, ...]  # nn.Linear weights per layer: what bitsandbytes quantises for QLoRA
    largest_linear_params: int  # the biggest single weight matrix: QLoRA dequantises one at a time
    num_experts: int = 1
    experts_per_token: int = 1
    fused_qkv: bool = False
    fused_gate_up: bool = False
    norms_per_layer: int = 2
    pre_norms_per_layer: int = 2  # norms whose output feeds a linear layer (saved again as its input)
    norm_upcasts_weight: bool = False  # Gemma's RMSNorm multiplies in fp32 by (1 + weight)
    linear_names: tuple[str, ...] = ()  # short names of the nn.Linear modules of a decoder layer
    # Each decoder layer's sliding attention window in tokens (None: the whole causal row); empty when no layer has
    # one. Mistral v0.1 and Phi-3 window every layer, Gemma 2 and 3 their "sliding_attention" layer_types.
    attention_windows: tuple[int | None, ...] = ()

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def root_params(self) -> int:
        """Parameters outside the decoder layers: FSDP's root unit (embeddings, final norm, head)."""
        return self.embedding_params + self.head_params + self.other_params


def attention_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers runs it: ``layer_types`` names the layers that slide (Gemma 2
    and 3, Qwen2's top layers with use_sliding_window); without it, a ``sliding_window`` slides every layer
    (Mistral v0.1, Phi-3). Empty where no layer slides."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return ()
    types = getattr(config, "layer_types", None)
    windows = tuple(window if kind == "sliding_attention" else None for kind in types) if types else \
        (window,) * num_layers
    return windows if any(windows) else ()


def inventory_from_dict(data: dict, name: str) -> ModelInventory:
    """A ModelInventory from its ``asdict`` form (lists back to tuples), under the display name ``name``."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
    return ModelInventory(**(fields | {"name": name}))


def _read_json(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except UnicodeDecodeError as exc:
        raise UsageError(f"cannot read {path}: not UTF-8 text (byte {exc.start}); point at a model's config.json") \
            from None
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"cannot read {path}: invalid JSON at line {exc.lineno}, column {exc.colno} ({exc.msg}); "
            "fix the file or point at another model."
        ) from None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}.") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path}: holds a JSON {type(config).__name__}, not the object of a model's config "
                         f"(model_type, hidden_size, ...); point at a Hugging Face model folder or its config.json.")
    return config


def load_config_dict(model: str) -> tuple[str, dict]:
    """Resolve MODEL (catalog name or id, local folder, config.json path, GGUF file, or a hub model whose config.json
    the local Hugging Face cache holds) to a display name and a config dict."""
    path = Path(model).expanduser()
    if gguf := find_gguf(path):
        return gguf.path.stem, gguf_config_dict(gguf)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise UsageError(f"{path} has no config.json: point at a Hugging Face model folder or its config.json.")
        return path.name, _read_json(config_path)
    if path.is_file():
        return path.parent.name if path.name == "config.json" else path.stem, _read_json(path)
    if path.suffix == ".json" or model.startswith((".", "/", "~")):
        raise UsageError(f"{model}: no such file or folder.")
    if cached := cached_hub_config(model):
        return model, _read_json(cached)
    return catalog.canonical(model), catalog.load(model)


def cached_hub_config(model: str) -> Path | None:
    """The cached config.json the estimate reads for the hub id ``model``: where it is no catalog model's own name
    or id (the catalog's copy is that config) and the local Hugging Face cache holds it (an instruction-tuned
    variant's own config, then, rather than its catalog base's)."""
    from shardtune.hub import cached_config_file

    if catalog.is_catalog_model(model):
        return None
    return cached_config_file(model)


def gguf_config_dict(gguf: GgufFile) -> dict:
    """The config a GGUF's metadata describes, as config.json would hold it; its parameter count is checked
    against the file's own tensors, so an estimate never counts a model other than the one in the file."""
    config = load_config(gguf)
    config_dict = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "_model_name_or_path")}
    built = build_config(config_dict, gguf.path.name)
    import torch
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        counted = sum(p.numel() for p in AutoModelForCausalLM.from_config(built).parameters())
    if counted != (stored := parameter_count(gguf)):
        raise UsageError(f"{gguf.path}: its config describes {counted:,} parameters but the file holds {stored:,}; "
                         f"the estimate cannot count this architecture from a GGUF: give its config.json instead")
    return config_dict


def build_config(config_dict: dict, name: str):
    """A transformers config object from a config dict, without running any remote code."""
    from transformers import AutoConfig

    model_type = config_dict.get("model_type")
    if not model_type:
        raise UsageError(f"{name}: config.json has no 'model_type' key, so its architecture is unknown.")
    # A deep copy: transformers rewrites nested entries (rope_scaling) in place, and the dict is a cache key.
    kwargs = copy.deepcopy({k: v for k, v in config_dict.items() if k != "model_type"})
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError:
        import transformers

        # transformers' own words list every model type it knows (9,000 characters): the version says it.
        raise UsageError(
            f"{name}: model_type '{model_type}' is not in transformers {transformers.__version__}; upgrade "
            "transformers, or use a model whose architecture transformers ships (no remote code is run)."
        ) from None


def _decoder_layers(model, num_layers: int):
    import torch.nn as nn

    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise UsageError(f"cannot find the {num_layers} decoder layers in {type(model).__name__}.")


class _CountCache:
    """Counts of one config, on disk: building the model needs torch and transformers (~3 s to import); a later
    estimate of the same config reads the numbers instead. Keyed by the config and the transformers version, so a
    transformers upgrade (which can change module layouts) recounts."""

    def __init__(self, config_dict: dict):
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            version = "none"
        blob = json.dumps(config_dict, sort_keys=True) + "|transformers=" + version + "|format=6"
        self.path = cache_root() / "counts" / (hashlib.sha256(blob.encode()).hexdigest()[:24] + ".json")
        try:
            self.data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        try:  # a cache that cannot be written only costs time
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text(self.path, json.dumps(self.data))
        except OSError:
            pass


def trained_vocab_size(model: str, cfg) -> int | None:
    """``len(tokenizer)`` as ``shardtune train`` configures it for ``cfg`` (a named chat template's tokens with
    add_special_tokens, a pad token it adds): the rows train resizes the embeddings to. None where there is no
    tokenizer to read (a catalog name, a bare config.json, a hub id: nothing is downloaded)."""
    facts = tokenizer_facts(model, cfg)
    return facts[0] if facts else None


def tokenizer_facts(model: str, cfg) -> tuple[int, int, tuple[int, ...]] | None:
    """The length, pad id and added token ids (``data.templates.added_token_ids``) of the tokenizer train
    configures for ``cfg``, where ``model`` holds one."""
    from shardtune.hub import TOKENIZER_FILES

    path, data = Path(model).expanduser(), cfg.data
    # A GGUF's tokenizer takes ~10 s to convert: it is read only for a template that adds tokens (the pad token
    # train may add to a GGUF's tokenizer without one is not counted).
    adds = data.chat_template_format != "none" and data.add_special_tokens
    if not ((path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES))
            or (adds and find_gguf(path))):
        return None
    if path.is_dir():  # the tokenizer's loader reads these too, and stops with a traceback or a warning
        from shardtune.hub import damaged_file_problem

        name, config_dict = load_config_dict(model)
        build_config(config_dict, name)
        if problem := damaged_file_problem(path, weights=False):
            raise UsageError(problem)
    return _configured_tokenizer(str(path.resolve()), data.chat_template_format, data.add_special_tokens,
                                 cfg.model.trust_remote_code, data.eos_token)


@functools.lru_cache(maxsize=8)
def _configured_tokenizer(path: str, chat_template_format: str, add_special_tokens: bool,
                          trust_remote_code: bool, eos_token: str | None = None) -> tuple[int, int, tuple[int, ...]]:
    from types import SimpleNamespace

    from shardtune.data import load_tokenizer
    from shardtune.data.templates import added_token_ids

    # (no chat_template_path: a template file adds no token to count)
    data = SimpleNamespace(chat_template_format=chat_template_format, add_special_tokens=add_special_tokens,
                           eos_token=eos_token, chat_template_path=None)
    tokenizer = load_tokenizer(path, data, trust_remote_code=trust_remote_code)
    return len(tokenizer), tokenizer.pad_token_id, tuple(added_token_ids(tokenizer))


def _with_vocab(config_dict: dict, vocab_size: int | None, added: Sequence[int] = ()) -> tuple[dict, int]:
    """``config_dict`` with its vocabulary grown to ``vocab_size`` (train's resize), and the rows train adds as
    new: those it grows, and those of the ``added`` token ids that fall on spare rows the model holds already
    (``train.model.resize_for_tokenizer``)."""
    nested = "vocab_size" not in config_dict and isinstance(config_dict.get("text_config"), dict)
    text = config_dict["text_config"] if nested else config_dict
    old = text.get("vocab_size")
    if not isinstance(old, int):
        return config_dict, 0
    spare = len({token_id for token_id in added if token_id < old})
    if vocab_size is None or vocab_size <= old:
        return config_dict, spare
    grown = {**text, "vocab_size": vocab_size}
    return ({**config_dict, "text_config": grown} if nested else grown), spare + vocab_size - old


def analysis_for(model: str, cfg, **kwargs) -> ModelAnalysis:
    """The analysis of ``model`` as train builds it for the config ``cfg``: at the vocabulary it resizes to."""
    facts = tokenizer_facts(model, cfg)
    return ModelAnalysis(model, vocab_size=facts[0] if facts else None, added_token_ids=facts[2] if facts else (),
                         **kwargs)


class ModelAnalysis:
    """A model built on the meta device, with its inventory and LoRA counts (cached per r and targets).

    ``vocab_size``: the tokenizer's length where train grows the embeddings to it (``trained_vocab_size``): the
    model is counted at that size, and LoRA trains the added rows (PEFT's ``trainable_token_indices``), as train
    does."""

    def __init__(self, model: str, use_cache: bool = True, use_packaged: bool = True, vocab_size: int | None = None,
                 added_token_ids: Sequence[int] = ()):
        self.name, config_dict = load_config_dict(model)
        self.config_dict, self.added_tokens = _with_vocab(config_dict, vocab_size, added_token_ids)
        self.use_packaged = use_packaged
        self._cache = _CountCache(self.config_dict) if use_cache else None
        self._lora_cache: dict[tuple, LoraCount] = {}

    @cached_property
    def config(self):
        return build_config(self.config_dict, self.name)

    @cached_property
    def model(self):
        import torch
        from transformers import AutoModelForCausalLM

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                try:
                    return AutoModelForCausalLM.from_config(self.config)
                except ValueError as exc:
                    raise UsageError(f"{self.name}: transformers cannot build a causal LM from this config "
                                     f"({exc}).") from None

    @cached_property
    def inventory(self) -> ModelInventory:
        cached = self._cache.get("inventory") if self._cache else None
        packaged = None if cached else self._packaged()
        if cached or packaged:
            return inventory_from_dict(cached or packaged["inventory"], self.name)
        inventory = self._count_inventory()
        if self._cache:
            self._cache.put("inventory", asdict(inventory))
        return inventory

    def _count_inventory(self) -> ModelInventory:
        import torch.nn as nn

        model, cfg = self.model, self.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        num_layers = text_cfg.num_hidden_layers
        layers = _decoder_layers(model, num_layers)
        embed = model.get_input_embeddings().weight
        head_module = model.get_output_embeddings()
        head = head_module.weight if head_module is not None else None
        tied = head is None or head is embed
        layer_param_ids = {id(p) for p in layers.parameters()}
        all_params = list(model.parameters())  # de-duplicates tied weights
        parameters = sum(p.numel() for p in all_params)
        head_params = 0 if tied else head.numel()
        other = sum(
            p.numel() for p in all_params if id(p) not in layer_param_ids and p is not embed and p is not head
        )
        layer_params, layer_linear, largest = [], [], 0
        fused_qkv, fused_gate_up, norms = False, False, 0
        for layer in layers:
            layer_params.append(sum(p.numel() for p in layer.parameters()))
            linear = 0
            for name, module in layer.named_modules():
                if isinstance(module, nn.Linear):
                    linear += module.weight.numel()
                    largest = max(largest, module.weight.numel())
                    fused_qkv |= name.endswith("qkv_proj")
                    fused_gate_up |= name.endswith("gate_up_proj")
            layer_linear.append(linear)
        linear_names: list[str] = []
        for name, module in layers[0].named_modules():
            if "norm" in type(module).__name__.lower() and not list(module.children()):
                norms += 1
            short = name.rsplit(".", 1)[-1]
            if isinstance(module, nn.Linear) and short not in linear_names:
                linear_names.append(short)
        # Experts stored as one 3-D tensor (transformers 5) hold one matrix per expert: count the largest too.
        for p in layers[0].parameters():
            if p.dim() == 3:
                largest = max(largest, p[0].numel())
        num_heads = text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // num_heads
        is_gemma = self.config.model_type.startswith("gemma")
        experts, per_token, _ = expert_shape(text_cfg)
        return ModelInventory(
            name=self.name,
            model_type=cfg.model_type,
            parameters=parameters,
            num_layers=num_layers,
            hidden_size=text_cfg.hidden_size,
            intermediate_size=getattr(text_cfg, "moe_intermediate_size", None) or text_cfg.intermediate_size,
            num_heads=num_heads,
            num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text_cfg.vocab_size,
            tied_embeddings=tied,
            embedding_params=embed.numel(),
            head_params=head_params,
            other_params=other,
            layer_params=tuple(layer_params),
            layer_linear_params=tuple(layer_linear),
            largest_linear_params=largest,
            num_experts=experts,
            experts_per_token=per_token,
            fused_qkv=fused_qkv,
            fused_gate_up=fused_gate_up,
            norms_per_layer=norms,
            pre_norms_per_layer=2,
            norm_upcasts_weight=is_gemma,
            linear_names=tuple(linear_names),
            attention_windows=attention_windows(text_cfg, num_layers),
        )

    @cached_property
    def table(self) -> dict:
        """The adaptable weights of the model (lora_count.module_table), from a cache when possible."""
        cached = self._cache.get("table") if self._cache else None
        if cached:
            return cached
        packaged = self._packaged()
        if packaged:
            return packaged["table"]
        table = module_table(self.model, _decoder_layers(self.model, self.inventory.num_layers),
                             self.config.model_type)
        if self._cache:
            self._cache.put("table", table)
        return table

    def lora(self, r: int, target_modules: str | list[str] | tuple[str, ...], *, dora: bool = False,
             modules_to_save: tuple[str, ...] = (), bias: str = "none") -> LoraCount:
        """Trainable parameters of LoRA rank ``r`` on ``target_modules``, matched exactly as PEFT matches them
        (with DoRA's magnitudes, the trained copies of ``modules_to_save`` and the biases PEFT's ``bias``
        trains, see ``count_lora``)."""
        targets = normalize_targets(target_modules)
        key = (r, targets, dora, tuple(modules_to_save), bias)
        if key not in self._lora_cache:
            count = count_lora(self.table, r, targets, self.name, dora=dora,
                               modules_to_save=tuple(modules_to_save), bias=bias)
            tokens = self.added_token_params(tuple(modules_to_save))
            self._lora_cache[key] = replace(count, outside_layers=count.outside_layers + tokens)
        return self._lora_cache[key]

    def added_token_params(self, modules_to_save: tuple[str, ...] = ()) -> int:
        """What the rows train added to the vocabulary train besides the adapters: PEFT's trainable tokens in the
        input embeddings and an untied head (``train.model.added_token_targets``), except in a module trained
        whole (``modules_to_save``), which its copy already counts."""
        if not self.added_tokens:
            return 0
        inv = self.inventory
        width = inv.embedding_params // inv.vocab_size
        names = {row[0] for row in self.table["outside_rows"] if row[1] == "embedding" and row[2] == inv.vocab_size}
        if not inv.tied_embeddings and self.table["output_name"]:
            names.add(self.table["output_name"])
        trained = [name for name in names if name.rsplit(".", 1)[-1] not in modules_to_save]
        return self.added_tokens * width * len(trained)

    def lora_of(self, setup) -> LoraCount | None:
        """The LoRA count of an estimator ``Setup`` (None when it trains no adapters)."""
        if not setup.uses_lora:
            return None
        return self.lora(setup.lora_r, setup.lora_target_modules, dora=setup.use_dora,
                         modules_to_save=setup.lora_modules_to_save, bias=setup.lora_bias)

    def linear_module_names(self) -> list[str]:
        """Distinct short names of the linear layers inside a decoder layer (what LoRA can target)."""
        return linear_names(self.table)

    def _packaged(self) -> dict | None:
        """The catalog's shipped counts for this model, when its config is exactly the catalog's."""
        from shardtune.memory.catalog_data import packaged_counts

        return packaged_counts(self.name, self.config_dict) if self.use_packaged else None


def normalize_targets(target_modules: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'all-linear' or a comma-separated list (or a list) of module names, as a canonical tuple."""
    if isinstance(target_modules, str) and target_modules.strip().startswith("re:"):
        return (target_modules.strip(),)  # one regex (commas belong to it), as train/model.py reads it
    if isinstance(target_modules, str):
        items = [t.strip() for t in target_modules.split(",")]
    else:
        items = [str(t).strip() for t in target_modules]
    items = [t for t in items if t]
    if not items:
        raise UsageError("--lora-target-modules is empty: use all-linear or names such as q_proj,v_proj.")
    if "all-linear" in items:
        return ("all-linear",)
    return tuple(sorted(set(items)))
