"""The shapes benchmark's figures: bar charts per shape, the accuracy study's lines and
the time-memory trade-off curves."""


def plot(rows, acc_rows, path, header):
    """Bar charts of rows (and the accuracy study's lines), each figure headed by the
    run's machine and versions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if acc_rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in sorted({r.method for r in acc_rows}):
            pts = [(r.N, r.dW_err) for r in acc_rows if r.method == m]
            ax.plot(*zip(*pts), marker="o", label=m)
        ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="dW rel. error vs float64")
        ax.legend(fontsize=7)
        fig.suptitle(header, fontsize=7)
        fig.tight_layout()
        fig.savefig(path.replace(".png", "_accuracy.png"), dpi=120)
    if not rows:
        return
    shapes = sorted({r.shape for r in rows}, key=[r.shape for r in rows].index)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, field, label in zip(axes, ("x_mm", "extra_mib", "dW_err"),
                                ("time / one matmul", "extra memory (MiB)", "dW rel. error")):
        names = sorted({r.method for r in rows}, key=[r.method for r in rows].index)
        width = 0.8 / len(names)
        for i, m in enumerate(names):
            vals = [next((getattr(r, field) for r in rows if r.shape == s and r.method == m),
                         0.0) for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes)
        ax.set_title(label)
        if field != "x_mm":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(header, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _family(method):
    """The curve a method's point belongs to in the time-memory plot."""
    if method.startswith("fce-fp32@"):
        return "fce-fp32 (workspace MiB)"
    if method.startswith("quack-"):
        return method.rsplit("-", 1)[0] + " (chunk)"
    return method


def plot_tradeoff(rows, path, header):
    """Time vs peak extra memory, one panel per shape, each sweep a labelled curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in rows}, key=[r.shape for r in rows].index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        here = [r for r in rows if r.shape == shape and r.method != "torch"]
        # Points far above the best would squash the curves: listed instead of drawn.
        best = min(r.x_mm for r in here)
        off = [r for r in here if r.x_mm > 1.6 * best]
        here = [r for r in here if r.x_mm <= 1.6 * best]
        if off:
            ax.text(0.02, 0.98, "off the chart: " + ", ".join(
                f"{r.method} {r.x_mm:.1f}x" for r in off), transform=ax.transAxes,
                fontsize=7, va="top")
        for fam in sorted({_family(r.method) for r in here}):
            pts = sorted((r.extra_mib, r.x_mm, r.method) for r in here
                         if _family(r.method) == fam)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=fam, linestyle="-" if len(pts) > 1 else "none")
            for x, y, m in pts:
                if "@" in m or m.startswith("quack-"):
                    ax.annotate(m.rsplit("@", 1)[-1].rsplit("-", 1)[-1], (x, y), fontsize=6,
                                textcoords="offset points", xytext=(3, 3))
        r0 = here[0]
        ax.set(xscale="log", xlabel="peak extra memory (MiB)", ylabel="time / one matmul",
               title=f"{shape} {r0.N}x{r0.D}x{r0.V}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(header, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
