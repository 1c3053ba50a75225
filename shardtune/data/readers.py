"""Readers: local JSONL / JSON / Parquet / CSV files (each also gzip, bz2 or xz compressed) and folders, saved
``datasets`` folders, and hub names.

Every row comes out as ``(where, row)``: ``where`` names the file and line (or row) so that an error points the user
at the exact place to fix.
"""

from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import hashlib
import io
import json
import logging
import lzma
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.errors import UsageError, first_line
from shardtune.hub import COMPRESSIONS, EXTENSIONS, data_file_kind, looks_like_local_path

log = logging.getLogger("shardtune")

SKIP_HINT = "fix it, or set skip_bad_rows true to drop bad rows"
# iconv's source encoding is a guess: Windows tools write cp1252, the commonest encoding that is not UTF-8
REENCODE = "re-encode the file as UTF-8 (e.g. iconv -f cp1252 -t utf-8 IN > OUT)"
UTF8_HINT = f"{REENCODE}, or set skip_bad_rows true to drop bad rows"
# bytes that are not UTF-8, as errors="surrogateescape" decodes them: valid UTF-8 never decodes to these
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")


class BadRow(Exception):
    """One malformed row: raised by readers and formatters, counted or reported by the caller."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where, self.problem = where, problem


@dataclass
class Source:
    """Where the rows of every split come from, and a fingerprint that changes when they change."""

    kind: str  # files | saved | hub
    name: str
    split_files: dict[str, list[Path]] = field(default_factory=dict)  # kind == files
    fingerprint: str = ""
    left_out: tuple[str, ...] = ()  # files named after a split, or a saved DatasetDict's splits, not in splits


def json_error(exc: json.JSONDecodeError) -> str:
    """What is wrong and where, in the row: json's own message ("Invalid control character at") names no place."""
    if exc.msg.startswith("Unterminated string"):  # most often a line or file cut short (a copy or a disk full)
        return f"the string at column {exc.colno} is never closed: is the line cut short?"
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


# The words that name a split in a file or folder name, as `datasets` reads a local folder (its
# data_files.py keywords): what load_dataset(folder), and so a TRL script, takes for each split.
SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
               "test": ("test", "testing", "eval", "evaluation")}
# The split names data sets use: a file named after one of them that the splits key leaves out is left out on
# purpose (splits train beside a test.jsonl).
SPLIT_NAMES = tuple(word for words in SPLIT_WORDS.values() for word in words)


def _saved_splits(path: Path) -> list[str]:
    """The splits of a saved ``DatasetDict`` (none for a saved single ``Dataset``, which every train split reads)."""
    try:
        return [str(s) for s in json.loads((path / "dataset_dict.json").read_text())["splits"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _split_of(rel: Path, split_names: list[str]) -> str | None:
    """The split a file in a folder belongs to: train.jsonl, train-00000.parquet and train/part.jsonl are 'train';
    as for `datasets`, so are training.jsonl and sums_train.jsonl (a split's word between non-letters), and
    dev.jsonl is 'validation' (or whichever of its words ``split_names`` lists)."""
    parts = rel.with_suffix("").parts
    for part in parts:
        for name in split_names:
            if part == name or part.startswith((name + "-", name + "_", name + ".")):
                return name
    for part in parts:
        words = {word.lower() for word in re.split(r"[-._ 0-9]+", part) if word}
        for name in split_names:
            family = next((group for group in SPLIT_WORDS.values() if name.lower() in group), (name.lower(),))
            if words & set(family):
                return name
    return None


def _unnamed_files_problem(dataset_name: str, root: Path, unnamed: list[Path], split_names: list[str]) -> str:
    """A folder whose files are named after splits, but not all of them: which ones no split reads, and how to have
    them read."""
    names = [str(f.relative_to(root)) for f in unnamed]
    train = next((s for s in split_names if "train" in s), "train")
    fix = (f"name each file after its split ({', '.join(f'{s}.jsonl' for s in split_names)}; {train}-00001.jsonl "
           f"counts too)")
    return (f"dataset_name '{dataset_name}': {', '.join(names[:5])}{' ...' if len(names) > 5 else ''} "
            f"{'is' if len(names) == 1 else 'are'} named after none of the splits ({', '.join(split_names)}), while "
            f"the folder's other files are, so no split would read {'it' if len(names) == 1 else 'them'}; {fix}, or "
            f"move {'it' if len(names) == 1 else 'them'} out of the folder")


def _content_fingerprint(files: list[Path], root: Path) -> str:
    # contents, not times: a copied or rewritten but identical file keeps its cache (one builder per node hashes)
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f"{f.relative_to(root) if f != root else f.name}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def resolve(dataset_name: str, split_names: list[str], config_name: str | None = None) -> Source:
    """Find what ``dataset_name`` is (file, folder, saved data set or hub name) without reading its rows."""
    path = Path(dataset_name).expanduser()
    train_name = next((s for s in split_names if "train" in s), "train")
    if path.is_file():
        if data_file_kind(path) is None:
            raise UsageError(f"dataset_name '{dataset_name}': unsupported file type '{path.suffix}'; use "
                             f"{', '.join(EXTENSIONS)} (each may end in {', '.join(COMPRESSIONS)} too) or a folder "
                             f"of them.")
        return Source("files", dataset_name, {train_name: [path]}, _content_fingerprint([path], path))
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if _is_saved_dataset(path):
            return Source("saved", dataset_name, fingerprint=_content_fingerprint(files, path),
                          left_out=tuple(s for s in _saved_splits(path) if s not in split_names))
        data_files = [p for p in files if data_file_kind(p) is not None]
        if not data_files:
            raise UsageError(f"dataset_name '{dataset_name}': the folder holds no {', '.join(EXTENSIONS)} files and "
                             "is not a saved `datasets` folder.")
        # a file kept beside its compressed copy (or two copies) would train its rows twice
        plain = set(data_files)
        if twin := next((p for p in data_files if p.suffix.lower() in COMPRESSIONS and p.with_suffix("") in plain),
                        None):
            raise UsageError(f"dataset_name '{dataset_name}': the folder holds both {twin.with_suffix('').name} and "
                             f"{twin.name}, whose rows would train twice if they are copies; move one out of the "
                             f"folder.")
        split_files: dict[str, list[Path]] = {}
        unnamed: list[Path] = []
        other_splits: list[str] = []
        for f in data_files:
            split = _split_of(f.relative_to(path), split_names)
            if split is not None:
                split_files.setdefault(split, []).append(f)
            elif _split_of(f.relative_to(path), list(SPLIT_NAMES)) is None:
                unnamed.append(f)
            else:  # another split's file, left out on purpose (or by a splits key that forgot it: said)
                other_splits.append(str(f.relative_to(path)))
        if not split_files:  # files not named after splits: all of them train
            split_files = {train_name: data_files}
        elif unnamed:  # read by no split: refused rather than left out without a word
            raise UsageError(_unnamed_files_problem(dataset_name, path, unnamed, split_names))
        return Source("files", dataset_name, split_files, _content_fingerprint(data_files, path),
                      tuple(other_splits) if split_files != {train_name: data_files} else ())
    if looks_like_local_path(dataset_name):
        raise UsageError(f"dataset_name '{dataset_name}' does not exist: check the path.")
    # 'out/nodata' where ./out is a folder is a mistyped path, not an organisation on the hub.
    owner = dataset_name.split("/", 1)[0]
    if "/" in dataset_name and Path(owner).is_dir():
        raise UsageError(f"dataset_name '{dataset_name}' does not exist: check the path ('{owner}' is a local "
                         f"folder, so the name is read as a path, not a hub data set).")
    # A hub name: fingerprinted by the commit it resolves to now, so a new upload is tokenised again (the
    # `datasets` library caches the download itself).
    revision = hub_revision(dataset_name)
    return Source("hub", dataset_name, fingerprint=f"hub:{dataset_name}:{config_name}:{revision or 'unknown'}")


def hub_revision(name: str) -> str | None:
    """The commit sha the hub data set ``name`` points at, or None offline (then the cache is keyed by the name, and
    a warning says so)."""
    from shardtune.hub import offline_already

    if offline_already():
        sha = None
    else:
        try:
            from huggingface_hub import HfApi

            sha = HfApi().dataset_info(name, timeout=10).sha
        except Exception:  # noqa: BLE001 - no network, no such repo (load_dataset reports that), no auth
            sha = None
    if sha is None:
        log.warning(
            "dataset %s: cannot read its current revision from the hub; its tokenised cache is keyed by the name "
            "alone and will not notice a new upload (delete the cache folder to rebuild)", name)
    return sha


_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # one per COMPRESSIONS suffix


def _open_bytes(path: Path):
    """``path`` opened for reading its bytes, decompressed where its name ends in one of ``COMPRESSIONS``."""
    return _OPENERS.get(path.suffix.lower(), open)(path, "rb")


def iter_file(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    """Rows of one file as (where, row); a malformed row is yielded as a BadRow, not raised, so it can be skipped."""
    if path.suffix.lower() not in COMPRESSIONS:
        yield from _iter_rows(path)
        return
    try:
        yield from _iter_rows(path)
    except (OSError, EOFError, lzma.LZMAError) as exc:  # not compressed as its name says, or cut short
        raise UsageError(f"{path}: cannot decompress it as {path.suffix.lower()[1:]} "
                         f"({first_line(str(exc), type(exc).__name__)}); the file is damaged or not compressed as its "
                         f"name says: check it (e.g. gzip -t), or give it uncompressed.") from exc


def _iter_rows(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    kind = data_file_kind(path)
    if kind != "parquet":
        with _open_bytes(path) as f:
            head = f.read(2)
        if head in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):  # every line would be 'not UTF-8', or garbage
            raise UsageError(f"{path}: the file is UTF-16 text (it begins with UTF-16's byte-order mark, as Windows "
                             f"PowerShell's > and Out-File write), not UTF-8; re-encode it as UTF-8 (e.g. iconv -f "
                             f"utf-16 -t utf-8 IN > OUT, or Out-File -Encoding utf8).")
    if kind == "jsonl":
        yield from _iter_jsonl(path)
    elif kind == "json":
        yield from _iter_json(path)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        try:
            if path.suffix.lower() in COMPRESSIONS:
                with _open_bytes(path) as f:
                    table = pq.read_table(io.BytesIO(f.read()))
            else:
                table = pq.read_table(path)
        except Exception as exc:
            raise UsageError(f"{path}: not a readable Parquet file ({exc}).") from exc
        for i, row in enumerate(table.to_pylist()):
            yield f"{path} row {i + 1}", without_arrow_padding(row)
    else:
        yield from _iter_csv(path, delimiter="\t" if kind == "tsv" else ",")


def without_arrow_padding(row: dict) -> dict:
    """A row read from an Arrow table (Parquet, a saved or hub data set) without the nulls Arrow pads tool calls and
    tool definitions with: a column holds one struct type, so every call's arguments get the keys of all the
    others' (search(query) comes back as {"city": null, "query": ...}), every tool the fields of all the others, and
    every row's chat_template_kwargs the variables of all the others'.
    The template would write them out, a call's as a target. A null the data meant cannot be told from padding
    there; a JSON file's rows keep theirs."""
    out = dict(row)
    for key, value in row.items():
        if (key == "tools" and isinstance(value, list)) or (key == "chat_template_kwargs" and isinstance(value, dict)):
            out[key] = _without_nulls(value)
        elif isinstance(value, list) and any(isinstance(m, dict) and m.get("tool_calls") for m in value):
            out[key] = [{**m, "tool_calls": _without_nulls(m["tool_calls"])}
                        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list) else m for m in value]
    return out


def _without_nulls(value):
    """``value`` without the keys, at any depth, whose value is null (a list's null items stay: they are data)."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _not_utf8(line: bytes, start: int) -> str:
    """The first byte of ``line`` that is not UTF-8 (at ``start``, from UnicodeDecodeError) and its column, in
    characters as an editor counts them: everything before it decodes."""
    column = len(line[:start].decode("utf-8").removeprefix("\ufeff")) + 1  # a file's byte-order mark shows as nothing
    return f"not valid UTF-8 (byte 0x{line[start]:02x} at column {column})"


# The longest CSV cell read: csv's own limit, 128 KiB, refuses the long documents (a book, a code file) that
# load_dataset, through pandas, reads; this is the most a 32-bit C long holds.
CSV_FIELD_CHARS = 2**31 - 1


def _iter_csv(path: Path, delimiter: str) -> Iterator[tuple[str, dict | BadRow]]:
    csv.field_size_limit(max(csv.field_size_limit(), CSV_FIELD_CHARS))  # process-wide: only ever raised
    # csv reads in blocks, not lines: the bytes that are not UTF-8 are kept as escapes and looked for in each row
    # utf-8-sig: a byte-order mark (Excel writes one) is dropped, not read into the first column's name
    with io.TextIOWrapper(_open_bytes(path), newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        if reader.fieldnames and any(_ESCAPED_BYTE.search(name) for name in reader.fieldnames):
            raise UsageError(f"{path}:1: the header is not valid UTF-8; {REENCODE}.")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or any(v is None for v in row.values()):
                yield where, BadRow(where, f"has a different number of fields than the header "
                                           f"{reader.fieldnames}; {SKIP_HINT}")
                continue
            bad = next(((k, m) for k, v in row.items() if (m := _ESCAPED_BYTE.search(v))), None)
            if bad:
                key, match = bad
                byte = ord(match.group()) - 0xdc00
                yield where, BadRow(where, f"not valid UTF-8 (byte 0x{byte:02x} in the field '{key}'); {UTF8_HINT}")
                continue
            yield where, row


def _iter_jsonl(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    # bytes, decoded line by line: a byte that is not UTF-8 is then one bad row with its line number, not a
    # traceback from the middle of the file (and costs nothing next to json.loads)
    with _open_bytes(path) as f:
        first = True
        for line_no, raw in enumerate(f, 1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadRow(where, f"{_not_utf8(raw, exc.start)}; {UTF8_HINT}")
                continue
            if line_no == 1:
                line = line.removeprefix("\ufeff")  # the byte-order mark Windows editors write
            if not line.strip():
                continue
            unfinished = False  # a value that goes on past its line: the file may be one JSON document
            try:
                row = json.loads(line.rstrip("\r\n"))  # a line cut short then ends in its string, not in a newline
            except json.JSONDecodeError as exc:
                row = BadRow(where, f"malformed JSON ({json_error(exc)}); {SKIP_HINT}")
                unfinished = exc.pos >= len(line.rstrip())
            # read whole only then (not for a typo inside a line): a big file's bad first line costs no more
            if first and (isinstance(row, list) or unfinished) and (whole := _json_document_rows(path)) is not None:
                yield from whole  # not JSON lines, but rows as json.dump writes them: `datasets` reads those too
                return
            first = False
            if isinstance(row, BadRow):
                yield where, row
                continue
            if not isinstance(row, dict):
                yield where, BadRow(where, f"a row must be a JSON object, got {type(row).__name__}; {SKIP_HINT}")
                continue
            yield where, row


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _json_document_rows(path: Path) -> list[tuple[str, dict | BadRow]] | None:
    """The rows of a JSON-lines file whose first row is not one line: a JSON list of rows (``json.dump(rows)``) or
    objects written one after another over several lines each (``json.dump(row, indent=2)``). `datasets`, and so a
    TRL script, reads both from a .jsonl file. None when the file is neither: its lines are then reported."""
    with _open_bytes(path) as f:
        try:
            text = f.read().decode("utf-8").removeprefix("\ufeff")
        except UnicodeDecodeError:
            return None
    decoder, values, at, line_no, counted = json.JSONDecoder(), [], 0, 1, 0
    while (at := _JSON_SPACE.match(text, at).end()) < len(text):
        try:
            value, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as exc:
            if not values and text[at] == "[":  # a list of rows, broken somewhere: where, not its first line
                raise UsageError(f"{path}:{exc.lineno}: malformed JSON ({json_error(exc)}); fix the file.") from None
            return None
        line_no, counted = line_no + text.count("\n", counted, at), at
        values.append((f"{path}:{line_no}", value))
        at = end
    if len(values) == 1 and isinstance(values[0][1], list):
        return list(_list_rows(path, values[0][1]))
    return values if values and all(isinstance(value, dict) for _, value in values) else None


def _iter_json(path: Path) -> Iterator[tuple[str, dict | BadRow]]:
    with _open_bytes(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # the byte-order mark Windows tools write, as datasets reads
    except UnicodeDecodeError as exc:
        if _is_json_lines(raw):  # JSON lines saved as .json: the bad line can be skipped
            yield from _iter_jsonl(path)
            return
        line_start = raw.rfind(b"\n", 0, exc.start) + 1
        line_no = raw.count(b"\n", 0, line_start) + 1
        raise UsageError(f"{path}:{line_no}: {_not_utf8(raw[line_start:], exc.start - line_start)}; {REENCODE}.") \
            from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # JSON lines saved as .json
            yield from _iter_jsonl(path)
            return
        raise UsageError(f"{path}:{exc.lineno}: malformed JSON ({json_error(exc)}); fix the file.") \
            from exc
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise UsageError(f"{path}: a JSON file must hold a list of rows (or an object with one list of rows); "
                             "write one JSON object per row.")
        data = lists[0]
    if not isinstance(data, list):
        raise UsageError(f"{path}: a JSON file must hold a list of rows, got {type(data).__name__}.")
    yield from _list_rows(path, data)


def _list_rows(path: Path, rows: list) -> Iterator[tuple[str, dict | BadRow]]:
    """A JSON list's rows as (where, row), each by its place in the list; an item that is no object a BadRow."""
    for i, row in enumerate(rows):
        where = f"{path} row {i + 1}"
        yield where, row if isinstance(row, dict) else BadRow(where, f"a row must be a JSON object; {SKIP_HINT}")


def _is_json_lines(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8", errors="replace").removeprefix("\ufeff"))
    except json.JSONDecodeError as exc:
        return exc.msg == "Extra data"
    return False


def iter_split(source: Source, split: str, config_name: str | None = None) -> Iterator[tuple[str, dict | BadRow]]:
    """Rows of one split, or nothing when the source has no such split."""
    if source.kind == "files":
        for f in source.split_files.get(split, []):
            yield from iter_file(f)
        return
    import datasets

    if source.kind == "saved":
        loaded = datasets.load_from_disk(source.name)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                return
            loaded = loaded[split]
        elif "train" not in split:
            return
    else:
        try:
            loaded = datasets.load_dataset(source.name, config_name, split=split)
        except ValueError as exc:
            if "split" in str(exc).lower():
                return
            raise UsageError(f"dataset_name '{source.name}': {str(exc).splitlines()[0]}") from exc
        except OSError as exc:  # FileNotFoundError: no such data set; ConnectionError: hub offline or unreachable
            raise UsageError(f"dataset_name '{source.name}' is neither a local path nor a reachable hub data set "
                             f"({first_line(str(exc), type(exc).__name__)}); give a local file or folder, or check "
                             f"the hub name and the network.") from exc
    for i, row in enumerate(loaded):
        yield f"{source.name}[{split}] row {i + 1}", without_arrow_padding(row)
