"""The time and memory model against measured runs (shardtune/memory/calibration/: published ones, and shardtune's
own on a lent GPU), leave-one-out.

Speed: the seven constants of the time model (shardtune/memory/compute.py ``TimingParams``) are fitted by least
squares on log(predicted / measured) over the speed points. Each point is then predicted by a fit made without it
(leave-one-out): that prediction is the one the figures judge, since no point helped set the constants it is
checked with. The fit on all points is what ``CALIBRATED`` ships; this script prints it so it can be copied there.
A point marked ``fit: false`` (its step is bound by something the model has no term for) is left out of every fit
and predicted by the fit on the others, so it is judged like the rest without pulling the constants.

Memory: each peak through the analytic formula (shardtune/memory/formula.py), compared with the counter the source
reports (reserved memory against the formula's total; active or allocated memory against its tensors; an unstated
counter against the total, the larger); with ``--trace``, also through the fake-tensor trace of shardtune's own
training step. The formula has no constant fitted to these points, so its leave-one-out prediction is its
prediction.

Writes bench/results/calibration.{json,md} and calibration.png (log-log, predicted against measured).

    .venv/bin/python bench/calibration.py [--trace] [--speed-only | --memory-only] [--out bench/results/calibration]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from shardtune.memory.calibration import OWN_RESULTS, Point, load_points
from shardtune.memory.compute import CALIBRATED, TimingParams
from shardtune.memory.timing import StepTime, step_time

# The constants as the fit moves them: log for the byte counts, logit for the shares of a peak (kept in (0, 1)).
SHARES = ("matmul", "attention", "overlap", "pcie_share")
NAMES = tuple(f for f in asdict(CALIBRATED))


def to_vector(p: TimingParams) -> list[float]:
    """The fit's coordinates of ``p`` (a value at a bound, 0 or a share of 1, starts just inside it)."""
    edge = 1e-6
    return [math.log(min(max(v, edge), 1 - edge) / (1 - min(max(v, edge), 1 - edge))) if n in SHARES
            else math.log(max(v, edge)) for n, v in asdict(p).items()]


def from_vector(x: list[float]) -> TimingParams:
    return TimingParams(**{n: 1 / (1 + math.exp(-v)) if n in SHARES else math.exp(v) for n, v in zip(NAMES, x)})


@dataclass
class Case:
    """A speed point with everything step_time needs, built once."""

    point: Point
    args: tuple
    kwargs: dict

    def predict(self, params: TimingParams) -> StepTime:
        return step_time(*self.args, params=params, **self.kwargs)

    def log_error(self, params: TimingParams) -> float:
        return math.log(self.predict(params).tokens_per_s / self.point.tokens_per_s())


def speed_case(point: Point) -> Case:
    return Case(point, *point.timing_args())


def loss(cases: list[Case], x: list[float]) -> float:
    params = from_vector(x)
    return sum(c.log_error(params) ** 2 for c in cases)


def nelder_mead(f, x0: list[float], step: float = 0.3, iterations: int = 2000, tol: float = 1e-12) -> list[float]:
    """Minimise ``f`` from ``x0`` (the standard reflection, expansion, contraction and shrink moves)."""
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centre = [sum(col) / (len(simplex) - 1) for col in zip(*simplex[:-1])]
        worst = simplex[-1]

        def towards(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centre, worst)]

        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[min(range(len(simplex)), key=values.__getitem__)]


# Where every fit starts: round values in the physical ranges, not the shipped constants, so that the fit's answer
# does not depend on what an earlier run shipped.
START = TimingParams(matmul=0.8, attention=0.5, tile_intensity=400.0, elementwise_bytes=30.0,
                     fused_elementwise_bytes=10.0, overlap=0.5, pcie_share=0.3)


def fit(cases: list[Case], start: TimingParams = START, restarts: int = 20) -> TimingParams:
    """Least squares on log(predicted / measured): Nelder-Mead, restarted from its own answer until a restart no
    longer improves it (the surface is flat along some directions, where one pass stops early)."""
    x, best = to_vector(start), math.inf
    for step in [0.5] + [0.2] * (restarts - 1):
        x = nelder_mead(lambda v: loss(cases, v), x, step=step)
        value = loss(cases, x)
        if value > best - 1e-9:
            break
        best = value
    return from_vector(x)


def speed_rows(cases: list[Case]) -> tuple[TimingParams, list[dict]]:
    """The fit on every fitted point, and each point's prediction by it and by the fit that left the point out (for
    a point outside the fit, ``fit: false``, the two are the same)."""
    fitted = [c for c in cases if c.point.fit]
    full = fit(fitted)
    rows = []
    # The fits are independent: one process per core (forked, so the cases are not pickled).
    _LEFT_OUT.update(cases=cases, fitted=fitted, full=full)
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("fork")) as pool:
        for row in pool.map(_left_out_row, range(len(cases))):
            rows.append(row)
            print(f"  {row['id']}: measured {row['measured']:,.0f}, leave-one-out {row['loo_predicted']:,.0f} "
                  f"({row['loo_ratio']:.2f}x)", file=sys.stderr)
    return full, rows


_LEFT_OUT: dict = {}


def _left_out_row(i: int) -> dict:
    case, full = _LEFT_OUT["cases"][i], _LEFT_OUT["full"]
    if not case.point.fit:
        return speed_row(case, full, full)
    return speed_row(case, full, fit([c for c in _LEFT_OUT["fitted"] if c is not case], full))


def speed_row(case: Case, full: TimingParams, loo: TimingParams) -> dict:
    p = case.point
    measured, fitted, left_out = p.tokens_per_s(), case.predict(full), case.predict(loo)
    return {"id": p.id, "source": p.source.title, "url": p.source.url, "gpu": p.card.label or p.card.name,
            "gpus": p.world_size, "method": p.method, "model": p.model if isinstance(p.model, str) else p.id,
            "measured": measured, "needs_peak_share": needed_peak_share(case, fitted.peak_flops),
            "predicted": fitted.tokens_per_s, "ratio": fitted.tokens_per_s / measured,
            "loo_predicted": left_out.tokens_per_s, "loo_ratio": left_out.tokens_per_s / measured,
            "loo_params": asdict(loo), "exposed_comm_share": fitted.exposed_comm_s / fitted.step_s,
            "assumed": list(p.assumed), "fitted": p.fit}


def needed_peak_share(case: Case, peak: float) -> float:
    """The share of its cards' dense peak the measured speed needs for its matmul and attention FLOPs alone (as
    the time model counts them: recomputation included), with nothing else taking any time. Near or above 1 the
    row cannot have run as its source describes on that card, whatever the model."""
    from shardtune.memory.compute import flops_per_token

    inv, setup, _, _, lora = case.args
    flops = sum(flops_per_token(inv, setup, lora, case.kwargs["kernels"]))
    return case.point.tokens_per_s() * flops / (case.point.world_size * peak)


def factor(ratio: float) -> float:
    """How many times off a prediction is, either way (1.0: exact)."""
    return max(ratio, 1 / ratio)


def speed_summary(rows: list[dict]) -> dict:
    ratios = [r["loo_ratio"] for r in rows]
    return {"points": len(rows), "within_1.5x": sum(factor(r) <= 1.5 for r in ratios),
            "median_abs_error": statistics.median(abs(r - 1) for r in ratios),
            "median_factor_error": statistics.median(factor(r) - 1 for r in ratios),
            "worst_factor": max(factor(r) for r in ratios),
            "not_fitted": sum(not r.get("fitted", True) for r in rows)}


def memory_rows(points: list[Point], trace: bool) -> list[dict]:
    """Each memory point through the formula (and the trace), against the counter its source reports."""
    rows = []
    for p in points:
        row = memory_row(p, trace)
        rows.append(row)
        print(f"  {p.id}: measured {row['measured_gib']:.2f} GiB, formula {row['formula_gib']:.2f} GiB "
              f"({row['formula_ratio']:.3f})" + (f", trace {row['trace_gib']:.2f} GiB ({row['trace_ratio']:.3f})"
                                                 if row.get("trace_gib") else ""), file=sys.stderr)
    return rows


def memory_row(p: Point, trace: bool) -> dict:
    tensors_only, predicted, measured = p.tensors_only, p.formula_peak(), p.peak_bytes()
    row = {"id": p.id, "source": p.source.title, "url": p.source.url, "gpu": p.card.label or p.card.name,
           "gpus": p.world_size, "method": p.method,
           "model": p.model if isinstance(p.model, str) else _in_repo(p.model_ref()),
           "counter": p.measured["counter"], "compared_with": "tensors" if tensors_only else "reserved",
           "measured_gib": measured / 2**30, "formula_gib": predicted / 2**30, "formula_ratio": predicted / measured,
           "assumed": list(p.assumed)}
    if trace:
        row.update(traced(p, p.setup(), measured, tensors_only))
    return row


def _in_repo(path: str) -> str:
    """A model config's path as the repository names it (the same wherever the repository is checked out)."""
    return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1]))


def traced(p: Point, setup, measured: float, tensors_only: bool) -> dict:
    """The fake-tensor trace of shardtune's own training step for the point's setup (tensors, or the allocator
    model's replay of them for reserved memory)."""
    from shardtune.memory.trace_setup import formula_and_trace

    try:
        c = formula_and_trace(p.model_ref(), setup)
    except Exception as e:  # a setup the trace cannot run (say so in the table) must not stop the others
        return {"trace_error": f"{type(e).__name__}: {e}"[:200]}
    value = c.traced_tensors if tensors_only else c.traced_reserved
    return {"trace_gib": value / 2**30, "trace_ratio": value / measured}


def memory_summary(rows: list[dict]) -> dict:
    errors = [abs(r["formula_ratio"] - 1) for r in rows]
    out = {"points": len(rows), "within_10%": sum(e <= 0.10 for e in errors), "mean_abs_error": statistics.mean(errors),
           "max_abs_error": max(errors)}
    traced_rows = [r for r in rows if "trace_ratio" in r]
    if traced_rows:
        trace_errors = [abs(r["trace_ratio"] - 1) for r in traced_rows]
        out.update(traced=len(traced_rows), trace_within_10=sum(e <= 0.10 for e in trace_errors),
                   trace_mean_abs_error=statistics.mean(trace_errors))
    return out


def write(result: dict, out: Path) -> None:
    """calibration.json (everything), calibration.md (the tables) and calibration.png (the plot)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}.json, .md, .png", file=sys.stderr)


def markdown(result: dict) -> str:
    lines = ["# The time and memory model against measured runs (published, and shardtune's own)", "",
             "Written by `bench/calibration.py` from shardtune/memory/calibration/ (each point's source, quote and "
             "assumptions are there). Speed: leave-one-out, each run predicted by the constants fitted without it.",
             "", *summary_lines(result), "", *speed_table(result["speed"])]
    if result.get("memory"):
        lines += ["", *memory_table(result["memory"])]
    return "\n".join([*lines, "", "** outside the bound (1.5x for speed, 10% for memory).", ""])


def summary_lines(result: dict) -> list[str]:
    s, m = result["speed_summary"], result.get("memory_summary") or {}
    lines = [f"**Speed**: {s['points']} runs; leave-one-out within 1.5x: {s['within_1.5x']} of {s['points']}; "
             f"median error {s['median_abs_error']:.1%} (|predicted/measured - 1|), median factor "
             f"{1 + s['median_factor_error']:.3f}x, worst {s['worst_factor']:.2f}x."
             + (f" {s['not_fitted']} of them are outside the fit (marked 'not fitted': the time model has no term "
                "for what bounds them; their notes say what) and are predicted by the fit on the others."
                if s.get("not_fitted") else ""), ""]
    if m:
        trace = (f" Trace: {m['traced']} traced, within 10%: {m['trace_within_10']}, mean error "
                 f"{m['trace_mean_abs_error']:.1%}." if m.get("traced") else "")
        lines += [f"**Memory** (formula, nothing fitted): {m['points']} peaks; within 10%: {m['within_10%']} of "
                  f"{m['points']}; mean error {m['mean_abs_error']:.1%}, largest {m['max_abs_error']:.1%}." + trace,
                  ""]
    params = ", ".join(f"{k} = {v:.4g}" for k, v in result["fitted_params"].items())
    return lines + [f"Fitted on all fitted speed points (shipped as `CALIBRATED` in shardtune/memory/compute.py): "
                    f"{params}."]


def speed_table(rows: list[dict]) -> list[str]:
    out = ["| run | GPUs | card | method | measured tokens/s | needs of the peak | predicted (all-point fit) | "
           "leave-one-out | LOO / measured |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = ("" if factor(r["loo_ratio"]) <= 1.5 else " **") + ("" if r.get("fitted", True) else " (not fitted)")
        out.append(f"| {r['id']} | {r['gpus']} | {r['gpu']} | {r['method']} | {r['measured']:,.0f} | "
                   f"{r['needs_peak_share']:.0%} | {r['predicted']:,.0f} | {r['loo_predicted']:,.0f} | "
                   f"{r['loo_ratio']:.2f}{mark} |")
    return out


def memory_table(rows: list[dict]) -> list[str]:
    out = ["| peak | GPUs | card | method | counter | measured GiB | formula GiB | formula / measured | trace GiB | "
           "trace / measured |", "|---|---:|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = "" if abs(r["formula_ratio"] - 1) <= 0.1 else " **"
        trace = (f"{r['trace_gib']:.2f} | {r['trace_ratio']:.3f}" if "trace_gib" in r
                 else f"- | {r.get('trace_error', 'not traced')}")
        out.append(f"| {r['id']} | {r['gpus']} | {r['gpu']} | {r['method']} | {r['counter']} | "
                   f"{r['measured_gib']:.2f} | {r['formula_gib']:.2f} | {r['formula_ratio']:.3f}{mark} | {trace} |")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = [("speed", "tokens/s per GPU", "loo_predicted", 1.5)] + (
        [("memory", "peak GiB per GPU", "formula_gib", 1.1)] if result.get("memory") else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5), squeeze=False)
    for ax, (key, unit, predicted, band) in zip(axes[0], panels):
        rows = result[key]
        per = [r["gpus"] if key == "speed" else 1 for r in rows]
        xs = [r["measured" if key == "speed" else "measured_gib"] / n for r, n in zip(rows, per)]
        ys = [r[predicted] / n for r, n in zip(rows, per)]
        lo, hi = min(xs + ys) / 1.6, max(xs + ys) * 1.6
        ax.plot([lo, hi], [lo, hi], color="black", lw=1)
        ax.fill_between([lo, hi], [lo / band, hi / band], [lo * band, hi * band], color="grey", alpha=0.2,
                        label=f"within {band:g}x" if key == "speed" else "within 10%")
        own = [r["url"].startswith(OWN_RESULTS) for r in rows]
        for mine, label in ((False, "published"), (True, "shardtune's own")):
            pick = [i for i, o in enumerate(own) if o == mine]
            if pick:
                ax.scatter([xs[i] for i in pick], [ys[i] for i in pick], s=18, marker="s" if mine else "o",
                           color="tab:red" if mine else ("tab:blue" if key == "speed" else "tab:orange"),
                           label=f"{'leave-one-out' if key == 'speed' else 'formula'}, {label}")
        traced = [r for r in rows if "trace_gib" in r]
        if traced:
            ax.scatter([r["measured_gib"] for r in traced], [r["trace_gib"] for r in traced], s=30,
                       facecolors="none", edgecolors="tab:green", label="trace")
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel=f"measured {unit}",
               ylabel=f"predicted {unit}")
        for axis in (ax.xaxis, ax.yaxis):  # after the log scale, which resets the formatters
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{key}: {len(rows)} measured runs ({sum(own)} of them shardtune's own)", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/calibration")
    parser.add_argument("--trace", action="store_true", help="also trace each memory point (slow: minutes each)")
    parser.add_argument("--speed-only", action="store_true",
                        help="refit and recompute the speed points; the memory rows (traced ones too) are kept "
                             "from the .json")
    parser.add_argument("--memory-only", action="store_true",
                        help="recompute the memory points; the speed fit and rows are kept from the .json (and "
                             "without --trace each point's traced figures)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the .md and .png from the .json an earlier run wrote, computing nothing")
    args = parser.parse_args(argv)
    if args.report_only:
        write(json.loads(Path(args.out).with_suffix(".json").read_text()), Path(args.out))
        return 0
    points = load_points()
    if args.memory_only:
        kept = json.loads(Path(args.out).with_suffix(".json").read_text())
        fitted, speed = kept["fitted_params"], kept["speed"]
    else:
        print(f"{len(points)} points: fitting the speed model with each left out", file=sys.stderr)
        full, speed = speed_rows([speed_case(p) for p in points if p.kind == "speed"])
        fitted = asdict(full)
    if args.speed_only:
        memory = json.loads(Path(args.out).with_suffix(".json").read_text())["memory"]
    else:
        memory = memory_rows([p for p in points if p.kind == "memory"], args.trace)
        if args.memory_only and not args.trace:  # the formula changed, shardtune's traced step did not
            traced_before = {row["id"]: row for row in json.loads(Path(args.out).with_suffix(".json").read_text())
                             ["memory"]}
            for row in memory:
                row.update({key: value for key, value in traced_before.get(row["id"], {}).items()
                            if key.startswith("trace_")})
    result = {"fitted_params": fitted, "speed": speed, "speed_summary": speed_summary(speed),
              "memory": memory, "memory_summary": memory_summary(memory) if memory else {}}
    write(result, Path(args.out))
    print(json.dumps({"fitted_params": result["fitted_params"], "speed_summary": result["speed_summary"],
                      "memory_summary": result["memory_summary"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
