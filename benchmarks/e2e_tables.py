"""bench_e2e's tables (markdown) and plot, from its Measurements (benchmarks/bench_e2e.py); the
GPU report renders the same tables."""

from __future__ import annotations

from benchmarks import compile_breakdown

BASELINES = ("eager", "compile", "ceiling")  # ceiling: bench_e2e's docstring


def ratio_rows(results: list) -> list[str]:
    """fxamp / baseline for each metric (below 1: fxamp is faster, smaller or compiles sooner)."""
    rows = ["| model | dtype | fxamp | vs | step time | peak memory | compile time |",
            "|---|---|---|---|---:|---:|---:|"]
    by = {(r.model, r.dtype, r.recipe): r for r in results if r.step_ms is not None}
    for (model, dtype, recipe), r in by.items():
        for base in BASELINES if recipe not in BASELINES else ():
            b = by.get((model, dtype, base))
            if b is None:
                continue
            compile_ratio = (f"{r.compile_s / b.compile_s:.2f}x"
                             if base == "compile" and b.compile_s else "-")
            rows.append(f"| {model} | {dtype} | {recipe} | {base} | {r.step_ms / b.step_ms:.2f}x"
                        f" | {r.peak_mb / b.peak_mb:.2f}x | {compile_ratio} |")
    return rows


def absolute_rows(results: list) -> list[str]:
    rows = ["| model | dtype | recipe | step (ms) | throughput | MFU | peak memory (MiB) | "
            "compile (s) | first step (s) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        step = "-" if r.step_ms is None else f"{r.step_ms:.1f}"
        rate = "-" if r.throughput is None else f"{r.throughput:,.0f} {r.unit}"
        mfu = "-" if r.mfu is None else f"{100 * r.mfu:.1f}%"
        compile_s = "-" if r.compile_s is None else f"{r.compile_s:.1f}"
        rows.append(f"| {r.model} | {r.dtype} | {r.recipe} | {step} | {rate} | {mfu} | "
                    f"{r.peak_mb:.1f} | {compile_s} | {r.first_step_s:.1f} |")
    return rows


def breakdown_rows(results: list) -> list[str]:
    return compile_breakdown.rows([
        (r.model, f"{r.dtype} {r.recipe}", compile_breakdown.Breakdown(**r.breakdown))
        for r in results if r.breakdown])


def plot(results: list, path: str, title: str) -> None:
    """Each recipe's step time, peak memory and compile time relative to `compile`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("step_ms", "step time"), ("peak_mb", "peak memory"), ("compile_s", "compile"))
    timed = [r for r in results if r.step_ms is not None]
    models = list(dict.fromkeys((r.model, r.dtype) for r in timed))
    recipes = list(dict.fromkeys(r.recipe for r in timed))
    by = {(r.model, r.dtype, r.recipe): r for r in timed}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8), sharey=False)
    width = 0.8 / len(recipes)
    for ax, (field, label) in zip(axes, metrics):
        for i, recipe in enumerate(recipes):
            values = [getattr(by[(*m, recipe)], field) / max(getattr(by[(*m, "compile")], field),
                                                              1e-9) for m in models]
            ax.bar([k + i * width for k in range(len(models))], values, width, label=recipe)
        ax.axhline(1.0, color="gray", lw=0.8)
        names = [m if len({d for _, d in models}) == 1 else f"{m} {d}" for m, d in models]
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(models))], names)
        ax.set_title(f"{label} / torch.compile+autocast")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
