"""The bench's runs as a markdown table, with each case's speedup over target-only."""

from __future__ import annotations

from tandem_tools.bench.runners import TARGET_ONLY


def speedups(runs: list[dict]) -> list[float | None]:
    """tokens/s over target-only on the same stack, temperature and concurrency (the peer: over in-process,
    else over the services when only they ran)."""
    base = {(r["stack"], r["temperature"], r["concurrency"]): r["tokens_per_s"] for r in runs
            if r["mode"] == TARGET_ONLY}
    out = []
    for r in runs:
        b = base.get((r["stack"], r["temperature"], r["concurrency"])) or base.get(
            ("services", r["temperature"], r["concurrency"]))
        out.append(r["tokens_per_s"] / b if b else None)
    return out


def markdown_table(runs: list[dict]) -> str:
    lines = [
        ("| stack | mode | K | temperature | concurrency | overlap (hit rate) | tokens/s | speedup "
         "| latency p50 / p99 (s) | mean acceptance length | acceptance per draft | accepted per position "
         "| rounds shed | draft ms/round (head) | CPU busy (cores) |"),
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for r, s in zip(runs, speedups(runs)):
        positions = " ".join(f"{p:.2f}" for p in r["accepted_per_position"]) or "-"
        k = f"N={r['tree']} (depth {r['tree_depth']}, top-k {r['tree_top_k']}; {r['tree_rounds']} tree rounds)" \
            if r.get("tree") else r["K"]
        lines.append(
            f"| {r['stack']} | {r['mode']} | {k} | {r['temperature']:g} | {r['concurrency']} "
            f"| {_overlap_cell(r)} | {r['tokens_per_s']:.1f} | {'-' if s is None else f'{s:.2f}x'} "
            f"| {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['mean_acceptance_length']:.2f} "
            f"| {_rate(r.get('acceptance_per_draft'))} | {positions} | {_share(r.get('shed_rounds'))} "
            f"| {_draft(r)} | {_busy(r.get('cpu_busy'))} |"
        )
    return "\n".join(lines)


def _draft(r: dict) -> str:
    """The draft engine's compute per verify round, and the kind of head (services cases)."""
    return f"{r['draft_ms_per_round']:.2f} ({r['head']})" if r.get("head") else "-"


def _busy(busy: dict | None) -> str:
    """Each service's CPU seconds per second of the case: 1.0 is one core busy all the time."""
    return ", ".join(f"{name} {share:.2f}" for name, share in busy.items()) if busy else "-"


def _share(value: float | None) -> str:
    return f"{value:.0%}" if value else "-"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _overlap_cell(r: dict) -> str:
    """A services case's --overlap, and what it did: the servers overlap greedy generations only, and
    only while one runs, so a case run with it on may have had no round overlapped."""
    if not r.get("overlap"):
        return "off"
    rate = r.get("overlap_hit_rate")
    if rate is not None:
        return f"on ({rate:.0%})"
    return "on (greedy only: none overlapped)" if r["temperature"] > 0 else "on (none overlapped)"


def category_table(runs: list[dict]) -> str:
    """The mean acceptance length of each drafting case by prompt category (MT-Bench's), where the prompts
    have categories; empty otherwise."""
    rows = [r for r in runs if r.get("mean_acceptance_length_by_category")]
    if not rows:
        return ""
    names = list(dict.fromkeys(name for r in rows for name in r["mean_acceptance_length_by_category"]))
    lines = ["| stack | mode | K | temperature | concurrency | " + " | ".join(names) + " | all |",
             "|---|---|---:|---:|---:|" + "---:|" * (len(names) + 1)]
    for r in rows:
        by = r["mean_acceptance_length_by_category"]
        cells = " | ".join(f"{by[n]:.2f}" if n in by else "-" for n in names)
        lines.append(f"| {r['stack']} | {r['mode']} | {r['K']} | {r['temperature']:g} | {r['concurrency']} "
                     f"| {cells} | {r['mean_acceptance_length']:.2f} |")
    return "\n".join(lines)
