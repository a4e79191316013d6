"""traffic.png: what crosses each link per generated token (by kind), and where each round's time goes."""

from __future__ import annotations

from pathlib import Path

from tandem_tools.report import STAGES

KIND_COLORS = {"features": "#d62728", "token_ids": "#1f77b4", "draft_probs": "#9467bd", "text": "#2ca02c",
               "control": "#7f7f7f"}
STAGE_COLORS = {"target_compute": "#d62728", "draft_compute": "#ff7f0e", "transport": "#1f77b4",
                "coordinator": "#7f7f7f", "queueing": "#bcbd22"}
STAGE_LABELS = {"target_compute": "target compute", "draft_compute": "draft compute", "transport": "transport",
                "coordinator": "coordinator", "queueing": "queueing"}


def _bytes_label(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n:.3g} B"


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(14, 10), constrained_layout=True)
    grid = fig.add_gridspec(2, 3, height_ratios=[1.1, 1])
    ax_links = fig.add_subplot(grid[0, :])
    ax_rounds = fig.add_subplot(grid[1, :2])
    ax_share = fig.add_subplot(grid[1, 2])
    _links(ax_links, report)
    _rounds(ax_rounds, report)
    _share(ax_share, report)
    t, acc = report["totals"], report["acceptance"]
    fig.suptitle(
        f"Tandem profile: {t['completed']} requests, {t['generated_tokens']} generated tokens, "
        f"{t['output_tokens_per_s']:.1f} tok/s, mean acceptance length {acc['mean_acceptance_length']:.2f}",
        fontsize=14,
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _links(ax, report: dict) -> None:
    """Grouped horizontal bars, log scale: features are 1000x the token ids, and both must be readable."""
    links = [(name, link) for name, link in report["links"].items() if link["messages"]]
    kinds = [k for k in KIND_COLORS if any(link["by_kind"].get(k, 0) for _, link in links)]
    height = 0.8 / max(len(kinds), 1)
    for i, (name, link) in enumerate(links):
        for j, kind in enumerate(kinds):
            value = link["by_kind_per_token"].get(kind, 0.0)
            if value <= 0:
                continue
            y = i + (j - (len(kinds) - 1) / 2) * height
            ax.barh(y, value, height=height * 0.95, color=KIND_COLORS[kind])
            ax.text(value * 1.08, y, _bytes_label(value), va="center", fontsize=8)
    ax.set_yticks(range(len(links)))
    ax.set_yticklabels([f"{name}\n{_bytes_label(link['bytes_per_token'])}/token" for name, link in links],
                       fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("bytes per generated token (log scale)")
    values = [link["by_kind_per_token"].get(k, 0) for _, link in links for k in kinds]
    positive = [v for v in values if v > 0]
    if positive:
        ax.set_xlim(min(positive) / 2, max(positive) * 8)
    from matplotlib.patches import Patch

    ax.legend([Patch(color=KIND_COLORS[k]) for k in kinds], kinds, loc="lower right", fontsize=9, title="kind")
    ax.grid(axis="x", which="major", alpha=0.3)
    tr = report["transport"]
    ax.set_title(
        f"What crosses each link, per generated token — features: {tr['feature_row_bytes']} B per position "
        f"({tr['target_dtype']}, 3 x {tr['target_hidden_size']}), transport {tr['name']}",
        fontsize=11,
    )


def _rounds(ax, report: dict) -> None:
    """Mean time per round index (0 = prefill) over the requests, stacked by stage."""
    by_index: dict[int, list[dict]] = {}
    for request in report["requests"]:
        for r in request["rounds"]:
            by_index.setdefault(r["index"], []).append(r["stages_ms"])
    indices = sorted(by_index)
    bottom = [0.0] * len(indices)
    for stage in STAGES:
        values = [sum(s[stage] for s in by_index[i]) / len(by_index[i]) for i in indices]
        values = [max(v, 0.0) for v in values]
        ax.bar(indices, values, bottom=bottom, color=STAGE_COLORS[stage], label=STAGE_LABELS[stage], width=0.85)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel("round (0 = prefill)")
    ax.xaxis.get_major_locator().set_params(integer=True)  # rounds are whole numbers
    ax.set_ylabel("ms (mean over requests)")
    ax.set_title("Where each round's time goes", fontsize=11)
    ax.legend(fontsize=9, loc="upper right")
    ax.grid(axis="y", alpha=0.3)
    if indices:
        ax.set_xlim(min(indices) - 0.6, max(indices) + 0.6)


def _share(ax, report: dict) -> None:
    share = report["latency"]["share"]
    stages = [s for s in STAGES if share[s] > 0]
    values = [share[s] for s in stages]
    bars = ax.barh(range(len(stages)), [100 * v for v in values], color=[STAGE_COLORS[s] for s in stages])
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_width() + 1, bar.get_y() + bar.get_height() / 2, f"{100 * value:.1f}%", va="center",
                fontsize=9)
    ax.set_yticks(range(len(stages)))
    ax.set_yticklabels([STAGE_LABELS[s] for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, 115)
    ax.set_xlabel("% of all round time")
    lat = report["latency"]
    ax.set_title(f"Share of round time\n(round {lat['round_ms']:.2f} ms, TTFT p50 {1e3 * lat['ttft_s']['p50']:.1f} ms)",
                 fontsize=11)
