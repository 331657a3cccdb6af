"""``--sprite-plots DIR``: PNGs where a person would rather look than read (matplotlib, Agg backend).

Each kind registers a plotter (:func:`register_plotter`) that turns one assertion payload into files,
built from two shared figures: :func:`step_gaps_figure` (per-step gaps of each arm against the reference,
with the threshold line: parity, criterion v2), :func:`gap_bars_figure` (one bar per figure and arm: the
resume's continuation gaps) and :func:`verdict_grid_figure` (a grid coloured by verdict: the
crash-consistency matrix, crash point by rank). matplotlib is imported
only when plots are written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_sprite.errors import SpriteUsageError
from pytest_sprite.recipes.artifacts import test_dir_name
from pytest_sprite.report.logged_results import TestEntry

__all__ = [
    "PLOTTERS",
    "VERDICT_COLOURS",
    "check_plots_available",
    "gap_bars_figure",
    "register_plotter",
    "step_gaps_figure",
    "verdict_grid_figure",
    "write_plots",
]

GAP_FLOOR = 1e-12
"""Exact zeros are drawn at this height on the log axis (and the legend says so)."""

VERDICT_COLOURS: dict[str, str] = {
    **dict.fromkeys(("pass", "PASS", "rejected"), "#2e7d32"),
    **dict.fromkeys(("FAIL", "fail", "HARD_FAIL", "NOT REJECTED"), "#c62828"),
    "SILENT_DIVERGENCE": "#6a1b9a",
    "LOST_WORK": "#ef6c00",
    "void": "#9e9e9e",
}
"""Verdict -> colour (the verdicts of one meaning share theirs); verdicts not listed are drawn grey."""

Plotter = Callable[[Mapping[str, Any], Path], list[Path]]
"""(payload, file stem without suffix) -> the files written."""

PLOTTERS: dict[str, Plotter] = {}


def register_plotter(kind: str, plotter: Plotter) -> None:
    """Plot every payload of ``kind`` with ``plotter``."""
    PLOTTERS[kind] = plotter


def check_plots_available() -> None:
    """Refuse ``--sprite-plots`` at the start of the session when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SpriteUsageError(
            "--sprite-plots needs matplotlib, which is not installed; pip install 'pytest-sprite[plots]' "
            "(or pip install matplotlib), or drop --sprite-plots"
        )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def _png(path: Path, *, figsize: tuple[float, float]) -> Iterator[Any]:
    """One figure's axes; on leaving, the figure is laid out and written to ``path`` as a PNG, and closed
    either way."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize, dpi=110)
    try:
        yield ax
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def _floored(values: Iterable[float | str]) -> list[float]:
    out = []
    for v in values:
        x = float(v)  # "inf" / "nan" strings from the payloads
        out.append(GAP_FLOOR if x == 0 else (math.inf if math.isnan(x) else x))
    return out


def step_gaps_figure(
    path: Path,
    *,
    title: str,
    series: Mapping[str, Sequence[float | str]],
    threshold: float,
    ylabel: str,
    styles: Mapping[str, str] | None = None,
    colors: Mapping[str, str] | None = None,
) -> Path:
    """One line per series (gap per step, log scale) and the threshold as a dashed red line.

    ``styles`` / ``colors``: matplotlib format string and colour per series (one colour per arm, one
    style per figure of it).
    """
    with _png(path, figsize=(7.5, 4.2)) as ax:
        top = threshold
        for label, values in series.items():
            ys = _floored(values)
            finite = [y for y in ys if math.isfinite(y)]
            top = max([top, *finite])
            # Infinite gaps (a nan norm) are drawn at the top of the axis, marked with x.
            drawn = [y if math.isfinite(y) else top * 10 for y in ys]
            (line,) = ax.plot(
                range(len(ys)),
                drawn,
                (styles or {}).get(label, "o-"),
                label=label,
                markersize=4,
                color=(colors or {}).get(label),
            )
            infinite = [x for x, y in enumerate(ys) if not math.isfinite(y)]
            if infinite:
                ax.plot(infinite, [top * 10] * len(infinite), "x", color=line.get_color(), markersize=9)
        ax.axhline(
            threshold, color="#c62828", linestyle="--", linewidth=1.2, label=f"threshold {threshold:g}"
        )
        ax.set_yscale("log")
        ax.set_ylim(GAP_FLOOR / 3, max(top, threshold) * 30)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", title=f"0 drawn at {GAP_FLOOR:g}", title_fontsize=7)
    return path


def verdict_grid_figure(
    path: Path,
    *,
    title: str,
    rows: Sequence[str],
    columns: Sequence[str],
    verdicts: Mapping[tuple[str, str], str],
    xlabel: str = "rank",
    ylabel: str = "crash point",
) -> Path:
    """A grid of cells (row x column) coloured by verdict, with a legend of the verdicts present."""
    _pyplot()  # the backend, before any other matplotlib import
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch

    grey = to_rgb("#e0e0e0")
    image = [
        [
            to_rgb(VERDICT_COLOURS.get(verdicts[(r, c)], "#9e9e9e")) if (r, c) in verdicts else grey
            for c in columns
        ]
        for r in rows
    ]
    with _png(path, figsize=(max(7.0, 4.5 + 0.4 * len(columns)), max(3.0, 1.2 + 0.3 * len(rows)))) as ax:
        ax.imshow(image, aspect="auto", interpolation="nearest")
        # White lines between cells, so neighbouring cells of one verdict stay countable.
        ax.set_xticks([x - 0.5 for x in range(1, len(columns))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set_xticks(range(len(columns)), labels=list(columns), fontsize=7)
        ax.set_yticks(range(len(rows)), labels=list(rows), fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        present = list(dict.fromkeys(verdicts.values()))
        ax.legend(
            handles=[Patch(color=VERDICT_COLOURS.get(v, "#9e9e9e"), label=v) for v in present],
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.01, 1.0),
        )
    return path


def _plot_path(stem: Path) -> Path:
    """Where a payload's one plot is saved: beside the report, ``<stem>.png``."""
    return stem.parent / f"{stem.name}.png"


def _passed(payload: Mapping[str, Any]) -> str:
    """``passed`` or ``failed``, as a plot's title says a payload's result."""
    return "passed" if payload.get("passed") else "failed"


def _parity_plot(payload: Mapping[str, Any], stem: Path) -> list[Path]:
    series: dict[str, Sequence[float | str]] = {}
    styles: dict[str, str] = {}
    colors: dict[str, str] = {}
    for i, arm in enumerate(payload["arms"]):
        if arm.get("pre_norm_rel_steps"):
            for figure, key, style in (
                ("pre-clip", "pre_norm_rel_steps", "o-"),
                ("post-clip", "post_norm_rel_steps", "s:"),
            ):
                label = f"{arm['label']} {figure}"
                series[label] = arm[key]
                styles[label] = style
                colors[label] = f"C{i % 10}"
    if not series:
        return []
    return [
        step_gaps_figure(
            _plot_path(stem),
            title=f"FP32 parity {_passed(payload)}: gradient-norm gap per step vs the single-device reference\n{stem.name}",
            series=series,
            threshold=float(payload["rtol"]),
            ylabel="relative gap |arm - ref| / ref (worst rank)",
            styles=styles,
            colors=colors,
        )
    ]


register_plotter("parity", _parity_plot)


def gap_bars_figure(
    path: Path,
    *,
    title: str,
    groups: Mapping[str, Mapping[str, float | str]],
    ylabel: str,
) -> Path:
    """Grouped bars on a log scale: one group per arm, one bar per figure (same colour per figure).

    For figures that are one number per arm (the resume's largest continuation gaps), where a per-step
    line has nothing to draw. Exact zeros stand at :data:`GAP_FLOOR`; infinite gaps reach the top, hatched.
    """
    names = list(dict.fromkeys(name for figures in groups.values() for name in figures))
    with _png(path, figsize=(max(7.0, 2.0 + 1.3 * len(groups)), 4.2)) as ax:
        values = {arm: dict(zip(figs, _floored(figs.values()), strict=True)) for arm, figs in groups.items()}
        finite = [v for figs in values.values() for v in figs.values() if math.isfinite(v)]
        top = max([GAP_FLOOR, *finite])
        width = 0.8 / max(1, len(names))
        for j, name in enumerate(names):
            xs, heights, hatches = [], [], []
            for i, arm in enumerate(groups):
                if name in values[arm]:
                    v = values[arm][name]
                    xs.append(i - 0.4 + width * (j + 0.5))
                    heights.append(v if math.isfinite(v) else top * 10)
                    hatches.append("" if math.isfinite(v) else "xx")
            bars = ax.bar(xs, heights, width=width, label=name, color=f"C{j % 10}")
            for bar, hatch in zip(bars, hatches, strict=True):
                bar.set_hatch(hatch)
        ax.set_yscale("log")
        ax.set_ylim(GAP_FLOOR / 3, top * 30)
        ax.set_xticks(range(len(groups)), labels=list(groups), fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        ax.legend(
            fontsize=7, loc="upper left", title=f"0 drawn at {GAP_FLOOR:g}; hatched: inf", title_fontsize=7
        )
    return path


def _criterion_plot(payload: Mapping[str, Any], stem: Path) -> list[Path]:
    """Per-step largest normalized gradient gap of ddp, fsdp and split_premul against split (the diagnostics),
    with the per-tensor rtol as the threshold line: only step 0 is scored, later steps are reported."""
    series: dict[str, Sequence[float | str]] = {}
    for pair in payload.get("diagnostics", {}).get("pairs", []):
        against = str(pair["against"])
        if (against == "split" or against.startswith("split (")) and pair["max_gap"]:
            series[f"{pair['arm']} vs {against}"] = pair["max_gap"]
    if not series:
        return []
    return [
        step_gaps_figure(
            _plot_path(stem),
            title=(
                f"BF16 criterion v2 {payload['verdict']}: largest per-tensor gradient gap per step vs split\n"
                f"(step 0 scored, later steps reported)  {stem.name}"
            ),
            series=series,
            threshold=float(payload["limits"]["rtol"]),
            ylabel="L2 diff / max(ref norm, floor), worst tensor",
        )
    ]


def _resume_plot(payload: Mapping[str, Any], stem: Path) -> list[Path]:
    """The continuation gaps of each resumed arm against the uninterrupted fit (reported, not required)."""
    from pytest_sprite.report.kinds import RESUME_GAPS

    names = {"loss": "loss", "pre_clip_norm": "pre-clip norm", "update": "update", "adam_m": "Adam m"}
    names["adam_v"] = "Adam v"
    groups = {str(g["arm"]): {names[k]: g[k] for k in RESUME_GAPS} for g in payload["gaps"]}
    if not groups:
        return []
    return [
        gap_bars_figure(
            _plot_path(stem),
            title=(
                f"Checkpoint resume {_passed(payload)} ({payload['run']}): largest continuation gap vs the\n"
                f"uninterrupted fit (reported, not required)  {stem.name}"
            ),
            groups=groups,
            ylabel="largest relative gap over the resumed steps",
        )
    ]


def _crash_plot(payload: Mapping[str, Any], stem: Path) -> list[Path]:
    """The crash matrix as a grid: a row per file event (nth occurrence apart), a column per rank that died."""
    points = payload["rows"]
    if not points:
        return []
    keys: list[tuple[str, int]] = []
    seen: dict[tuple[str, int], int] = {}
    for p in points:
        what = f"{p['event']} {p['file']}" + (" (torn)" if p["torn"] else "")
        n = seen.get((what, p["rank"]), 0)
        seen[(what, p["rank"])] = n + 1
        keys.append((what, n))
    repeated = {what for what, n in keys if n > 0}
    labels = [_cut(what) + (f" #{n + 1}" if what in repeated else "") for what, n in keys]
    columns = sorted({int(p["rank"]) for p in points if p["rank"] is not None})
    verdicts = {(label, str(p["rank"])): str(p["verdict"]) for label, p in zip(labels, points, strict=True)}
    return [
        verdict_grid_figure(
            _plot_path(stem),
            title=(
                f"Crash consistency of {_cut(str(payload['target']))} {_passed(payload)}: "
                f"control {payload['control']['verdict']}\n{stem.name}"
            ),
            rows=list(dict.fromkeys(labels)),
            columns=[str(c) for c in columns],
            verdicts=verdicts,
            xlabel="rank that died",
            ylabel="crash point (file event)",
        )
    ]


def _cut(text: str, limit: int = 48) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3) :]


register_plotter("criterion_v2", _criterion_plot)
register_plotter("resume", _resume_plot)
register_plotter("crash_consistency", _crash_plot)


def write_plots(entries: Iterable[TestEntry], directory: str) -> list[Path]:
    """Every registered kind's plots for every test, as ``DIR/<test>-<kind>-<n>.png``."""
    written: list[Path] = []
    root = Path(directory)
    for entry in entries:
        for i, payload in enumerate(entry.assertions, start=1):
            plotter = PLOTTERS.get(str(payload["kind"]))
            if plotter is not None:
                stem = root / f"{test_dir_name(entry.nodeid)}-{payload['kind']}-{i}"
                written += plotter(payload, stem)
    return written
