"""A GGUF file as the model to train, count, chat with or merge: ``model_name_or_path: model.gguf``.

llama.cpp, Ollama and LM Studio users hold their models as one ``.gguf`` file: weights (often quantized), the
config as llama.cpp metadata keys, the tokenizer and the chat template. transformers reads all of it
(``from_pretrained(folder, gguf_file=name)``) and dequantizes the weights to plain float tensors. This module is
the one place that knows how: which paths are GGUF files, a one-line error for a file that is not one, and the
config, model and tokenizer loaders the trainer, the estimator, generation and merge share.

A leaf: it imports only ``errors``; everyone above may ask it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardtune.errors import UsageError

MAGIC = b"GGUF"
SUFFIX = ".gguf"


@dataclass(frozen=True)
class GgufFile:
    """A GGUF file, as transformers wants it named: the folder and the file name inside it."""

    path: Path  # absolute

    @property
    def folder(self) -> str:
        return str(self.path.parent)

    @property
    def name(self) -> str:
        return self.path.name


def find_gguf(name_or_path: str | Path | None) -> GgufFile | None:
    """The GGUF file ``name_or_path`` names: a ``.gguf`` file, or a folder without config.json or
    adapter_config.json that holds exactly one; None for anything else (a Transformers or PEFT adapter folder, a
    hub name). A ``.gguf`` that is not GGUF, or a folder holding several, is a UsageError naming it."""
    if not name_or_path:
        return None
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
            return None
        found = sorted(p for p in path.glob(f"*{SUFFIX}") if p.is_file())
        if not found:
            return None
        if len(found) > 1:
            raise UsageError(f"{name_or_path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
                             f"give the path of the one to use")
        path = found[0]
    elif not (path.suffix.lower() == SUFFIX and path.is_file()):
        return None
    check_complete(path)
    return GgufFile(path.resolve())


AGAIN = "the download or copy did not finish: download (or export) the .gguf again"


def check_complete(path: Path) -> None:
    """A file named .gguf is refused before any loader reads it unless it starts with GGUF's magic bytes and holds
    everything its header promises: the header itself and every tensor's bytes. A file cut short (an interrupted
    download or copy) would otherwise stop a loader with a parser error that names neither the file nor the cause."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
        stat = path.stat()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror}); check the path and its permissions") from None
    if head != MAGIC:
        raise UsageError(f"{path}: not a GGUF file (it starts with {head!r}, not {MAGIC!r}); the download may be "
                         f"incomplete or the file is of another format: download the .gguf again")
    end = _bytes_promised(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if end is None:
        raise UsageError(f"{path}: truncated GGUF file: its header ends early ({stat.st_size:,} bytes); {AGAIN}")
    if end > stat.st_size:
        raise UsageError(f"{path}: truncated GGUF file: {stat.st_size:,} bytes of the {end:,} its header and "
                         f"tensors need; {AGAIN}")


@functools.lru_cache(maxsize=8)
def _bytes_promised(path: str, size: int, mtime_ns: int) -> int | None:  # noqa: ARG001 - the cache's key
    """Where the file's last tensor ends, as its header says; None when the header itself is cut short. A header
    that parses but that this reader cannot handle (a newer GGUF version, an unknown type) is left to the loaders,
    which say so: 0."""
    import struct

    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:  # transformers before its fast reader: the gguf package's own one
        return _bytes_promised_by_gguf(path)
    try:
        header = GgufHeader.from_file(path)
    except (struct.error, UnicodeDecodeError):
        return None
    except ValueError:
        return 0
    return header.data_start + max((t.offset + t.nbytes for t in header.tensors), default=0)


def _bytes_promised_by_gguf(path: str) -> int | None:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class TensorEnds(GGUFReader):
        """The reader's parse of the header, each tensor's end taken from its header entry: the reader's own views
        of the tensors' bytes would stop a file cut inside them as a cut header does (a reshape ValueError)."""

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            ends = [0]
            for _, _, _, dims, raw_dtype, offset in (field.parts for field in fields):
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                ends.append(start_offs + int(offset[0]) + int(np.prod(dims)) * size // block)
            self.end = max(ends)

    try:
        return TensorEnds(path).end
    except (ValueError, IndexError, KeyError):  # its parser's ways of running off the end of a cut header
        return None


def metadata(source: GgufFile) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """The file's metadata keys (string arrays given as their length) and its tensors' shapes, without reading
    any tensor data (milliseconds, where gguf's GGUFReader parses every token string: seconds)."""
    try:
        from transformers.integrations.gguf.reader import GgufHeader, read_gguf_metadata
    except ImportError:  # transformers before its fast reader: the gguf package's own one
        return _metadata_with_gguf(source)
    meta, _ = read_gguf_metadata(str(source.path))
    header = GgufHeader.from_file(str(source.path))
    return meta, {t.name: tuple(t.shape) for t in header.tensors}


def _metadata_with_gguf(source: GgufFile) -> tuple[dict, dict[str, tuple[int, ...]]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(source.path))
    meta = {}
    for key, field in reader.fields.items():
        value = field.contents()
        meta[key] = len(value) if isinstance(value, list) and value and isinstance(value[0], str) else value
    return meta, {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}


# The tensor in which llama.cpp's Llama graph takes Llama 3's RoPE: the number each rotary frequency is divided by.
ROPE_FREQS = "rope_freqs.weight"
# Tensors of a GGUF that are no model parameter.
NOT_PARAMETERS = (ROPE_FREQS,)


def parameter_count(source: GgufFile) -> int:
    """The number of parameters the file holds, counted from its tensor shapes (a tied head is stored once)."""
    import math

    _, shapes = metadata(source)
    return sum(math.prod(shape) for name, shape in shapes.items() if name not in NOT_PARAMETERS)


def _unsupported(source: GgufFile, exc: Exception) -> UsageError:
    return UsageError(f"{source.path}: transformers cannot load this GGUF ({str(exc).splitlines()[0]}); use a "
                      f"GGUF of an architecture transformers reads (llama, mistral, qwen2, ...) or the original "
                      f"Transformers model folder")


def load_config(source: GgufFile):
    """The transformers config the file's metadata describes, as a plain (unquantized) model's config; a Llama 3
    RoPE, which the file holds as a tensor that transformers' reader passes over, included (``_with_llama3_rope``)."""
    from transformers import AutoConfig

    try:
        with _shared_reader():
            config = AutoConfig.from_pretrained(source.folder, gguf_file=source.name)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise _unsupported(source, exc) from None
    _forget_quantization(config)
    config._name_or_path = str(source.path)
    return _with_llama3_rope(source, config)


def default_inverse_frequencies(theta: float, dim: int):
    """The rotary frequencies of the plain RoPE over ``dim`` dimensions, computed as transformers computes them
    (float32 powers of ``theta``)."""
    import torch

    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _with_llama3_rope(source: GgufFile, config):
    """``config`` with the Llama 3 RoPE (Llama 3.1 to 3.3) that the file's ``rope_freqs`` tensor describes.

    llama.cpp keeps that RoPE as one tensor, the number each plain rotary frequency is divided by, and no metadata;
    transformers' reader skips the tensor, so a Llama 3.1 GGUF loaded as the plain RoPE turned its low frequencies
    up to ``factor`` times faster than it was trained with. The parameters are solved from the tensor (the low
    frequencies' divisor is ``factor``; the smoothed band between fixes the two wavelengths where it starts and
    ends, with Meta's low_freq_factor 1, and high_freq_factor 4 where the band holds one frequency only), then the
    frequencies they give are checked against the tensor: a tensor they do not reproduce is refused in one line."""
    factors = _float_tensor(source, ROPE_FREQS)
    if factors is None:
        return config
    import math

    import torch

    rope = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plain = default_inverse_frequencies(theta, head_dim)
    factors = torch.as_tensor(factors, dtype=torch.float32)
    if config.model_type not in ("llama", "mistral") or factors.shape != plain.shape:
        raise UsageError(f"{source.path}: its {ROPE_FREQS} ({factors.numel()} values) is not a Llama 3 RoPE of this "
                         f"{config.model_type} model ({plain.numel()} rotary frequencies); use the original model "
                         f"folder")
    wavelengths = (2 * math.pi / plain).tolist()
    factor = float(factors.max())
    # the smoothed band: s = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor) in (0, 1)
    band = [(w, (1 / f - 1 / factor) / (1 - 1 / factor)) for w, f in zip(wavelengths, factors.tolist())
            if 1 + 1e-6 < f < factor * (1 - 1e-6)]
    high = 4.0
    if len(band) >= 2:  # s is linear in 1 / wavelength: two points give both ends of the band
        (w1, s1), (w2, s2) = band[0], band[-1]
        slope = (s2 - s1) / (1 / w2 - 1 / w1)
        high = 1 + 1 / (slope / w1 - s1) if slope / w1 != s1 else high
    original, high = band[0][0] * (1 + band[0][1] * (high - 1)) if band else 8192, round(high, 4)
    if abs(original - round(original)) < 1e-3 * original:  # a context length, as configs give it
        original = round(original)
    llama3 = {**rope, "rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": 1.0,
              "high_freq_factor": high, "original_max_position_embeddings": original}
    if not torch.allclose(llama3_frequency_factors(config, llama3), factors, rtol=1e-4):
        raise UsageError(f"{source.path}: its {ROPE_FREQS} holds RoPE frequency divisors that no Llama 3 RoPE "
                         f"gives; transformers cannot run the model as llama.cpp does: use the original model folder")
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = llama3
    else:  # transformers 4
        config.rope_scaling = {k: v for k, v in llama3.items() if k != "rope_theta"}
    return config


def llama3_frequency_factors(config, rope: dict | None = None):
    """What llama.cpp's ``rope_freqs`` holds for a Llama 3 RoPE (rope_type llama3, Llama 3.1 to 3.3): the number
    each plain rotary frequency is divided by (1 for the high ones, ``factor`` for the low ones, smoothly between),
    by transformers' own Llama 3 frequencies for ``config`` (or for the parameters ``rope`` in its place), so that
    llama.cpp turns the queries and keys as the model does. A float32 tensor, one per pair of rotary dimensions."""
    import copy

    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    trial = copy.deepcopy(config)  # transformers standardizes the config's RoPE parameters in place
    if rope is not None and hasattr(trial, "rope_parameters"):
        trial.rope_parameters = dict(rope)
    elif rope is not None:  # transformers 4
        trial.rope_scaling, trial.rope_theta = {k: v for k, v in rope.items() if k != "rope_theta"}, rope["rope_theta"]
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, "cpu")
    theta = (getattr(trial, "rope_parameters", None) or {}).get("rope_theta", getattr(trial, "rope_theta", None))
    plain = default_inverse_frequencies(float(theta), 2 * scaled.numel())
    return plain / scaled.to(plain.dtype)


def _float_tensor(source: GgufFile, name: str):
    """The values of the file's float32 tensor ``name`` (a numpy array), or None when the file has none."""
    import numpy as np

    try:
        from transformers.integrations.gguf.reader import GgufHeader
    except ImportError:  # transformers before its fast reader: the gguf package's own one
        import gguf

        with _shared_reader():
            found = [t for t in gguf.GGUFReader(str(source.path)).tensors if t.name == name]
        return np.array(found[0].data, dtype=np.float32) if found else None
    header = GgufHeader.from_file(str(source.path))
    info = next((t for t in header.tensors if t.name == name), None)
    if info is None:
        return None
    if info.ggml_type != 0:  # GGML_TYPE_F32, as llama.cpp writes it
        raise UsageError(f"{source.path}: its {name} is not float32 (ggml type {info.ggml_type}); use the original "
                         f"model folder")
    return np.fromfile(source.path, dtype=np.float32, count=info.nbytes // 4, offset=header.data_start + info.offset)


def _forget_quantization(config) -> None:
    if hasattr(config, "quantization_config"):
        del config.quantization_config


def load_model(source: GgufFile, **kwargs):
    """The causal LM with the file's weights dequantized to ``kwargs['dtype']`` (float32 by default).

    The weights are plain tensors afterwards, so the GGUF quantization marker is dropped: without that,
    transformers refuses ``save_pretrained`` ("quantized with gguf and is not serializable") and PEFT treats the
    model as quantized. ``name_or_path`` becomes the file's path, which PEFT records as an adapter's base."""
    from transformers import AutoModelForCausalLM, GgufConfig

    kwargs.setdefault("quantization_config", GgufConfig(dequantize=True))
    if ROPE_FREQS in metadata(source)[1]:  # a Llama 3 RoPE, which transformers' reader would pass over
        kwargs.setdefault("config", load_config(source))
    try:
        with _cached_tensor_name_maps(), _shared_reader():
            model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.name, **kwargs)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise _unsupported(source, exc) from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    _forget_quantization(model.config)
    model.is_quantized = False
    model.config._name_or_path = model.name_or_path = str(source.path)
    return model


@contextlib.contextmanager
def _cached_tensor_name_maps() -> Iterator[None]:
    """transformers' GGUF loader asks gguf for the same tensor-name map once per module (about 400 times for a
    30-layer model, 30 ms each: 12 s of a 20 s load of SmolLM2-135M); the map depends only on its arguments, so
    it is built once while the loader runs."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


# The parsed metadata of the last GGUF file read, while a ``parsed_once`` block is open: (key, reader).
_READER: list[tuple[tuple, object]] = []
_OPEN_BLOCKS = [0]


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within this block each GGUF file is parsed once. transformers' loader parses the whole file, every string
    of the vocabulary included, each time it is asked, and the tokenizer, the config and the model each ask
    (three parses of 4 s each for SmolLM2's 49,152 tokens). The parsed reader (about 160 MB of Python objects
    for that file) is dropped when the outermost block closes: a training run does not carry it."""
    _OPEN_BLOCKS[0] += 1
    try:
        yield
    finally:
        _OPEN_BLOCKS[0] -= 1
        if not _OPEN_BLOCKS[0]:
            _READER.clear()


@contextlib.contextmanager
def _shared_reader() -> Iterator[None]:
    """gguf's ``GGUFReader``, as transformers' loader makes it, handed out again for a file unchanged since it
    was parsed (same path, size and modification time) inside a ``parsed_once`` block."""
    import gguf

    original = gguf.GGUFReader

    def reader(path, mode="r"):
        stat = os.stat(path)
        key = (os.path.realpath(path), mode, stat.st_size, stat.st_mtime_ns)
        if not _READER or _READER[0][0] != key:
            _READER[:] = [(key, original(path, mode))]
        return _READER[0][1]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        if not _OPEN_BLOCKS[0]:
            _READER.clear()


def load_tokenizer(source: GgufFile, **kwargs):
    """The tokenizer (vocabulary, merges, special tokens and chat template) the file's metadata holds."""
    from transformers import AutoTokenizer

    try:
        with _shared_reader():
            tokenizer = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.name, **kwargs)
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise UsageError(f"{source.path}: transformers cannot build its tokenizer ({str(exc).splitlines()[0]}); "
                         f"use a GGUF whose tokenizer transformers reads, or the original model folder") from None
    listed = metadata(source)[0].get("tokenizer.ggml.tokens")
    return _only_listed_tokens(tokenizer, listed) if isinstance(listed, int) else tokenizer


def _only_listed_tokens(tokenizer, listed: int):
    """``tokenizer`` without the added tokens past the file's ``listed`` ones that nothing names as special.
    transformers builds a byte-level GGUF vocabulary with GPT2Tokenizer, which adds its default unknown, BOS and EOS
    token, <|endoftext|>, where the file has none (a Llama 3 or shardtune's own export): one token more than the file
    and the model's embeddings hold, for which training grew the embeddings and trained a row, and every merge and
    export carried it."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    named = set(tokenizer.all_special_tokens)
    unlisted = [t for t in spec.get("added_tokens", []) if t["id"] >= listed and t["content"] not in named]
    if not unlisted:
        return tokenizer
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t not in unlisted]
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spec))
    return tokenizer


# general.* keys an export writes for itself (what the new file is), not copied from the file it was made from.
OWN_GENERAL_KEYS = ("general.architecture", "general.type", "general.name", "general.file_type",
                    "general.quantization_version", "general.finetune")


@dataclass(frozen=True)
class Described:
    """What a GGUF says of itself that a model made from it keeps: its general.* description (license,
    organization, languages, ...) as (key, value, gguf value types), and its padding token id."""

    general: tuple[tuple[str, object, tuple], ...]
    pad_token_id: int | None


def described(source: GgufFile) -> Described:
    """The ``general.*`` fields (but ``OWN_GENERAL_KEYS``) and padding id of ``source``; its name is kept as the
    new file's base model. Within ``parsed_once`` the file is not parsed again."""
    import gguf

    with _shared_reader():
        reader = gguf.GGUFReader(str(source.path))
    general = []
    for key, field in reader.fields.items():
        if key.startswith("general.") and key not in OWN_GENERAL_KEYS and not key.startswith("general.base_model"):
            general.append((key, field.contents(), tuple(field.types)))
    for key, base_key in (("general.name", "general.base_model.0.name"),
                          ("general.organization", "general.base_model.0.organization"),
                          ("general.repo_url", "general.base_model.0.repo_url")):
        if key in reader.fields:
            general.append((base_key, reader.fields[key].contents(), tuple(reader.fields[key].types)))
    if any(key.startswith("general.base_model.0.") for key, _, _ in general):
        general.append(("general.base_model.count", 1, (gguf.GGUFValueType.UINT32,)))
    pad = reader.fields.get("tokenizer.ggml.padding_token_id")
    return Described(tuple(general), int(pad.contents()) if pad is not None else None)
