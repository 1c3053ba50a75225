"""Pictures of a training run from its ``metrics.jsonl``: loss against steps and tokens, learning rate, grad norm.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas, never through ``pyplot``, so plotting keeps no
global state and needs no display.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from shardtune.errors import UsageError
from shardtune.files import figure_metadata, foreign_file, replacing

log = logging.getLogger("shardtune")

METRICS_FILE = "metrics.jsonl"
TRAIN_COLOR, EVAL_COLOR = "tab:blue", "tab:orange"


@dataclass
class Metrics:
    """Train and eval records of one run, one per step (a resumed run's later record wins), in step order."""

    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    name: str = ""  # the run's folder name, shown in titles so PNGs of several runs are not confused

    def series(self, key: str, records: str = "train") -> tuple[list[int], list[float]]:
        """(steps, values) of ``key`` over the records that carry it."""
        rows = [r for r in getattr(self, records) if r.get(key) is not None]
        return [r["step"] for r in rows], [float(r[key]) for r in rows]

    def cumulative_tokens(self) -> dict[int, float]:
        """Tokens seen by the end of each logged train step: the record's ``tokens_seen``, every step's count.

        Records without it (files written before it was counted) estimate: ``tokens`` counts one optimizer step, and
        when only every k-th step is logged the k-1 steps in between are taken to have the same count as the logged
        one, so the axis stays in tokens rather than logged records.
        """
        total, previous_step, seen = 0.0, 0, {}
        for record in self.train:
            if record.get("tokens_seen") is not None:
                total = float(record["tokens_seen"])
            elif record.get("tokens") is not None:
                total += float(record["tokens"]) * (record["step"] - previous_step)
            previous_step = record["step"]
            seen[record["step"]] = total
        return seen


def _parse_line(raw: bytes, path: Path, line_number: int) -> dict | None:
    where = f"{path}: line {line_number}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where} is not UTF-8 text (byte {exc.start}); the file is damaged: give the "
                         f"metrics.jsonl a training run wrote") from None
    if not text.strip():
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{where} is not valid JSON ({exc.msg}); fix or delete that line.") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where} is not a JSON object; each line must be one record like "
                         f'{{"step": 1, "loss": 2.3, ...}}.')
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"{where} has no integer 'step' (got {step!r}); every record needs the optimizer step.")
    for key in ("loss", "eval_loss", "lr", "grad_norm", "tokens"):
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise UsageError(f"{where}: '{key}' must be a number (got {value!r}).")
    return record


def read_metrics(output_dir: str | Path) -> Metrics:
    """Parse ``OUTPUT_DIR/metrics.jsonl``; a malformed line is a UsageError naming the file and line number."""
    folder = Path(output_dir)
    path = folder / METRICS_FILE if folder.is_dir() or folder.name != METRICS_FILE else folder
    if not path.is_file():
        raise UsageError(f"no {METRICS_FILE} in '{output_dir}'; give the output_dir of a training run "
                         f"(the folder 'shardtune train' writes metrics.jsonl into).")
    latest: dict[tuple[str, int], dict] = {}
    cut = ""  # the last line, without its newline: a record the run is writing now, or one a crash cut short
    with path.open("rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                record = _parse_line(raw, path, line_number)
            except UsageError:
                if raw.endswith(b"\n"):
                    raise
                cut = f"line {line_number} is incomplete (a run still writing it, or one cut short)"
                continue
            if record is None:
                continue
            # a resumed run re-logs steps: the last one is the truth; records with neither loss are other events
            if "loss" in record:
                latest[("train", record["step"])] = record
            if "eval_loss" in record:
                latest[("eval", record["step"])] = record
    if not latest:
        raise UsageError(f"{path} holds no records with 'loss' or 'eval_loss'{f': {cut}' if cut else ''}; train "
                         f"for at least logging_steps steps first.")
    if cut:
        log.warning("%s: %s: left out", path, cut)
    ordered = sorted(latest.items(), key=lambda item: item[0][1])
    return Metrics(train=[r for (kind, _), r in ordered if kind == "train"],
                   eval=[r for (kind, _), r in ordered if kind == "eval"], name=path.resolve().parent.name)


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _title(title: str, metrics: Metrics) -> str:
    return f"{title}: {metrics.name}" if metrics.name else title


def _tokens_at(step: int, cumulative: dict[int, float]) -> float:
    """Tokens seen by ``step``: an eval runs after its train step, so it sits at that step's count."""
    before = [s for s in cumulative if s <= step]
    return cumulative[max(before)] if before else 0.0


def loss_figure(metrics: Metrics, x_axis: str = "step"):
    """Train loss as a line and eval loss as marked points, against optimizer steps or cumulative tokens."""
    if x_axis not in ("step", "tokens"):
        raise ValueError(f"x_axis must be 'step' or 'tokens', not {x_axis!r}")
    xlabel = "optimizer step" if x_axis == "step" else "tokens seen (cumulative)"
    fig, ax = _figure(_title(f"Loss against {'steps' if x_axis == 'step' else 'tokens'}", metrics), xlabel,
                      "loss (mean cross-entropy per target token)")
    cumulative = metrics.cumulative_tokens()
    for records, key, label, style in ((metrics.train, "loss", "train loss", dict(color=TRAIN_COLOR, lw=1.5)),
                                       (metrics.eval, "eval_loss", "eval loss",
                                        dict(color=EVAL_COLOR, lw=1.5, marker="o", ms=5))):
        steps, values = metrics.series(key, "train" if records is metrics.train else "eval")
        if not steps:
            continue
        xs = steps if x_axis == "step" else [_tokens_at(s, cumulative) for s in steps]
        if len(xs) == 1:
            style = {**style, "marker": "o"}  # a one-point line draws nothing
        ax.plot(xs, values, label=label, **style)
    if x_axis == "tokens":
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1.2M rather than 1200000 or an offset label
    ax.legend()
    return fig


def scalar_figure(metrics: Metrics, key: str, title: str, ylabel: str, log_scale: bool = False):
    """One train-record value (``lr``, ``grad_norm`` ...) against optimizer steps."""
    fig, ax = _figure(_title(title, metrics), "optimizer step", ylabel)
    steps, values = metrics.series(key)
    ax.plot(steps, values, color=TRAIN_COLOR, lw=1.5, label=key, marker="o" if len(steps) == 1 else None)
    # a log axis only when the values span decades; otherwise a linear one reads more easily
    if log_scale and values and all(v > 0 and math.isfinite(v) for v in values) and max(values) > 20 * min(values):
        ax.set_yscale("log")
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    return fig


def figures(metrics: Metrics) -> dict[str, object]:
    """Every plot of a run by file name (without .png); plots whose values the run did not log are left out."""
    out = {"loss_vs_step": loss_figure(metrics, "step")}
    if any(r.get("tokens") is not None for r in metrics.train):
        out["loss_vs_tokens"] = loss_figure(metrics, "tokens")
    if metrics.series("lr")[0]:
        out["learning_rate"] = scalar_figure(metrics, "lr", "Learning rate schedule", "learning rate")
    if metrics.series("grad_norm")[0]:
        out["grad_norm"] = scalar_figure(metrics, "grad_norm", "Gradient norm", "global L2 norm of the gradients",
                                         log_scale=True)
    return out


def write_plots(output_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the run's PNGs into ``out_dir`` (default ``OUTPUT_DIR/plots``) and return their paths. Either folder
    may hold files of the user's: one of the same name is refused before anything is written."""
    metrics = read_metrics(output_dir)
    run = Path(output_dir)
    run = run.parent if run.name == METRICS_FILE and run.is_file() else run  # the file itself was given
    target = Path(out_dir) if out_dir is not None else run / "plots"
    if out_dir is None and (target.is_symlink() or target.exists()) and not target.is_dir():
        raise UsageError(f"{target}: a file is there, where the run's plots folder goes; move it away, or give "
                         f"another folder with --out DIR")
    pictures = {target / f"{name}.png": fig for name, fig in figures(metrics).items()}
    for path in pictures:  # the run's plots folder too: a picture the user saved there as loss_vs_step.png stays
        if problem := foreign_file(path, "--out"):
            raise UsageError(problem if out_dir is not None else
                             f"{path}: a file shardtune did not write is there, in the run's plots folder, and it is "
                             f"left alone; move it away, or give another folder with --out DIR")
    target.mkdir(parents=True, exist_ok=True)
    paths = []
    for path, fig in pictures.items():
        with replacing(path) as tmp:  # a reader never sees half a file
            fig.savefig(tmp, format="png", metadata=figure_metadata("png"))
        paths.append(path)
    return paths
