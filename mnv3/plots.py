"""Every figure in results/, one function per figure shape. Each writes a PNG and returns its path.

matplotlib is imported on first use, with the Agg backend: servers and CI have no display, and the
serving path never plots.
"""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path, **savefig) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, **savefig)
    _pyplot().close(fig)
    return path


def plot_variants(rows: list[dict], path) -> Path:
    """Bar chart: mean and p95 latency (left) and file size (right) per variant."""
    import textwrap

    import numpy as np

    plt = _pyplot()
    # wrapped, not rotated: long names ("ONNX Dynamic INT8, uint8 weights") ran into their neighbours'
    names = [textwrap.fill(row["variant"], 9) for row in rows]
    x = np.arange(len(rows))
    fig, (latency_ax, size_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    latency_ax.bar(x - 0.2, [float(row["mean_ms"]) for row in rows], 0.4, label="mean")
    latency_ax.bar(x + 0.2, [float(row["p95_ms"]) for row in rows], 0.4, label="p95")
    latency_ax.set(ylabel="ms per single-image call", title="Latency (batch 1)")
    latency_ax.legend()
    size_ax.bar(x, [float(row["size_mb"]) for row in rows], 0.5, color="tab:green")
    size_ax.set(ylabel="MB", title="Model size")
    for ax in (latency_ax, size_ax):
        ax.set_xticks(x, names, fontsize=9)
    fig.tight_layout()
    return _save(fig, path, dpi=100)


def plot_over_concurrency(
    path,
    concurrencies: list[int],
    lines: dict[str, list[float]],
    ylabel: str,
    title: str,
    points: dict[str, tuple[int, float]] | None = None,
    level: tuple[str, float] | None = None,
    log_y: bool = False,
) -> Path:
    """One line per `lines` label over the concurrencies (log x), single `points` {label: (x, y)} as red
    squares, and an optional dashed horizontal `level` (label, y)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in lines.items():
        ax.plot(concurrencies, values, "o-", label=label)
    for label, (x, y) in (points or {}).items():
        ax.plot([x], [y], "s", color="tab:red", label=label)
    if level is not None:
        ax.axhline(level[1], ls="--", color="gray", label=level[0])
    ax.set(xscale="log", xlabel="concurrent requests", ylabel=ylabel, title=title)
    if log_y:
        ax.set_yscale("log")
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.legend()
    return _save(fig, path, dpi=120, bbox_inches="tight")


def plot_bars(path, labels: list[str], counts: list[float], xlabel: str, ylabel: str, title: str) -> Path:
    """One bar per label, e.g. a histogram whose buckets are already counted."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(labels, counts)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return _save(fig, path, dpi=120, bbox_inches="tight")
