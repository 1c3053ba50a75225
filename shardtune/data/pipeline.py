"""``prepare_datasets``: read, format, tokenise, truncate and pack, once, cached on disk.

The result is keyed by the data (its files' contents, or the hub revision), the tokenizer (its full definition and chat
template), the settings, this package's encoding code and the versions of the libraries that render and tokenise
(``TOKENISING_LIBRARIES``), so a changed input never reuses a stale cache. A cache
entry lists its files' sizes and SHA-256s: one that no longer matches is named in a warning and built again, and
where the cache cannot be written the run keeps the data in memory. Cache files are JSON and Arrow, never pickles. Under
torch.distributed the first process of each node builds it while the others wait on a gloo group with a long timeout
(tokenising a large data set can outlast the collective timeout of the training process group), then all load it;
separate runs sharing a cache folder build one at a time (``_one_builder``), so a sweep tokenises its data once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from shardtune.checksums import sha256_file
from shardtune.config.loading import raise_problems
from shardtune.config.schema import DataConfig
from shardtune.config.validation import data_problems
from shardtune.data.encode import encode_batch, max_token_chars
from shardtune.data.formats import detect_format, to_example
from shardtune.data.readers import BadRow, Source, iter_split, resolve
from shardtune.data.report import DataReport, length_histogram, length_percentiles
from shardtune.data.rows import documents, pack, row_columns
from shardtune.data.templates import end_of_turn_problem
from shardtune.errors import RANK_OWN, UsageError
from shardtune.files import cache_root

CACHE_FORMAT = 2  # 2: a manifest of sizes and SHA-256s
MANIFEST = "manifest.json"
MAX_BAD_NOTES = 3
WAIT_TIMEOUT = timedelta(hours=8)
log = logging.getLogger("shardtune")


@dataclass
class PreparedData:
    """Tokenised splits: ``train[i]`` / ``eval[i]`` are dicts with ``input_ids``, ``labels`` and ``seq_lens``."""

    train: object  # datasets.Dataset, memory-mapped from the cache
    eval: object | None
    report: DataReport
    cache_path: Path | None  # None: the cache could not be written, the rows are in memory
    from_cache: bool

    def cache_note(self) -> str:
        """Whether the rows were tokenised now or read from the cache, and where it is (to delete, or to find)."""
        if self.cache_path is None:
            return "tokenised data: built now and kept in memory (the cache could not be written)"
        if self.from_cache:
            return (f"tokenised data: read from the cache {self.cache_path} (built by an earlier run with the same "
                    "data, tokenizer and data settings)")
        return f"tokenised data: built now and cached in {self.cache_path}"


def default_cache_dir() -> Path:
    return cache_root() / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything in the tokenizer that changes the ids it produces."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps([type(tokenizer).__name__, tokenizer.chat_template, tokenizer.bos_token,
                         tokenizer.eos_token, tokenizer.pad_token], default=str).encode())
    return h.hexdigest()


# The libraries that render chat templates and tokenise: a new version may give other ids for the same text
TOKENISING_LIBRARIES = ("transformers", "tokenizers", "jinja2")


def _code_fingerprint() -> str:
    """This package's encoding code and the versions of the libraries it tokenises with."""
    here = Path(__file__).parent
    h = hashlib.sha256(str(CACHE_FORMAT).encode())
    for name in ("encode.py", "formats.py", "readers.py", "templates.py", "pipeline.py", "rows.py"):
        h.update((here / name).read_bytes())
    for library in TOKENISING_LIBRARIES:
        try:
            h.update(f"{library}={importlib.metadata.version(library)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{library}=none".encode())
    return h.hexdigest()


# Data settings that change no token: how many processes tokenise, and the order the sampler gives the rows in
SAME_TOKENS = ("dataset_num_proc", "group_by_length")


def cache_key(cfg: DataConfig, source: Source, tokenizer, seed: int) -> str:
    settings = {k: v for k, v in asdict(cfg).items() if k not in SAME_TOKENS}
    if source.kind != "hub":  # a local path is keyed by its files' names and contents, not by how it is spelt
        del settings["dataset_name"]
    blob = json.dumps({"settings": settings, "data": source.fingerprint, "tokenizer": tokenizer_fingerprint(tokenizer),
                       "code": _code_fingerprint(), "seed": seed if cfg.eval_split_ratio > 0 else None},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def read_examples(source: Source, splits: list[str], cfg: DataConfig, fmt: str) -> tuple[list[dict], list[str], str]:
    """Canonical examples of ``splits``, the bad rows skipped (a message each) and the format (detected if 'auto')."""
    examples, skipped = [], []
    alpaca_as_chat = cfg.alpaca_as_chat
    for split in splits:
        for where, row in iter_split(source, split, cfg.dataset_config_name):
            try:
                if isinstance(row, BadRow):
                    raise row
                if fmt == "auto":
                    try:
                        fmt = detect_format(row, cfg.dataset_text_field)
                    except UsageError as exc:  # the first row decides: name where it is
                        raise UsageError(f"{where}: {exc}") from None
                examples.append(to_example(row, where, fmt, cfg.dataset_text_field, alpaca_as_chat))
            except BadRow as exc:
                if not cfg.skip_bad_rows:
                    raise UsageError(str(exc)) from None
                skipped.append(str(exc))
    return examples, skipped, fmt


def _tokenise(examples: list[dict], cfg: DataConfig, tokenizer, split: str):
    """``datasets.map`` over the examples, in ``dataset_num_proc`` processes, with a progress bar."""
    import datasets

    raw = datasets.Dataset.from_list(examples)
    ids = datasets.Sequence(datasets.Value("int32"))  # int32 as cached, half of the int64 Arrow would infer
    features = datasets.Features({"input_ids": ids, "labels": ids, "dropped_tokens": datasets.Value("int64"),
                                  "dropped_estimated": datasets.Value("bool"), "bad": datasets.Value("string")})
    return raw.map(encode_batch, batched=True, batch_size=256, num_proc=cfg.dataset_num_proc, features=features,
                   remove_columns=raw.column_names, desc=f"tokenising {split}",
                   fn_kwargs={"tokenizer": tokenizer, "max_seq_len": cfg.max_seq_len,
                              "train_on_prompt": cfg.train_on_prompt, "chat_template_format": cfg.chat_template_format,
                              "token_chars": max_token_chars(tokenizer)},
                   # the result is cached by prepare_datasets; skip hashing the tokenizer for datasets' own cache
                   new_fingerprint=hashlib.sha256(f"{split}{id(raw)}".encode()).hexdigest()[:16])


def skipped_note(problem: str) -> str:
    """A bad row's problem as the note of a run that skips bad rows (without the advice to set skip_bad_rows)."""
    return "skipped " + re.sub(r"(; fix it)?, or set skip_bad_rows true to drop bad rows$", "", problem)


def build_split(examples: list[dict], cfg: DataConfig, tokenizer, split: str, fmt: str, skipped: list[str], *,
                packing: bool | None = None):
    """Tokenise, truncate and (optionally) pack ``examples``: the rows as a ``datasets.Dataset`` and its report.

    ``packing`` (unset: ``cfg.packing``) groups the documents into rows; their tokens follow ``cfg`` alone, so
    eval_packing changes the eval rows' padding, never their loss."""
    packing = cfg.packing if packing is None else packing
    import datasets
    from datasets.table import InMemoryTable

    styles = {"chat template" if e["kind"] == "chat" else "plain text" for e in examples}
    report = DataReport(split=split, data_format=fmt, max_seq_len=cfg.max_seq_len, packing=packing,
                        bad_rows_skipped=len(skipped), notes=[skipped_note(m) for m in skipped],
                        prompt_style=styles.pop() if len(styles) == 1 else "mixed" if styles else "")
    encoded = _tokenise(examples, cfg, tokenizer, split).with_format("arrow")[:]
    docs, bad, counts = documents(encoded, eos_id=tokenizer.eos_token_id, max_seq_len=cfg.max_seq_len,
                                  append_eos=cfg.packing and cfg.append_concat_token)
    del encoded
    if bad and not cfg.skip_bad_rows:
        raise UsageError(bad[0])
    report.bad_rows_skipped += len(bad)
    report.notes += [skipped_note(b) for b in bad[:MAX_BAD_NOTES]]
    for name, count in counts.items():
        setattr(report, name, count)
    lengths = docs.lengths.tolist()
    report.documents = len(lengths)
    report.tokens = sum(lengths)
    report.target_tokens = docs.targets
    report.length_histogram = length_histogram(lengths, cfg.max_seq_len)
    report.length_percentiles = length_percentiles(lengths)
    groups = pack(lengths, cfg.max_seq_len) if packing else [[i] for i in range(len(lengths))]
    table, report.rows_sha256 = row_columns(docs, groups)
    report.rows = len(groups)
    if packing and groups:
        report.packing_efficiency = report.tokens / (report.rows * cfg.max_seq_len)
    if report.bad_rows_skipped > MAX_BAD_NOTES:  # the first few show what is wrong; the count says how much
        more = report.bad_rows_skipped - MAX_BAD_NOTES
        report.notes = report.notes[:MAX_BAD_NOTES] + [f"... and {more} more bad rows skipped"]
    if report.truncated_rows:
        about = "about " if report.estimated_rows else ""
        report.notes.append(f"{report.truncated_rows} rows were longer than max_seq_len {cfg.max_seq_len} and "
                            f"lost {about}{report.dropped_tokens} tokens; raise max_seq_len to keep them.")
    # the rows' digest is their fingerprint: without one, `datasets` pickles the whole table to hash it
    return datasets.Dataset(InMemoryTable(table), fingerprint=report.rows_sha256[:16]), report


def _build(cfg: DataConfig, source: Source, tokenizer, seed: int) -> PreparedData:
    """Read, tokenise and pack every split, in memory."""
    train_examples, skipped, fmt = read_examples(source, cfg.train_split_names(), cfg, cfg.data_format)
    # each split's first row decides its format (with data_format auto), as TRL prepares each data set apart
    eval_examples, eval_skipped, eval_fmt = read_examples(source, cfg.eval_split_names(), cfg, cfg.data_format)
    notes = [f"{', '.join(source.left_out)} left out: named after a split that splits ({cfg.splits}) does not "
             f"list; add it there to read it"] if source.left_out else []
    held_out = not eval_examples and cfg.eval_split_ratio > 0 and bool(train_examples)
    if held_out:
        order = list(range(len(train_examples)))
        random.Random(seed).shuffle(order)
        held = set(order[:cfg.rows_held_out(len(order))])
        eval_examples = [e for i, e in enumerate(train_examples) if i in held]
        train_examples = [e for i, e in enumerate(train_examples) if i not in held]
        notes.append(f"eval split: {len(eval_examples)} rows held out of train (eval_split_ratio "
                     f"{cfg.eval_split_ratio}, seed {seed}).")
    elif not eval_examples and cfg.eval_split_names():
        notes.append(f"no eval rows in split(s) {', '.join(cfg.eval_split_names())}; set eval_split_ratio to hold "
                     "some out of train.")
    elif eval_examples and cfg.eval_split_ratio > 0:
        notes.append(f"eval_split_ratio {cfg.eval_split_ratio} holds nothing out: split(s) "
                     f"{', '.join(cfg.eval_split_names())} give the eval rows (splits train alone would hold them "
                     f"out of train instead).")
    if not train_examples and held_out:
        raise UsageError(f"dataset_name '{cfg.dataset_name}': eval_split_ratio {cfg.eval_split_ratio} held out all "
                         f"{len(eval_examples)} row(s), leaving none to train on; lower it, or give more rows.")
    if not train_examples:
        raise UsageError(f"dataset_name '{cfg.dataset_name}': no training rows in split(s) "
                         f"{', '.join(cfg.train_split_names())} (empty data set, or every row skipped as bad); "
                         "check the file and the splits setting.")
    if any(e["kind"] == "chat" for e in train_examples[:1]) and not tokenizer.chat_template:
        raise UsageError(f"dataset_name '{cfg.dataset_name}' holds conversations but the tokenizer has no chat "
                         "template: set chat_template_format (chatml, llama-3, mistral, alpaca, zephyr).")
    train, report = build_split(train_examples, cfg, tokenizer, "train", fmt, skipped)
    if report.documents == 0:
        raise UsageError(f"dataset_name '{cfg.dataset_name}': no row has a target token left (all prompts, or "
                         f"replies truncated away at max_seq_len {cfg.max_seq_len}); raise max_seq_len or check "
                         "the data.")
    report.notes += notes
    evaluation = None
    if eval_examples:
        evaluation, report.eval = build_split(eval_examples, cfg, tokenizer, "eval", fmt if held_out else eval_fmt,
                                              eval_skipped, packing=cfg.eval_packing)
        if not report.eval.documents:
            evaluation = None
    return PreparedData(train=train, eval=evaluation, report=report, cache_path=None, from_cache=False)


# The temporary folders ``_save`` writes an entry into: .KEY.HOST.PID.RANDOM.tmp (and .old for the one it replaces)
_WRITING = re.compile(r"^\.[0-9a-f]{32}\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(tmp|old)$")


def _remove_leftovers(root: Path) -> None:
    """Remove the temporary folders of cache writes on this machine whose process is gone. A write killed mid-way
    (the OOM killer, a preempted node, kill -9) never reaches its cleanup, and its hidden folder, as big as the
    tokenised data, would stay in the cache for good; a live process's write (another run's) is left alone."""
    from shardtune.dist import process_state

    host = socket.gethostname()
    for entry in root.glob(".*"):
        if (match := _WRITING.match(entry.name)) and match["host"] == host \
                and process_state(int(match["pid"])) != "running":
            shutil.rmtree(entry, ignore_errors=True)


def _save(data: PreparedData, path: Path, *, replace: bool) -> bool:
    """Write ``data`` as the cache entry ``path``, whole or not at all, and ``replace`` a damaged one there.

    Returns False, after one warning, when the cache cannot be written (a read-only or full disk): the run goes on
    with the data in memory. The manifest, written last, holds every file's size and SHA-256 for ``_damage``.
    """
    tmp = path.parent / f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    old = tmp.with_suffix(".old")
    _remove_leftovers(path.parent)
    try:
        tmp.mkdir(parents=True)
        data.train.save_to_disk(str(tmp / "train"))
        if data.eval is not None:
            data.eval.save_to_disk(str(tmp / "eval"))
        (tmp / "report.json").write_text(json.dumps(data.report.to_dict(), indent=1))
        files = {f.relative_to(tmp).as_posix(): [f.stat().st_size, sha256_file(f)]
                 for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(files, indent=1))
        if replace:
            os.rename(path, old)
        try:
            os.rename(tmp, path)  # atomic: a reader sees a complete cache or none
        except OSError:
            if not (path / MANIFEST).exists():  # else another process wrote the same entry first
                raise
    except OSError as exc:
        log.warning("cannot write the tokenised data cache in %s (%s): this run keeps the data in memory and the "
                    "next one tokenises it again; make the folder writable, or point SHARDTUNE_CACHE (data "
                    "inspect: --cache_dir) at a writable one", path.parent, exc, extra=RANK_OWN)
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return True


def _damage(path: Path) -> str | None:
    """What is wrong with the cache entry ``path``, or None when every file is as it was written: a disk that
    filled up, a copy cut short or a stray write must make it tokenise again, not train on wrong tokens."""
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())
        entries = [(path / name, int(size), str(digest)) for name, (size, digest) in files.items()]
    except FileNotFoundError:
        return f"{manifest} is missing"
    except (OSError, ValueError, TypeError, AttributeError) as exc:  # garbage: not JSON, or not the manifest's shape
        return f"{manifest} is unreadable ({type(exc).__name__})"
    for file, size, digest in entries:
        try:
            actual = file.stat().st_size
        except OSError:
            return f"{file} is missing"
        if actual != size:
            return f"{file} has {actual} bytes, {size} were written"
        if sha256_file(file) != digest:
            return f"{file} differs from what was written (SHA-256)"
    return None


def _load(path: Path, from_cache: bool) -> PreparedData:
    import datasets

    report = DataReport.from_dict(json.loads((path / "report.json").read_text()))
    train = datasets.load_from_disk(str(path / "train"))
    evaluation = datasets.load_from_disk(str(path / "eval")) if (path / "eval").exists() else None
    return PreparedData(train=train, eval=evaluation, report=report, cache_path=path, from_cache=from_cache)


@contextlib.contextmanager
def _one_builder(root: Path) -> Iterator[None]:
    """Build in the cache ``root`` one run at a time: runs started together on one machine (a sweep) each tokenised
    the same data beside the others, as much memory each, and wrote it N times; the later ones now wait, then read
    what the first wrote. A lock on the folder itself (flock: dropped when its process ends, however it ends)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
    except OSError:  # a cache that cannot be made: nothing will be written to wait for
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another run that is tokenising data into %s (it may be this data)", root)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock: build without waiting
            pass
        yield
    finally:
        os.close(fd)  # drops the lock


def prepare_datasets(cfg: DataConfig, tokenizer, *, seed: int, cache_dir: str | None = None) -> PreparedData:
    """Tokenised (and packed) train/eval rows of ``cfg.dataset_name``, built once and cached."""
    raise_problems(data_problems(cfg))
    if problem := end_of_turn_problem(tokenizer, cfg):
        raise UsageError(problem)
    root = Path(cache_dir) if cache_dir else default_cache_dir()

    def source() -> Source:
        return resolve(cfg.dataset_name, [s.strip() for s in cfg.splits.split(",") if s.strip()],
                       cfg.dataset_config_name)

    def find_or_build() -> tuple[str, PreparedData | None]:
        """(the whole cache entry, or "" when it cannot be written; the data when built here)."""
        src = source()
        path = root / cache_key(cfg, src, tokenizer, seed)
        with _one_builder(root):
            damage = _damage(path) if path.exists() else "absent"
            if damage is None:
                return str(path), None
            if damage != "absent":
                log.warning("the tokenised data cache is damaged: %s; tokenising the data again", damage,
                            extra=RANK_OWN)
            data = _build(cfg, src, tokenizer, seed)
            return (str(path) if _save(data, path, replace=damage != "absent") else ""), data

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        found, data = find_or_build()
        return _load(Path(found), from_cache=data is None) if found else data
    from shardtune.dist import RankFailed, long_wait_group, run_and_share

    # one builder per node (the cache may be node-local) hashes the data and builds; the others wait for its verdict
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    data = None

    def build() -> str:
        nonlocal data
        found, data = find_or_build()
        return found

    def build_here() -> None:  # this node's cache could not be written: its other ranks tokenise too
        nonlocal data
        data = _build(cfg, source(), tokenizer, seed)

    try:
        group = long_wait_group(WAIT_TIMEOUT)  # tokenising may outlast the default group's timeout
        paths = run_and_share(build, runs=local_rank == 0, what="preparing the data", group=group)
        # torchrun numbers the ranks of a node contiguously: this node's builder is rank - local_rank
        found = paths[rank - local_rank]
        if "" in paths:  # every rank takes part (a collective), so none trains while others still tokenise
            run_and_share(build_here, runs=not found and data is None, what="preparing the data", group=group)
    except RankFailed as exc:
        if exc.kind == "UsageError":  # bad data: every rank reports the builder's own message
            raise UsageError(exc.message) from None
        raise
    return _load(Path(found), from_cache=data is None) if found else data
