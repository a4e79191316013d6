"""The bench's PNG: tokens/s per case, one panel per (temperature, concurrency)."""

from __future__ import annotations

from pathlib import Path

from tandem_tools.bench.runners import EAGLE3, EAGLE3_TREE, P_EAGLE, PEER, TARGET_ONLY
from tandem_tools.bench.table import speedups


def plot_runs(runs: list[dict], path: Path, title: str = "") -> Path:
    """One panel per (temperature, concurrency): tokens/s per case, bars grouped by stack, each bar
    labelled with its speedup over target-only and its mean acceptance length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["temperature"], r["concurrency"]) for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False, layout="constrained")
    colors = {TARGET_ONLY: "#7f7f7f", EAGLE3: "#d62728", EAGLE3_TREE: "#9467bd", P_EAGLE: "#2ca02c", PEER: "#1f77b4"}
    ups = speedups(runs)
    for ax, (temperature, concurrency) in zip(axes[0], panels):
        items = [(r, s) for r, s in zip(runs, ups) if (r["temperature"], r["concurrency"]) == (temperature, concurrency)]
        top_k = max(1, max(r["K"] for r, _ in items))
        x, ticks, groups = 0.0, [], {}
        for r, s in items:
            group = "assisted generation" if r["mode"] == PEER else r["stack"]
            if groups and group not in groups:
                x += 0.7  # a gap between groups
            groups.setdefault(group, []).append(x)
            shade = 1.0 if r["mode"] == TARGET_ONLY else 0.45 + 0.55 * r["K"] / top_k
            ax.bar(x, r["tokens_per_s"], color=colors[r["mode"]], alpha=shade)
            note = "" if s is None else f"{s:.2f}x"
            if r["mode"] != TARGET_ONLY:
                note += f"\nτ={r['mean_acceptance_length']:.2f}"
            ax.text(x, r["tokens_per_s"], note, ha="center", va="bottom", fontsize=8)
            tick = "target\nonly" if r["mode"] == TARGET_ONLY else f"N={r['tree']}" if r.get("tree") else f"K={r['K']}"
            ticks.append((x, tick + ("\noverlap" if r.get("overlap") else "")))
            x += 1.0
        ax.set_xticks([p for p, _ in ticks], [t for _, t in ticks], fontsize=8)
        for group, xs in groups.items():
            ax.annotate(group, (sum(xs) / len(xs), 0), xycoords=("data", "axes fraction"), xytext=(0, -34),
                        textcoords="offset points", ha="center", va="top", fontsize=10, fontweight="bold")
        ax.set_ylabel("generated tokens/s")
        ax.set_title(f"temperature {temperature:g}, concurrency {concurrency}")
        ax.margins(y=0.18)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["target-only", "EAGLE-3", "EAGLE-3, draft tree", "P-EAGLE head",
                         "assisted generation (transformers)"], loc="outside lower center", ncol=5, fontsize=9)
    fig.suptitle(title or "tandem bench")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
