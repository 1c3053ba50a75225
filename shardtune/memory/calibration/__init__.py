"""Published, measured training runs that the time and memory model is checked against (docs/estimator.md).

One YAML file per publisher: ``sources`` (URL, date, and the quoted text that states the setting) and ``points``,
each one measured run: its setup in the estimator's terms, its measured speed or peak memory, the row of the
source the number comes from (``quote``), how it was converted (``conversion``), and which fields the source does
not state and were assumed (``assumed``, explained in ``notes``). ``defaults`` apply to every point of a file.
``load_points()`` reads every file and checks every field, naming the file, the point and the key of a bad one.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from pathlib import Path

import yaml

from shardtune.config.yaml_keys import repeated_keys
from shardtune.errors import UsageError
from shardtune.hardware import GIB, GPUS, INTER_NODE_LINKS, INTRA_NODE_LINKS, Gpu, gpu_from_spec, host_link
from shardtune.memory.compute import ATTENTION_KERNELS, RECOMPUTE, Kernels
from shardtune.memory.inventory import ModelInventory
from shardtune.memory.setup import METHODS, OPTIMIZERS, Setup, validate
from shardtune.memory.timing import Links
from shardtune.strategies import STRATEGIES

FOLDER = Path(__file__).parent
KINDS = ("speed", "memory")
PRECISIONS = {"bf16-amp": ("bf16", False), "bf16-pure": ("bf16", True), "fp16-amp": ("fp16", False)}
COUNTERS = ("reserved", "allocated", "active", "unknown")  # unknown: compared with reserved, the larger
MEASURES = {"tokens_per_s_per_gpu", "tokens_per_s_total", "rows", "seconds", "sequences_per_s", "peak", "unit",
            "counter"}
SPEED_FORMS = ({"tokens_per_s_per_gpu"}, {"tokens_per_s_total"}, {"rows", "seconds"}, {"sequences_per_s"})
UNITS = {"GiB": GIB, "GB": 1e9}
# The strategies a point can name: the published runs are one GPU, DDP and FSDP (each GPU its own rows).
DATA_PARALLEL = tuple(s.name for s in STRATEGIES if not s.splits_layers)
# The attention kernel as the memory estimate's attn_implementation: flash keeps no mask and no scores.
ATTN_IMPLEMENTATION = {"flash": "flash_attention_2", "sdpa-mask": "sdpa", "eager": "eager"}


@dataclass(frozen=True)
class Source:
    id: str
    title: str
    url: str
    published: str
    context: str


@dataclass(frozen=True)
class Point:
    """One published measured run, in the estimator's terms."""

    id: str
    kind: str
    source: Source
    model: str | dict
    gpu: str | dict
    method: str
    precision: str
    micro_batch: int
    seq_len: int
    checkpointing: str
    measured: dict
    quote: str
    strategy: str = "FSDP"  # a data-parallel strategy's name (shardtune/strategies.py)
    num_gpus: int = 1
    num_nodes: int = 1
    grad_accum: int = 1
    sharding: str = "FULL_SHARD"
    offload: bool = False
    separate_root_units: bool = False  # embeddings and head as FSDP2 units (torchtune's custom_sharded_layers)
    activation_offloading: bool = False
    lora_r: int = 8
    lora_targets: str = "all-linear"
    lora_dropout: float = 0.0
    optimizer: str = "adamw_torch"
    interconnect: str | None = None
    inter_node: str | None = None
    attention: str = "flash"
    elementwise: str = "eager"
    loss: str = "full"
    logits_held: bool = False  # the loop keeps the model's output (its fp32 logits) until after backward
    fsdp1_init: bool = False  # FSDP1 wrapped a CPU/meta model (sync_module_states); no empty_cache before the peak
    nf4_stats_whole: bool = False  # the loader left the NF4 quantisation statistics whole on every GPU (Setup's)
    overlap_comm: bool = True
    reduce_bytes: int | None = None
    # False: the run is reported (predicted by the fit on the others) but left out of the speed fit, since its
    # step is bound by something the time model has no term for; ``notes`` must say what.
    fit: bool = True
    conversion: str = ""
    notes: str = ""
    assumed: tuple[str, ...] = ()
    file: str = field(default="", compare=False)

    def setup(self) -> Setup:
        """The estimator's Setup of this run (validated)."""
        mixed, pure = PRECISIONS[self.precision]
        return validate(Setup.of(
            method=self.method, distributed_type=self.strategy, fsdp_sharding_strategy=self.sharding,
            fsdp_offload_params=self.offload, num_gpus=self.num_gpus, num_nodes=self.num_nodes,
            per_device_train_batch_size=self.micro_batch, max_seq_len=self.seq_len,
            gradient_accumulation_steps=self.grad_accum, gradient_checkpointing=self.checkpointing != "none",
            activation_offloading=self.activation_offloading, mixed_precision=mixed,
            torch_dtype="bfloat16" if pure else None, optim=self.optimizer, lora_r=self.lora_r,
            lora_target_modules=self.lora_targets, lora_dropout=self.lora_dropout, loss=self.loss,
            attn_implementation=ATTN_IMPLEMENTATION[self.attention], separate_root_units=self.separate_root_units,
            logits_held=self.logits_held, fsdp1_init_cache=self.fsdp1_init, nf4_stats_whole=self.nf4_stats_whole))

    def kernels(self) -> Kernels:
        return Kernels(attention=self.attention, fused=self.elementwise == "fused", recompute=self.checkpointing,
                       overlap_comm=self.overlap_comm, reduce_bytes=self.reduce_bytes)

    @cached_property
    def card(self) -> Gpu:
        return gpu_from_spec(self.gpu["spec"]) if isinstance(self.gpu, dict) else GPUS[self.gpu]

    def links(self) -> Links:
        card = self.card
        intra = INTRA_NODE_LINKS[self.interconnect or card.interconnect]
        return Links(intra, INTER_NODE_LINKS[self.inter_node or card.inter_node], host_link(card))

    @property
    def world_size(self) -> int:
        return self.num_gpus * self.num_nodes

    def tokens_per_s(self) -> float:
        """Measured trained tokens per second, all GPUs together."""
        m = self.measured
        if "tokens_per_s_per_gpu" in m:
            return m["tokens_per_s_per_gpu"] * self.world_size
        if "rows" in m:
            return m["rows"] * self.seq_len / m["seconds"]
        if "sequences_per_s" in m:
            return m["sequences_per_s"] * self.seq_len
        return m["tokens_per_s_total"]

    def peak_bytes(self) -> float:
        return self.measured["peak"] * UNITS[self.measured["unit"]]

    def model_ref(self) -> str:
        """What ModelAnalysis takes: a catalog name, or the path of a config.json beside the data."""
        if isinstance(self.model, dict):
            return str(FOLDER / self.model["config"])
        return self.model

    def inventory(self) -> ModelInventory:
        if isinstance(self.model, dict) and "family" in self.model:
            return architecture_inventory(self.id, self.model)
        from shardtune.memory.inventory import ModelAnalysis

        return ModelAnalysis(self.model_ref()).inventory

    @property
    def tensors_only(self) -> bool:
        """The source's counter sees tensors only (active or allocated memory), not the allocator's cache."""
        return self.measured["counter"] in ("active", "allocated")

    def formula_peak(self) -> float:
        """The memory formula's peak for this run, as its source's counter sees it (bytes)."""
        from shardtune.memory.inventory import ModelAnalysis
        from shardtune.memory.recommend import evaluate_setup

        breakdown = evaluate_setup(ModelAnalysis(self.model_ref()), self.setup())
        return breakdown.tensors if self.tensors_only else breakdown.total

    def timing_args(self) -> tuple[tuple, dict]:
        """``step_time``'s arguments for this run, less ``params``: built once, timed under many fits."""
        from shardtune.memory.inventory import ModelAnalysis

        setup = self.setup()
        lora = ModelAnalysis(self.model_ref()).lora_of(setup) if setup.uses_lora else None
        return (self.inventory(), setup, self.card, self.links(), lora), {"kernels": self.kernels()}


def architecture_inventory(name: str, arch: dict) -> ModelInventory:
    """A GPT-style model (learned positions, LayerNorm, a plain two-matrix MLP) counted from its shapes: the
    published architectures that are not catalog models (MPT, Megatron's GPT)."""
    h, i, layers, vocab = arch["hidden"], arch["intermediate"], arch["layers"], arch["vocab"]
    bias = arch.get("bias", False)
    linear = 4 * h * h + 2 * h * i
    norm = 2 * h if bias else h  # a LayerNorm's weight, and its bias where the model has biases
    layer = linear + (5 * h + i if bias else 0) + 2 * norm
    embedding, head = vocab * h, 0 if arch["tied"] else vocab * h
    other = arch["positions"] * h + norm
    return ModelInventory(
        name=name, model_type="gpt", parameters=layers * layer + embedding + head + other, num_layers=layers,
        hidden_size=h, intermediate_size=i, num_heads=arch["heads"], num_kv_heads=arch["heads"],
        head_dim=h // arch["heads"], vocab_size=vocab, tied_embeddings=arch["tied"], embedding_params=embedding,
        head_params=head, other_params=other, layer_params=(layer,) * layers, layer_linear_params=(linear,) * layers,
        largest_linear_params=h * i)


def load_points(folder: Path = FOLDER) -> list[Point]:
    """Every point of every YAML file in ``folder``, checked; exit 2 naming the file, point and key of a bad one."""
    points: list[Point] = []
    for path in sorted(folder.glob("*.yaml")):
        if path.name in PROVENANCE_FILES:
            continue
        points += _file_points(path)
    seen: set[str] = set()
    for p in points:
        if p.id in seen:
            raise UsageError(f"{p.file}: point id '{p.id}' is used twice; give each point its own id")
        seen.add(p.id)
    return points


PROVENANCE_FILES = ("cards.yaml", "links.yaml")  # where the hardware table's figures come from, not runs
OWN_RESULTS = "bench/results/"  # shardtune's own measured runs, committed in this repository


def _file_points(path: Path) -> list[Point]:
    where = path.name
    loader = yaml.SafeLoader(path.read_text())
    try:
        node = loader.get_single_node()
        twice = repeated_keys(node)  # plain YAML keeps the last one, silently
        if twice:
            key, lines = twice[0]
            raise UsageError(f"{where}: line {lines[1]}: key {key} given twice")
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    if not isinstance(data, dict) or not {"sources", "points"} <= set(data):
        raise UsageError(f"{where}: needs 'sources' and 'points' (and optionally 'defaults')")
    sources = {s["id"]: _source(s, where) for s in data["sources"]}
    defaults = data.get("defaults") or {}
    return [_point({**defaults, **raw}, sources, where) for raw in data["points"]]


def _source(raw: dict, where: str) -> Source:
    missing = [f.name for f in fields(Source) if not raw.get(f.name)]
    if missing:
        raise UsageError(f"{where}: source {raw.get('id', '?')} lacks {', '.join(missing)}")
    url = str(raw["url"])
    if not (url.startswith("https://") or url.startswith(OWN_RESULTS)):
        raise UsageError(f"{where}: source {raw['id']}: url must be an https:// address, or for shardtune's own "
                         f"measured runs a file under {OWN_RESULTS} (got {url})")
    return Source(**{f.name: str(raw[f.name]) for f in fields(Source)})


_NAMES = {f.name for f in fields(Point)} - {"file"}


def _point(raw: dict, sources: dict[str, Source], where: str) -> Point:
    pid = raw.get("id", "?")
    place = f"{where}: point {pid}"
    unknown = set(raw) - _NAMES
    if unknown:
        raise UsageError(f"{place}: unknown key {', '.join(sorted(unknown))} (known: {', '.join(sorted(_NAMES))})")
    if raw.get("source") not in sources:
        raise UsageError(f"{place}: source '{raw.get('source')}' is none of this file's ({', '.join(sources)})")
    required = [f.name for f in fields(Point) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if raw.get(name) in (None, "")]
    if missing:
        raise UsageError(f"{place}: missing {', '.join(missing)}")
    values = {**raw, "source": sources[raw["source"]], "assumed": tuple(raw.get("assumed", ())), "file": where}
    point = Point(**values)
    _check(point, place)
    return point


def _check(p: Point, place: str) -> None:
    """Every field within its vocabulary; the setup, card and links the estimator will build from them."""
    problems = []
    choices = {"kind": KINDS, "method": METHODS, "precision": tuple(PRECISIONS), "checkpointing": tuple(RECOMPUTE),
               "attention": ATTENTION_KERNELS, "elementwise": ("eager", "fused"), "optimizer": OPTIMIZERS,
               "strategy": DATA_PARALLEL}
    problems += [f"{k}={getattr(p, k)!r} is not one of {', '.join(v)}" for k, v in choices.items()
                 if getattr(p, k) not in v]
    problems += [f"{k}={getattr(p, k)!r} must be a whole number >= 1" for k in
                 ("micro_batch", "seq_len", "num_gpus", "num_nodes", "grad_accum", "lora_r")
                 if not isinstance(getattr(p, k), int) or getattr(p, k) < 1]
    problems += [f"assumed names unknown field {name}" for name in p.assumed if name not in _NAMES]
    if p.fit is not True and not (p.fit is False and p.kind == "speed" and p.notes.strip()):
        problems.append("fit: false is for a speed point, with notes saying why the time model cannot explain it")
    problems += _check_measured(p) + _check_model(p) + _check_hardware(p)
    if problems:
        raise UsageError(f"{place}: {'; '.join(problems)}")
    try:
        p.setup()
    except UsageError as e:
        raise UsageError(f"{place}: {e}") from None


def _check_measured(p: Point) -> list[str]:
    m = p.measured
    if not isinstance(m, dict) or set(m) - MEASURES:
        return [f"measured must be a mapping of {', '.join(sorted(MEASURES))}"]
    if p.kind == "speed":
        if set(m) not in SPEED_FORMS:
            return [f"a speed point measures one of {', '.join('+'.join(sorted(f)) for f in SPEED_FORMS)}"]
    elif set(m) != {"peak", "unit", "counter"} or m["unit"] not in UNITS or m["counter"] not in COUNTERS:
        return [f"a memory point measures peak, unit ({', '.join(UNITS)}) and counter ({', '.join(COUNTERS)})"]
    numbers = [v for k, v in m.items() if k not in ("unit", "counter")]
    return [] if all(isinstance(v, (int, float)) and v > 0 for v in numbers) else ["measured numbers must be > 0"]


def _check_model(p: Point) -> list[str]:
    if isinstance(p.model, str):
        from shardtune import catalog

        return [] if p.model in catalog.names() else [f"model '{p.model}' is not a catalog name"]
    if "config" in p.model:
        return [] if (FOLDER / p.model["config"]).is_file() else [f"no file {p.model['config']} beside the data"]
    keys = {"family", "hidden", "layers", "heads", "intermediate", "vocab", "tied", "positions"}
    if not keys <= set(p.model) or p.model["family"] != "gpt":
        return [f"an architecture model needs family: gpt and {', '.join(sorted(keys - {'family'}))}"]
    if p.method != "full":
        return ["LoRA and QLoRA points need a catalog model or a config file (adapter targets have names)"]
    published = p.model.get("published_parameters")
    if published and architecture_inventory(p.id, p.model).parameters != published:
        return [f"the architecture counts {architecture_inventory(p.id, p.model).parameters:,} parameters, the "
                f"source {published:,}"]
    return []


def _check_hardware(p: Point) -> list[str]:
    try:
        card = p.card
    except (KeyError, UsageError) as e:
        return [f"gpu {p.gpu!r}: {e if isinstance(e, UsageError) else 'not a table card; give {spec: ...}'}"]
    problems = [] if card.peak_flops(PRECISIONS[p.precision][0]) else [f"gpu {card.name} has no peak for {p.precision}"]
    if p.interconnect and p.interconnect not in INTRA_NODE_LINKS:
        problems.append(f"interconnect '{p.interconnect}' is none of {', '.join(INTRA_NODE_LINKS)}")
    if p.inter_node and p.inter_node not in INTER_NODE_LINKS:
        problems.append(f"inter_node '{p.inter_node}' is none of {', '.join(INTER_NODE_LINKS)}")
    if p.num_nodes > 1 and not p.inter_node:
        problems.append("a run over several nodes names its inter_node link")
    return problems
