"""A picture of an estimate: one stacked bar per compared setup, against the GPU's memory.

Built on ``matplotlib.figure.Figure`` with the Agg canvas, never through ``pyplot``: no global state, no display.
"""

from __future__ import annotations

from pathlib import Path

from shardtune.errors import UsageError
from shardtune.files import figure_metadata, replacing
from shardtune.hardware import GIB
from shardtune.memory.formula import CATEGORIES
from shardtune.memory.report import Report, short_label

COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
          "overhead": "#8172b3"}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activations", "overhead": "overhead (gathered units, allocator)"}


def breakdown_figure(r: Report):
    """The figure: per setup, its per-GPU bytes by category (GiB), the GPU's memory as a line, the pick marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.5, 1.45 * len(r.table) + 2.5) + 2.8, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    names = [short_label(b.setup).replace(" ", "\n", 1) for b, _ in r.table]
    xs = range(len(r.table))
    bottoms = [0.0] * len(r.table)
    for category in CATEGORIES:
        heights = [b.per_gpu()[category] / GIB for b, _ in r.table]
        ax.bar(xs, heights, bottom=bottoms, color=COLORS[category], label=LABELS[category], width=0.6,
               gid=category)
        bottoms = [lo + h for lo, h in zip(bottoms, heights)]
    capacity = r.gpu.memory_bytes / GIB
    ax.axhline(capacity, color="black", linewidth=1.5, label=f"{r.gpu.label or r.gpu.name}: {capacity:.1f} GiB")
    context = max(b.cuda_context for b, _ in r.table) / GIB
    ax.axhline(capacity - context, color="black", linewidth=1, linestyle="--",
               label=f"less the CUDA context ({context:.2f} GiB)")
    # A replica far beyond the GPU would flatten every other bar: the axis stops at twice the GPU's memory and a
    # taller bar carries its total at the top.
    top = min(max(max(bottoms), capacity), 2 * capacity) * 1.15
    rec = r.recommendation
    for x, ((b, _), total) in enumerate(zip(r.table, bottoms)):
        chosen = rec.fits and b.setup == rec.setup
        text = f"{total:.1f}" + ("" if b.fits(r.gpu.memory_bytes) else "\ndoes not fit")
        text += "\nrecommended" if chosen else ""
        y = min(total, top * 0.86) + top * 0.015
        ax.text(x, y, text, ha="center", va="bottom", fontsize=9 if chosen else 8,
                fontweight="bold" if chosen else "normal", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
        if chosen:  # a frame around the bar as well, so the pick stands out without reading
            ax.bar([x], [total], width=0.72, fill=False, edgecolor="black", linewidth=2.5, gid="recommended")
    ax.set_ylim(0, top)
    ax.set_xticks(list(xs), names, fontsize=9)
    ax.set_ylabel("GiB per GPU")
    s = r.breakdown.setup
    gpus = f"{s.world_size} GPU" + ("s" if s.world_size > 1 else "")
    ax.set_title(f"{r.inventory.name}, {s.method}, {gpus}, micro-batch {s.batch_size} x {s.seq_len}", fontsize=11)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside, never over bars
    return fig


def bar_totals(fig) -> list[float]:
    """The stacked height of each setup's bar as drawn (GiB): what a reader of the picture sees."""
    ax = fig.axes[0]
    totals: dict[float, float] = {}
    for patch in ax.patches:
        if patch.get_gid() in COLORS:
            x = round(patch.get_x() + patch.get_width() / 2, 6)
            totals[x] = max(totals.get(x, 0.0), patch.get_y() + patch.get_height())
    return [totals[x] for x in sorted(totals)]


def check_plot_path(path: str | Path) -> Path:
    """``--plot``'s file, refused before any estimate is made (not after its report is printed) where no PNG can be
    written there: another suffix, or a folder that does not exist."""
    path = Path(path).expanduser()
    if path.suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the picture is a PNG; give a file name ending in .png.")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {path}: the folder {path.parent} does not exist; create it or pick another.")
    return path


def write_plot(r: Report, path: str | Path) -> Path:
    """Write the figure as a PNG at ``path`` (through a temporary file and a rename)."""
    path = check_plot_path(path)
    with replacing(path) as tmp:
        breakdown_figure(r).savefig(tmp, format="png", dpi=110, metadata=figure_metadata("png"))
    return path
