"""Bad data and a bad cache end in one line, not a traceback: bytes that are not UTF-8, a cache folder that cannot be
written, a damaged cache entry; and a huge row is cut before tokenising without changing a single kept token."""

import json
import os

import pytest

from shardtune.data import DataConfig, load_tokenizer, prepare_datasets
from shardtune.data.encode import IGNORE, encode_batch, max_token_chars
from shardtune.data.formats import to_example
from shardtune.errors import UsageError
from shardtune.testing.tiny import make_model_folder, sample_corpus

ROWS = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(4)]
FIX = "re-encode the file as UTF-8 (e.g. iconv -f cp1252 -t utf-8 IN > OUT)"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_model_folder(tmp_path_factory.mktemp("tiny") / "model", num_layers=1))


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir, DataConfig())


def prepare(model_dir, path, cache, **settings):
    cfg = DataConfig(dataset_name=str(path), splits="train", **settings)
    return prepare_datasets(cfg, load_tokenizer(model_dir, cfg), seed=0, cache_dir=str(cache))


def jsonl(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


# a line with a non-ASCII character before the bad byte: the column counts characters, as an editor does
BAD_LINE = '{"prompt": "naïve '.encode() + b"caf\xe9" + b'", "completion": " yes"}\n'
BAD_COLUMN = len('{"prompt": "naïve caf') + 1


def test_invalid_utf8_names_file_line_column_and_fix(model_dir, tmp_path, capsys):
    from shardtune.cli import main

    path = tmp_path / "latin1.jsonl"
    path.write_bytes(jsonl(ROWS[:1]) + b"\n" + BAD_LINE + jsonl(ROWS[1:]))  # line 2 blank, line 3 bad
    expected = (f"{path}:3: not valid UTF-8 (byte 0xe9 at column {BAD_COLUMN}); {FIX}, or set skip_bad_rows true "
                "to drop bad rows")
    with pytest.raises(UsageError) as exc:
        prepare(model_dir, path, tmp_path / "cache")
    assert str(exc.value) == expected
    rc = main(["data", "inspect", str(path), "--model_name_or_path", model_dir, "--splits", "train",
               "--cache_dir", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == [f"shardtune data inspect: error: {expected}"]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # nothing half-written


def test_skip_bad_rows_skips_the_invalid_utf8_line_and_reports_it(model_dir, tmp_path):
    path = tmp_path / "mixed.jsonl"
    # a byte-order mark on line 1 (Windows editors write one) is not a bad row
    path.write_bytes(b"\xef\xbb\xbf" + jsonl(ROWS[:2]) + BAD_LINE + jsonl(ROWS[2:]))
    data = prepare(model_dir, path, tmp_path / "cache", skip_bad_rows=True)
    assert data.report.bad_rows_skipped == 1 and data.report.documents == 4 and len(data.train) == 4
    # skip_bad_rows is true here: the note does not advise setting it
    assert data.report.notes[0] == f"skipped {path}:3: not valid UTF-8 (byte 0xe9 at column {BAD_COLUMN}); {FIX}"
    clean = tmp_path / "clean.jsonl"
    clean.write_bytes(jsonl(ROWS))
    assert data.train.to_list() == prepare(model_dir, clean, tmp_path / "cache").train.to_list()


def test_invalid_utf8_in_json_and_csv_files(model_dir, tmp_path):
    path = tmp_path / "rows.json"
    path.write_bytes(b'[{"prompt": "a", "completion": "b"},\n {"prompt": "caf\xe9", "completion": "c"}]\n')
    with pytest.raises(UsageError) as exc:
        prepare(model_dir, path, tmp_path / "cache")
    column = len(' {"prompt": "caf') + 1  # line 2 starts with a space
    assert str(exc.value) == f"{path}:2: not valid UTF-8 (byte 0xe9 at column {column}); {FIX}."
    lines_as_json = tmp_path / "lines.json"  # JSON lines saved as .json: read, and skipped, line by line
    lines_as_json.write_bytes(jsonl(ROWS[:1]) + BAD_LINE)
    data = prepare(model_dir, lines_as_json, tmp_path / "cache", skip_bad_rows=True)
    assert data.report.documents == 1 and f"{lines_as_json}:2: not valid UTF-8 (byte 0xe9" in data.report.notes[0]
    csv_path = tmp_path / "rows.csv"
    csv_path.write_bytes(b"prompt,completion\nQ1,A1\nQ2,caf\xe9\nQ3,A3\n")
    with pytest.raises(UsageError) as exc:
        prepare(model_dir, csv_path, tmp_path / "cache")
    assert str(exc.value) == (f"{csv_path}:3: not valid UTF-8 (byte 0xe9 in the field 'completion'); {FIX}, or set "
                              "skip_bad_rows true to drop bad rows")
    assert prepare(model_dir, csv_path, tmp_path / "cache", skip_bad_rows=True).report.documents == 2


def test_a_csv_with_a_byte_order_mark_reads_as_one_without(model_dir, tmp_path):
    """Excel writes a byte-order mark before the header; it was read into the first column's name, and the file
    was refused as having no known columns."""
    plain, marked = tmp_path / "plain.csv", tmp_path / "marked.csv"
    plain.write_bytes(b"prompt,completion\nQ1,A1\nQ2,A2\n")
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert (prepare(model_dir, marked, tmp_path / "cache").train.to_list()
            == prepare(model_dir, plain, tmp_path / "cache").train.to_list())


def _entry(cache):
    (entry,) = [p for p in cache.iterdir()]
    return entry


@pytest.mark.parametrize("damage", ["truncated", "garbage", "manifest"])
def test_damaged_cache_is_named_and_rebuilt(model_dir, tmp_path, caplog, damage):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    cache = tmp_path / "cache"
    rows = prepare(model_dir, path, cache).train.to_list()  # read now: the dataset maps the file it damages next
    entry = _entry(cache)
    arrow = entry / "train" / "data-00000-of-00001.arrow"
    size = arrow.stat().st_size
    if damage == "truncated":
        arrow.write_bytes(arrow.read_bytes()[:100])
        problem = f"{arrow} has 100 bytes, {size} were written"
    elif damage == "garbage":  # same size, other bytes: only the checksum sees it
        with arrow.open("r+b") as f:
            f.seek(size - 64)
            f.write(b"\xff" * 8)
        problem = f"{arrow} differs from what was written (SHA-256)"
    else:
        (entry / "manifest.json").write_bytes(b"\x00garbage")
        problem = f"{entry / 'manifest.json'} is unreadable (JSONDecodeError)"
    with caplog.at_level("WARNING", logger="shardtune"):
        again = prepare(model_dir, path, cache)
    assert [r.getMessage() for r in caplog.records] == [
        f"the tokenised data cache is damaged: {problem}; tokenising the data again"]
    assert not again.from_cache and again.train.to_list() == rows
    assert [p.name for p in cache.iterdir()] == [entry.name]  # replaced in place, no temporary folder left
    third = prepare(model_dir, path, cache)
    assert third.from_cache and third.train.to_list() == rows


# A process that writes the cache entry and stops inside the write: killed there (die), held there (hold), or
# slowed there for 3 s (slow). The first two run as on a file system without flock, where runs do not wait.
_WRITER = """
import errno, fcntl, os, signal, sys, time
from shardtune.data import DataConfig, load_tokenizer, pipeline
data, model, cache, how = sys.argv[1:]
if how != "slow":
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = no_flock
digest, slowed = pipeline.sha256_file, []
def stop(f):
    if how == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0 if slowed else 600 if how == "hold" else 3)
    slowed.append(f)
    return digest(f)
pipeline.sha256_file = stop
cfg = DataConfig(dataset_name=data, splits="train")
pipeline.prepare_datasets(cfg, load_tokenizer(model, cfg), seed=0, cache_dir=cache)
"""


def test_a_write_killed_midway_leaves_nothing_behind_and_a_live_one_is_left_alone(model_dir, tmp_path,
                                                                                   monkeypatch):
    """A run killed while writing the cache (the OOM killer, a preempted node) never cleans up: its hidden folder,
    as big as the tokenised data, stayed in the cache for good, one more each time."""
    import errno
    import fcntl
    import subprocess
    import sys
    import time

    def no_flock(fd, operation):  # a file system without flock (some network ones): runs do not wait for each other
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)

    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    cache = tmp_path / "cache"
    hidden = lambda: sorted(p.name for p in cache.glob(".*"))  # noqa: E731
    writer = [sys.executable, "-c", _WRITER, str(path), model_dir, str(cache)]
    holder = subprocess.Popen(writer + ["hold"])
    try:
        deadline = time.monotonic() + 120
        while not hidden() and time.monotonic() < deadline and holder.poll() is None:
            time.sleep(0.2)
        live = hidden()
        assert len(live) == 1
        assert subprocess.run(writer + ["die"]).returncode == -9
        killed = sorted(set(hidden()) - set(live))
        assert len(killed) == 1 and not any(p.name[0] != "." for p in cache.iterdir())  # half-written, never used
        data = prepare(model_dir, path, cache)  # writes the same entry beside the live write
        assert not data.from_cache and hidden() == live  # the killed write's folder is gone, the live one kept
    finally:
        holder.kill()
        holder.wait()
    assert prepare(model_dir, path, cache, max_seq_len=64).cache_path is not None and hidden() == []


def test_runs_started_together_tokenise_the_data_once(model_dir, tmp_path, caplog):
    """A sweep started at once on one machine: every run tokenised the same data beside the others (as much memory
    each, minutes each on a large data set) and wrote it again. A later run now waits for the first, then reads it."""
    import subprocess
    import sys
    import time

    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    cache = tmp_path / "cache"
    first = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), model_dir, str(cache), "slow"])
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob(".*.tmp")) and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)  # the first run is writing (for 3 s)
        with caplog.at_level("INFO", logger="shardtune"):
            data = prepare(model_dir, path, cache)
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
    assert data.from_cache and [r.getMessage() for r in caplog.records] == [
        f"waiting for another run that is tokenising data into {cache} (it may be this data)"]


def test_cache_holds_only_json_and_arrow_and_loads_without_unpickling(model_dir, tmp_path, monkeypatch):
    import pickle

    import torch

    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    first = prepare(model_dir, path, tmp_path / "cache")
    entry = _entry(tmp_path / "cache")
    assert {p.suffix for p in entry.rglob("*") if p.is_file()} == {".json", ".arrow"}

    def refuse(*args, **kwargs):
        raise AssertionError("the data cache was unpickled")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    again = prepare(model_dir, path, tmp_path / "cache")
    assert again.from_cache and again.train.to_list() == first.train.to_list()


@pytest.fixture
def read_only(monkeypatch):
    """Makes a folder read-only; root ignores permission bits, so there the denial is simulated where the cache
    makes its first folder in it. The mode is restored afterwards, so that pytest can remove the folder."""
    made = []

    def make(folder):
        folder.mkdir(exist_ok=True)
        folder.chmod(0o555)
        made.append(folder)
        if os.geteuid() == 0:
            from pathlib import Path

            mkdir = Path.mkdir

            def denied(self, *args, **kwargs):
                if self.parent == folder:
                    raise PermissionError(13, "Permission denied", str(self))
                return mkdir(self, *args, **kwargs)

            monkeypatch.setattr(Path, "mkdir", denied)
        return folder

    yield make
    for folder in made:
        folder.chmod(0o755)


@pytest.mark.parametrize("kind", ["under a file", "read-only"])
def test_unwritable_cache_warns_once_and_keeps_the_data_in_memory(model_dir, tmp_path, caplog, read_only, kind):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    reference = prepare(model_dir, path, tmp_path / "ok").train.to_list()
    if kind == "under a file":
        cache = tmp_path / "d.jsonl" / "cache"
    else:
        cache = read_only(tmp_path / "ro")
    with caplog.at_level("WARNING", logger="shardtune"):
        data = prepare(model_dir, path, cache)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"cannot write the tokenised data cache in {cache} (")
    assert warning.endswith("): this run keeps the data in memory and the next one tokenises it again; make the "
                            "folder writable, or point SHARDTUNE_CACHE (data inspect: --cache_dir) at a writable one")
    assert data.cache_path is None and not data.from_cache and data.train.to_list() == reference
    assert not cache.exists() or not any(cache.iterdir())


def test_valid_cache_in_a_read_only_folder_is_loaded(model_dir, tmp_path, caplog, read_only):
    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    first = prepare(model_dir, path, tmp_path / "ro")
    cache = read_only(tmp_path / "ro")
    with caplog.at_level("WARNING", logger="shardtune"):
        again = prepare(model_dir, path, cache)
    assert again.from_cache and again.train.to_list() == first.train.to_list() and not caplog.records


def _corpus_text(chars: int) -> str:
    text = " ".join(sample_corpus(num_lines=chars // 40 + 10, seed=3))
    return text[:chars]


def _encode(tok, examples, max_seq_len, token_chars=None):
    batch = {k: [e[k] for e in examples] for k in examples[0]}
    return encode_batch(batch, tokenizer=tok, max_seq_len=max_seq_len, train_on_prompt=False,
                        chat_template_format="none", token_chars=token_chars)


def _examples(text):
    short = "What is two plus two?"
    rows = [({"text": text}, "text"), ({"prompt": text, "completion": " Four."}, "prompt_completion"),
            ({"prompt": short, "completion": text}, "prompt_completion"),
            ({"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "Four."}]}, "chat"),
            ({"messages": [{"role": "user", "content": short}, {"role": "assistant", "content": text},
                           {"role": "user", "content": short}, {"role": "assistant", "content": text}]}, "chat")]
    return [to_example(row, f"row {i}", fmt, "text", False) for i, (row, fmt) in enumerate(rows)]


@pytest.mark.parametrize("max_seq_len", [64, 700])
def test_long_rows_cut_before_tokenising_keep_exactly_the_same_ids_and_labels(tok, max_seq_len):
    text = _corpus_text(200_000)
    examples = _examples(text)
    whole = _encode(tok, examples, max_seq_len, token_chars=10**9)  # never cut: the plain path
    cut = _encode(tok, examples, max_seq_len)
    assert max_token_chars(tok) == len("<|begin_of_text|>")
    assert cut["input_ids"] == whole["input_ids"] and cut["labels"] == whole["labels"]
    assert all(len(ids) == max_seq_len for ids in cut["input_ids"])
    assert not any(whole["dropped_estimated"]) and all(cut["dropped_estimated"])
    # the row with only a prompt left is kept identical too: every label ignored, so the pipeline drops it
    assert set(cut["labels"][1]) == {IGNORE}
    for exact, estimate in zip(whole["dropped_tokens"], cut["dropped_tokens"]):
        assert abs(estimate - exact) <= 0.02 * exact, (exact, estimate)


def test_the_first_tokens_of_a_cut_text_are_those_of_the_whole_text(tok, monkeypatch):
    """Cuts just past the kept tokens (one character per token assumed): every one keeps them exactly, and without
    the margin some would not (a word cut in two becomes other tokens), so the sweep does test the margin."""
    from shardtune.data import encode

    text = _corpus_text(20_000)
    whole = tok(text, add_special_tokens=False).input_ids

    def mismatches():
        return sum(encode.ids_upto(tok, text, limit, chars)[0] != whole[:limit]
                   for limit in range(1, 300) for chars in (1, 2, 3, 4, 5))

    assert mismatches() == 0
    monkeypatch.setattr(encode, "CUT_MARGIN", 0)
    assert mismatches() > 0


def test_cut_only_where_the_text_is_too_long_to_fit(tok):
    """A text no longer than the bound is tokenised whole, so its dropped tokens are exact; one character more is
    cut, and they are estimated."""
    from shardtune.data.encode import CUT_MARGIN

    max_seq_len = 64
    bound = (max_seq_len + CUT_MARGIN) * max_token_chars(tok)
    for chars, estimated in ((bound, False), (bound + 1, True)):
        text = _corpus_text(chars)
        out = _encode(tok, [to_example({"text": text}, "r", "text", "text", False)], max_seq_len)
        exact = 1 + len(tok(text, add_special_tokens=False).input_ids) + 1 - max_seq_len  # BOS, the text, EOS
        assert out["dropped_estimated"] == [estimated]
        if estimated:
            assert abs(out["dropped_tokens"][0] - exact) <= 0.02 * exact
        else:
            assert out["dropped_tokens"][0] == exact


def test_a_20_mb_row_is_tokenised_only_as_far_as_it_is_kept(model_dir, tmp_path, monkeypatch):
    """Counted, not timed: of the 20 MB row the tokenizer is given one prefix, (max_seq_len + CUT_MARGIN) times
    the longest token's characters long (the whole text would take a minute and gigabytes); the dropped tokens
    are estimated from it to 2%."""
    import transformers

    from shardtune.data.encode import CUT_MARGIN

    text = _corpus_text(200_000) * 100
    path = tmp_path / "huge.jsonl"
    path.write_bytes(jsonl([{"text": text}, {"text": "A short row."}]))
    tokenised, call = [], transformers.PreTrainedTokenizerBase.__call__

    def counting_call(self, text=None, *args, **kwargs):
        if isinstance(text, str):
            tokenised.append(len(text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "__call__", counting_call)
    data = prepare(model_dir, path, tmp_path / "cache", max_seq_len=512)
    longer = [chars for chars in tokenised if chars > len("A short row.")]
    assert longer == [(512 + CUT_MARGIN) * max_token_chars(load_tokenizer(model_dir, DataConfig()))]
    report = data.report
    assert report.truncated_rows == 1 and report.estimated_rows == 1 and len(data.train[0]["input_ids"]) == 512
    assert "dropped tokens" in report.format() and "(estimated for 1 rows cut before tokenising)" in report.format()
    sample = text[:200_000]  # the text repeats it: its tokens per character are the text's
    per_char = len(load_tokenizer(model_dir, DataConfig())(sample, add_special_tokens=False).input_ids) / len(sample)
    assert abs(report.dropped_tokens - per_char * len(text)) < 0.02 * report.dropped_tokens


def _rank(rank, init_file, data_path, model_dir, cache_dir, out_dir):
    import logging

    import torch.distributed as dist

    from shardtune.dist import shutdown

    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("shardtune").addHandler(handler)
    data = prepare(model_dir, data_path, cache_dir)
    result = {"rows": data.train.to_list(), "cache_path": data.cache_path, "warnings": warnings}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    shutdown()  # not destroy_process_group alone: see test_dist_shutdown (SIGABRT at exit)


@pytest.mark.timeout(120)
def test_unwritable_cache_under_two_ranks_every_rank_keeps_the_data_in_memory(model_dir, tmp_path):
    import torch.multiprocessing as mp

    path = tmp_path / "d.jsonl"
    path.write_bytes(jsonl(ROWS))
    reference = prepare(model_dir, path, tmp_path / "ok").train.to_list()
    cache = tmp_path / "d.jsonl" / "cache"  # under a file: no rank can write it
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(path), model_dir, str(cache), str(tmp_path)), nprocs=2)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["rows"] == r1["rows"] == reference and r0["cache_path"] is r1["cache_path"] is None
    (warning,) = r0["warnings"]
    assert warning.startswith(f"cannot write the tokenised data cache in {cache}")
    assert r1["warnings"] == []  # one warning, from the rank that tried
