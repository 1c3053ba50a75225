"""``shardtune plot``: the PNGs are written, and the plotted lines hold exactly the values of metrics.jsonl."""

from __future__ import annotations

import json
import math

import pytest

from shardtune.cli import main
from shardtune.errors import UsageError
from shardtune.train.plot import figures, loss_figure, read_metrics, scalar_figure, write_plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_run(num_steps: int = 40, eval_every: int = 10, seed: int = 0) -> list[dict]:
    """Records shaped like the trainer's: a decaying loss, warm-up then cosine lr, varying tokens per step."""
    import random

    rng = random.Random(seed)
    records = []
    for step in range(1, num_steps + 1):
        lr = 2e-4 * min(1.0, step / 5) * 0.5 * (1 + math.cos(math.pi * step / num_steps))
        tokens = rng.randint(900, 1100)
        records.append({"step": step, "loss": 3.0 * math.exp(-step / 15) + 0.5 + rng.uniform(-0.05, 0.05),
                        "lr": lr, "grad_norm": rng.uniform(0.5, 2.0), "tokens": tokens,
                        "tokens_per_s": tokens / 0.2, "peak_memory_bytes": 123_456_789})
        if step % eval_every == 0:
            records.append({"step": step, "eval_loss": 3.0 * math.exp(-step / 15) + 0.6 + rng.uniform(-0.05, 0.05)})
    return records


def write_metrics(folder, records, extra_lines=()):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def line(fig, label: str):
    (match,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == label]
    return list(match.get_xdata()), list(match.get_ydata())


def test_plotted_lines_are_the_file_values(tmp_path):
    records = synthetic_run()
    run = write_metrics(tmp_path / "run", records)
    metrics = read_metrics(run)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]

    steps, losses = line(loss_figure(metrics, "step"), "train loss")
    assert steps == [r["step"] for r in train] and losses == [r["loss"] for r in train]
    assert line(loss_figure(metrics, "step"), "eval loss") == ([r["step"] for r in evals],
                                                               [r["eval_loss"] for r in evals])

    cumulative, running = {}, 0
    for r in train:
        running += r["tokens"]
        cumulative[r["step"]] = running
    tokens_x, losses = line(loss_figure(metrics, "tokens"), "train loss")
    assert tokens_x == [cumulative[r["step"]] for r in train] and losses == [r["loss"] for r in train]
    eval_x, _ = line(loss_figure(metrics, "tokens"), "eval loss")
    assert eval_x == [cumulative[r["step"]] for r in evals]

    assert line(scalar_figure(metrics, "lr", "lr", "lr"), "lr") == ([r["step"] for r in train],
                                                                    [r["lr"] for r in train])
    assert line(scalar_figure(metrics, "grad_norm", "g", "g"), "grad_norm")[1] == [r["grad_norm"] for r in train]


def test_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    first = synthetic_run(num_steps=30, seed=1)
    resumed = [r for r in synthetic_run(num_steps=40, seed=2) if r["step"] > 20]  # restarted from step 20
    run = write_metrics(tmp_path / "run", first + resumed)
    metrics = read_metrics(run)
    by_step, eval_by_step = {}, {}
    for r in first + resumed:
        (by_step if "loss" in r else eval_by_step)[r["step"]] = r
    assert [r["step"] for r in metrics.train] == list(range(1, 41))
    assert [r["loss"] for r in metrics.train] == [by_step[s]["loss"] for s in range(1, 41)]
    # steps 21-30 and the eval at step 30 were logged twice: the resumed run's values win
    assert metrics.train[29]["loss"] == resumed[9]["loss"] != first[31]["loss"]
    assert [r["step"] for r in metrics.eval] == [10, 20, 30, 40]
    assert [r["eval_loss"] for r in metrics.eval] == [eval_by_step[s]["eval_loss"] for s in (10, 20, 30, 40)]
    assert metrics.eval[2]["eval_loss"] == [r for r in resumed if r.get("eval_loss") and r["step"] == 30][0][
        "eval_loss"]
    tokens_x, _ = line(loss_figure(metrics, "tokens"), "train loss")
    assert tokens_x[-1] == sum(by_step[s]["tokens"] for s in range(1, 41))


def test_sparse_logging_scales_tokens_by_the_steps_between_records(tmp_path):
    records = [{"step": s, "loss": 1.0 / s, "tokens": 100 + s} for s in (5, 10, 20)]
    metrics = read_metrics(write_metrics(tmp_path / "run", records))
    assert line(loss_figure(metrics, "tokens"), "train loss")[0] == [5 * 105, 5 * 105 + 5 * 110,
                                                                     5 * 105 + 5 * 110 + 10 * 120]
    # Records that carry tokens_seen (every step's tokens, logged or not) are plotted at it: no estimate.
    counted = [{**r, "tokens_seen": seen} for r, seen in zip(records, (480, 1010, 2333))]
    metrics = read_metrics(write_metrics(tmp_path / "counted", counted))
    assert line(loss_figure(metrics, "tokens"), "train loss")[0] == [480, 1010, 2333]


def test_write_plots_and_cli_print_non_empty_pngs(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", synthetic_run())
    assert main(["plot", str(run), "--out", str(tmp_path / "pngs")]) == 0
    printed = capsys.readouterr().out.split()
    names = sorted(p.rsplit("/", 1)[-1] for p in printed)
    assert names == ["grad_norm.png", "learning_rate.png", "loss_vs_step.png", "loss_vs_tokens.png"]
    for path in printed:
        data = open(path, "rb").read()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000
    default = write_plots(run)
    assert all(p.parent == run / "plots" and p.stat().st_size > 10_000 for p in default)
    assert not list((run / "plots").glob(".*"))  # no temp files left behind


def test_a_run_without_lr_or_eval_plots_what_it_has(tmp_path):
    metrics = read_metrics(write_metrics(tmp_path / "run", [{"step": s, "loss": 2.0 - s / 10} for s in range(1, 6)]))
    assert sorted(figures(metrics)) == ["loss_vs_step"]
    assert [ln.get_label() for ln in loss_figure(metrics).axes[0].get_lines()] == ["train loss"]


def test_missing_file_and_malformed_lines_are_usage_errors(tmp_path, capsys, caplog):
    with pytest.raises(UsageError, match="no metrics.jsonl in"):
        read_metrics(tmp_path)
    good = [json.dumps(r) for r in synthetic_run(num_steps=3)]
    for bad, message in (("{not json", "line 4 is not valid JSON"),
                         ('{"loss": 1.0}', "line 4 has no integer 'step'"),
                         ('[1, 2]', "line 4 is not a JSON object"),
                         ('{"step": 4, "loss": "high"}', "line 4: 'loss' must be a number")):
        (tmp_path / "metrics.jsonl").write_text("\n".join(good + [bad]) + "\n")
        with pytest.raises(UsageError, match=message):
            read_metrics(tmp_path)
    # the last line without its newline (a run writing it now, or cut short by a crash) is left out, said so
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 4, "lo')
    with caplog.at_level("WARNING", logger="shardtune"):
        assert [r["step"] for r in read_metrics(tmp_path).train] == [1, 2, 3]
    assert "line 4 is incomplete (a run still writing it, or one cut short): left out" in caplog.text
    (tmp_path / "metrics.jsonl").write_text("\n\n")
    with pytest.raises(UsageError, match="holds no records"):
        read_metrics(tmp_path)
    # a file whose only line is cut short: one line saying both, not a warning above the error
    (tmp_path / "metrics.jsonl").write_bytes(b"\x00\xff")
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"shardtune plot: error: {tmp_path / 'metrics.jsonl'} holds no records with "
                                       f"'loss' or 'eval_loss': line 1 is incomplete (a run still writing it, or one "
                                       f"cut short); train for at least logging_steps steps first.\n")
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_a_file_where_the_plots_folder_goes_is_one_line_naming_it(tmp_path, capsys):
    """It said '[Errno 17] File exists: ...; free disk space, fix the permissions or give another path'."""
    run = write_metrics(tmp_path / "run", synthetic_run(num_steps=3))
    (run / "plots").write_text("my notes\n")
    assert main(["plot", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardtune plot: error: {run / 'plots'}: a file is there, where the run's plots folder goes; move it away, "
        "or give another folder with --out DIR"]
    assert (run / "plots").read_text() == "my notes\n"
    assert main(["plot", str(run), "--out", str(tmp_path / "pngs")]) == 0
    assert len(list((tmp_path / "pngs").glob("*.png"))) == 4


def test_a_users_file_in_the_runs_plots_folder_is_never_overwritten(tmp_path, capsys):
    """A picture of the user's named loss_vs_step.png in OUTPUT_DIR/plots was replaced by the default plot; only
    --out DIR was checked."""
    run = write_metrics(tmp_path / "run", synthetic_run(num_steps=3))
    (run / "plots").mkdir()
    (run / "plots" / "loss_vs_step.png").write_bytes(b"my own picture")
    assert main(["plot", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardtune plot: error: {run / 'plots' / 'loss_vs_step.png'}: a file shardtune did not write is there, in "
        f"the run's plots folder, and it is left alone; move it away, or give another folder with --out DIR"]
    assert (run / "plots" / "loss_vs_step.png").read_bytes() == b"my own picture"
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["loss_vs_step.png"]  # nothing written before
    (run / "plots" / "loss_vs_step.png").unlink()
    first = write_plots(run)
    assert write_plots(run) == first  # its own pictures of an earlier plot are replaced


def test_out_given_a_picture_name_is_refused_rather_than_made_a_folder(tmp_path, capsys):
    """--out loss.png made a folder named loss.png holding four PNGs."""
    run = write_metrics(tmp_path / "run", synthetic_run(num_steps=3))
    assert main(["plot", str(run), "--out", str(tmp_path / "loss.png")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"shardtune plot: error: --out {tmp_path / 'loss.png'}: plot writes one PNG per chart (loss, learning rate, "
        f"grad norm) into a folder; give a folder, e.g. --out {tmp_path / 'loss'}"]
    assert not (tmp_path / "loss.png").exists()
    (tmp_path / "old.png").mkdir()  # a folder the user did name so: taken as the folder it is
    assert main(["plot", str(run), "--out", str(tmp_path / "old.png")]) == 0
    assert len(list((tmp_path / "old.png").glob("*.png"))) == 4
