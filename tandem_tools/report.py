"""The profile report: per-request profiles (coordinator/probe.py) -> report.json and the terminal summary.

Where a round's time goes (all from the coordinator's clock and the services' StepTiming; the
services' durations are differences on their own clocks, so no clock alignment is needed here):

    target_compute  the target engine's step (forward, acceptance, feature capture)
    draft_compute   the draft engine's step (fc fusion, extend, K-step rollout)
    queueing        a step waiting for its engine behind another session's step
    transport       the rest of each step's round trip: serialization, the wire, gRPC, the feature
                    codec, the service shell, and relaying the previous step's feature chunks
    coordinator     the rest of the round: the round loop (a grammar's masks too), detokenizing, stop strings,
                    the client send

They add up to the round's wall time. Rounds run propose then verify, one after the other; with
overlap, a round whose drafts were prepared during the last verify (a hit) has no propose, and the
ahead step runs during the verify: only the part of it that outlasts the verify is waited for (counted
as draft_compute), as for a draft step sent beside a target-only round (the draft taking in its pairs).
"Saved per round" estimates what overlap won: a hit round skips a propose round trip (the mean of the
rounds that ran one), minus the time waited on aheads that outlasted their verify.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from tandem.dtypes import ITEMSIZE
from tandem.stats import mean_acceptance_length, percentile
from tandem.traffic import KINDS, LINKS
from tandem.v1 import profile_pb2

STAGES = ("target_compute", "draft_compute", "transport", "coordinator", "queueing")
# the gRPC connections and the links they carry; a fast path adds target->draft
CONNECTIONS = {
    "client<->coordinator": ("client->coordinator", "coordinator->client"),
    "coordinator<->target": ("coordinator->target", "target->coordinator"),
    "coordinator<->draft": ("coordinator->draft", "draft->coordinator"),
    "target->draft": ("target->draft",),
}


@dataclass
class RequestRecord:
    """One profiled request as the client saw it, with the coordinator's profile."""

    index: int
    sent_ns: int  # the client's CLOCK_MONOTONIC
    delta_ns: list[int] = field(default_factory=list)  # when each answer arrived
    delta_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: dict = field(default_factory=dict)
    profile: profile_pb2.RequestProfile | None = None
    error: str | None = None


def round_stages(r: profile_pb2.RoundProfile) -> dict[str, int]:
    """One round's wall time split into STAGES (ns)."""
    wall = r.end_ns - r.start_ns
    stages = dict.fromkeys(STAGES, 0)
    waited = 0
    steps = [(r.target, r.target_sent_ns, r.target_received_ns, "target")]  # waited for whole
    besides = [(r.ahead_sent_ns, r.ahead_received_ns)]  # ran during the verify: only what outlasts it
    if r.draft_sent_ns and r.target_sent_ns and r.draft_sent_ns < r.target_received_ns \
            and r.target_sent_ns < r.draft_received_ns:  # a draft step sent with the verify (an extend)
        besides.append((r.draft_sent_ns, r.draft_received_ns))
    else:
        steps.append((r.draft, r.draft_sent_ns, r.draft_received_ns, "draft"))
    for step, sent, received, who in steps:
        if not sent or not received:
            continue
        rtt = received - sent
        stages[f"{who}_compute"] += step.compute_ns
        stages["queueing"] += step.queue_ns
        stages["transport"] += rtt - step.compute_ns - step.queue_ns
        waited += rtt
    for sent, received in besides:
        if sent and received:
            exposed = outlasting_ns(r, sent, received)
            stages["draft_compute"] += exposed
            waited += exposed
    stages["coordinator"] = wall - waited
    return stages


def ahead_exposed_ns(r: profile_pb2.RoundProfile) -> int:
    """How long the round waited for its ahead step after the verify had answered."""
    return outlasting_ns(r, r.ahead_sent_ns, r.ahead_received_ns)


def outlasting_ns(r: profile_pb2.RoundProfile, sent: int, received: int) -> int:
    """How long a draft step sent beside the round's verify (`sent`, answered at `received`) outlasted it."""
    return max(0, received - max(r.target_received_ns, sent))


def connection_transport(r: profile_pb2.RoundProfile) -> dict[str, int]:
    """A round's transport time per connection (ns)."""
    out = {}
    for step, sent, received, name in (
        (r.target, r.target_sent_ns, r.target_received_ns, "coordinator<->target"),
        (r.draft, r.draft_sent_ns, r.draft_received_ns, "coordinator<->draft"),
    ):
        if sent and received:
            out[name] = received - sent - step.compute_ns - step.queue_ns
    return out


def _dist(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "count": 0}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values), "count": len(values)}


def build_report(records: list[RequestRecord], wall_s: float, config: dict, send_site: dict | None = None) -> dict:
    """report.json: links, totals, latency, acceptance, transport, and per request, per round detail."""
    done = [r for r in records if r.error is None and r.profile is not None]
    links = {link: {"bytes": 0, "messages": 0, "by_kind": dict.fromkeys(KINDS, 0), "token_ids": 0,
                    "feature_rows": 0, "transport": "grpc"} for link in LINKS}
    stage_ns = dict.fromkeys(STAGES, 0)
    prefill_ns = dict.fromkeys(STAGES, 0)
    conn_ns: dict[str, int] = defaultdict(int)
    codec_ns = 0
    wall_rounds_ns = 0
    verify_rounds = 0
    prompt_tokens = generated = 0
    requests = []
    ttft, itl, e2e = [], [], []
    accepted_per_position: list[int] = []
    num_draft_tokens = num_accepted = num_drafts = 0
    profile0 = done[0].profile if done else None
    overlap_rounds = overlap_hits = hit_rounds = tree_rounds = 0
    drafted_rounds = 0  # verify rounds that carried drafts
    propose_ns: list[int] = []  # round trips of the proposes that ran
    propose_compute_ns: list[int] = []  # the draft engine's part of each
    exposed_ns = 0
    # constrained requests (a grammar, min_tokens): the coordinator's mask time, their rounds and round time
    masked = {"requests": 0, "seconds": 0.0, "rounds": 0, "round_ns": 0, "cuts": 0, "forced": 0}

    for rec in done:
        p = rec.profile
        rounds_out = []
        req_links: dict[str, int] = defaultdict(int)
        for r in p.rounds:
            stages = round_stages(r)
            target = prefill_ns if r.index == 0 else stage_ns
            for stage, ns in stages.items():
                target[stage] += ns
            if r.index > 0:
                verify_rounds += 1
                drafted_rounds += r.num_drafts > 0
                wall_rounds_ns += r.end_ns - r.start_ns
                hit_rounds += r.overlap_hit
                if r.draft_sent_ns and r.draft_received_ns:
                    propose_ns.append(r.draft_received_ns - r.draft_sent_ns)
                    propose_compute_ns.append(r.draft.compute_ns)
                if r.ahead_sent_ns and r.ahead_received_ns:
                    exposed_ns += ahead_exposed_ns(r)
            for name, ns in connection_transport(r).items():
                conn_ns[name] += ns
            codec_ns += r.target.codec_ns + r.draft.codec_ns
            round_bytes = {}
            for t in r.traffic:
                link = links.setdefault(t.link, {"bytes": 0, "messages": 0, "by_kind": dict.fromkeys(KINDS, 0),
                                                 "token_ids": 0, "feature_rows": 0})
                link["transport"] = t.transport
                link["messages"] += t.messages
                for kind, n in t.bytes.items():
                    link["by_kind"][kind] = link["by_kind"].get(kind, 0) + n
                    link["bytes"] += n
                link["token_ids"] += t.token_ids
                link["feature_rows"] += t.feature_rows
                size = sum(t.bytes.values())
                round_bytes[t.link] = size
                req_links[t.link] += size
                if r.index == 0 and t.link == "coordinator->target":
                    prompt_tokens += t.token_ids
            rounds_out.append({
                "index": r.index, "wall_ms": (r.end_ns - r.start_ns) / 1e6,
                "stages_ms": {k: v / 1e6 for k, v in stages.items()},
                "num_drafts": r.num_drafts, "num_accepted": r.num_accepted, "num_tokens": r.num_tokens,
                "bytes": round_bytes,
            })
        generated += len(rec.token_ids)
        if rec.delta_ns:
            ttft.append((rec.delta_ns[0] - rec.sent_ns) / 1e9)
            e2e.append((rec.delta_ns[-1] - rec.sent_ns) / 1e9)
            for before, now, n in zip(rec.delta_ns, rec.delta_ns[1:], rec.delta_tokens[1:], strict=False):
                if n:
                    itl.append((now - before) / 1e9 / n)
        s = rec.stats
        overlap_rounds += s.get("num_overlap_rounds", 0)
        overlap_hits += s.get("num_overlap_hits", 0)
        tree_rounds += s.get("num_tree_rounds", 0)
        if s.get("constraint_seconds", 0) > 0:
            masked["requests"] += 1
            masked["seconds"] += s["constraint_seconds"]
            masked["rounds"] += len(p.rounds) - 1
            masked["round_ns"] += sum(r.end_ns - r.start_ns for r in p.rounds if r.index > 0)
            masked["cuts"] += s.get("num_constrained_cuts", 0)
            masked["forced"] += s.get("num_forced_drafts", 0)
        num_draft_tokens += s.get("num_draft_tokens", 0)
        num_accepted += s.get("num_accepted_tokens", 0)
        if s.get("accepted_per_position"):
            num_drafts += s.get("num_rounds", 0) - s.get("num_rounds_without_draft", 0)
        for k, n in enumerate(s.get("accepted_per_position", [])):
            if k >= len(accepted_per_position):
                accepted_per_position.append(0)
            accepted_per_position[k] += n
        requests.append({
            "index": rec.index, "prompt_tokens": next((t.token_ids for t in p.rounds[0].traffic
                                                       if t.link == "coordinator->target"), 0),
            "generated_tokens": len(rec.token_ids), "finish_reason": rec.finish_reason,
            "num_rounds": len(p.rounds) - 1, "mean_acceptance_length": s.get("mean_acceptance_length", 0.0),
            "ttft_s": ttft[-1] if rec.delta_ns else None, "e2e_s": e2e[-1] if rec.delta_ns else None,
            "bytes": dict(req_links), "rounds": rounds_out,
        })

    per_token = max(generated, 1)
    for link in links.values():
        link["bytes_per_token"] = link["bytes"] / per_token
        link["by_kind_per_token"] = {k: v / per_token for k, v in link["by_kind"].items()}
    total_ns = sum(stage_ns.values()) + sum(prefill_ns.values())
    all_ns = {k: stage_ns[k] + prefill_ns[k] for k in STAGES}
    rounds = max(verify_rounds, 1)
    hidden = profile0.target_hidden_size if profile0 else 0
    dtype = profile0.target_dtype if profile0 else ""
    transport_ns = all_ns["transport"]
    report = {
        "config": config,
        "totals": {
            "requests": len(records), "completed": len(done), "errors": len(records) - len(done),
            "prompt_tokens": prompt_tokens, "generated_tokens": generated, "rounds": verify_rounds,
            "wall_s": wall_s, "output_tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
            "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        },
        "links": links,
        "latency": {
            "stages": {k: v / 1e9 for k, v in all_ns.items()},
            "share": {k: (v / total_ns if total_ns else 0.0) for k, v in all_ns.items()},
            "per_round_ms": {k: v / 1e6 / rounds for k, v in stage_ns.items()},
            "round_ms": wall_rounds_ns / 1e6 / rounds,
            "prefill_ms": {k: v / 1e6 / max(len(done), 1) for k, v in prefill_ns.items()},
            "ttft_s": _dist(ttft), "itl_s": _dist(itl), "e2e_s": _dist(e2e),
        },
        "acceptance": {
            "mean_acceptance_length": mean_acceptance_length(num_accepted, verify_rounds),
            "accepted_per_position": accepted_per_position,
            "acceptance_rate_per_position": [n / num_drafts if num_drafts else 0.0 for n in accepted_per_position],
            "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted,
            "draft_acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        },
        "transport": {
            "name": profile0.transport if profile0 else "grpc",
            "features": ("target -> coordinator -> draft, inline in the scheduler's batches over gRPC"
                         if not profile0 or profile0.transport == "grpc"
                         else f"target -> draft by {profile0.transport}; the coordinator relays a descriptor"),
            "target_hidden_size": hidden, "target_dtype": dtype,
            "feature_row_bytes": 3 * hidden * ITEMSIZE.get(dtype, 0),
            "target_device": profile0.target_device if profile0 else "",
            "draft_device": profile0.draft_device if profile0 else "",
            "seconds": transport_ns / 1e9, "share": transport_ns / total_ns if total_ns else 0.0,
            "codec_seconds": codec_ns / 1e9,
            "connections": {
                name: {"bytes": sum(links[link]["bytes"] for link in members if link in links),
                       "seconds": conn_ns.get(name, 0) / 1e9,
                       "share": conn_ns.get(name, 0) / total_ns if total_ns else 0.0}
                for name, members in CONNECTIONS.items()
            },
        },
        "requests": requests,
        "errors": [{"index": r.index, "error": r.error} for r in records if r.error is not None],
    }
    # speculative sampling: q of every sampled draft, draft -> coordinator, then relayed to the target
    q_bytes = links["draft->coordinator"]["by_kind"]["draft_probs"]
    report["draft_probs"] = {
        "bytes": q_bytes, "relayed_to_target_bytes": links["coordinator->target"]["by_kind"]["draft_probs"],
        "drafted_rounds": drafted_rounds, "bytes_per_round": q_bytes / drafted_rounds if drafted_rounds else 0.0,
        "bytes_per_draft": q_bytes / num_draft_tokens if num_draft_tokens else 0.0,
    }
    tree_bytes = links["draft->coordinator"]["by_kind"]["tree"]
    report["tree"] = {  # draft trees: each node's parent, draft -> coordinator, then relayed to the target
        "bytes": tree_bytes, "relayed_to_target_bytes": links["coordinator->target"]["by_kind"]["tree"],
        "tree_rounds": tree_rounds, "bytes_per_tree_round": tree_bytes / tree_rounds if tree_rounds else 0.0,
    }
    propose_ms = statistics.fmean(propose_ns) / 1e6 if propose_ns else 0.0
    report["overlap"] = {
        "rounds": overlap_rounds, "hits": overlap_hits,
        "hit_rate": overlap_hits / overlap_rounds if overlap_rounds else 0.0,
        "rounds_with_prepared_drafts": hit_rounds, "propose_round_trip_ms": propose_ms,
        "ahead_wait_ms_per_round": exposed_ns / 1e6 / rounds,
        "saved_ms_per_round": (hit_rounds * propose_ms - exposed_ns / 1e6) / rounds,
    }
    report["draft"] = {  # the draft's time per round, by the kind of head (config "head", when known)
        "head": config.get("head") or "", "proposes": len(propose_compute_ns),
        "compute_ms_per_propose": statistics.fmean(propose_compute_ns) / 1e6 if propose_compute_ns else 0.0,
        "compute_ms_per_round": report["latency"]["per_round_ms"]["draft_compute"],
    }
    per_masked_round = max(masked["rounds"], 1)
    report["grammar"] = {  # the masks, computed in the coordinator's round loop (part of its stage)
        "constrained_requests": masked["requests"], "rounds": masked["rounds"], "mask_seconds": masked["seconds"],
        "mask_ms_per_round": masked["seconds"] * 1e3 / per_masked_round,
        "share_of_round_time": masked["seconds"] * 1e9 / masked["round_ns"] if masked["round_ns"] else 0.0,
        "cuts_per_round": masked["cuts"] / per_masked_round,
        "forced_drafts_per_round": masked["forced"] / per_masked_round,
    }
    if send_site is not None:
        report["transport"]["send_site"] = send_site
    return report


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summary(report: dict) -> str:
    """The terminal table: per link, bytes per generated token and the share of round time, then stages."""
    t = report["totals"]
    head = (f"{t['completed']}/{t['requests']} requests, {t['prompt_tokens']} prompt + {t['generated_tokens']} "
            f"generated tokens, {t['rounds']} rounds in {t['wall_s']:.2f}s ({t['output_tokens_per_s']:.1f} tok/s); "
            f"mean acceptance length {report['acceptance']['mean_acceptance_length']:.2f}")
    columns = (f"{'link':<22}{'msgs':>8}{'total':>12}{'B/token':>10}{'features':>10}{'token_ids':>10}{'q':>8}"
               f"{'text':>7}{'control':>9}   time share (connection)")
    lines = [head, "", columns]
    share_of = {link: (name, c["share"]) for name, c in report["transport"]["connections"].items()
                for link in CONNECTIONS[name]}
    for name, link in report["links"].items():
        if not link["messages"]:
            continue
        per = link["by_kind_per_token"]
        conn, share = share_of.get(name, ("", 0.0))
        by = f" by {link['transport']}" if link.get("transport") else ""
        shown = f"{100 * share:5.1f}% ({conn}{by})" if conn != "client<->coordinator" else "   in coordinator"
        lines.append(
            f"{name:<22}{link['messages']:>8}{_human_bytes(link['bytes']):>12}{link['bytes_per_token']:>10.1f}"
            f"{per['features']:>10.1f}{per['token_ids']:>10.2f}{per['draft_probs']:>8.1f}{per['text']:>7.2f}"
            f"{per['control']:>9.1f}   {shown}"
        )
    lat = report["latency"]
    lines += ["", f"{'stage':<16}{'total s':>10}{'ms/round':>10}{'share':>8}"]
    for stage in STAGES:
        lines.append(f"{stage:<16}{lat['stages'][stage]:>10.3f}{lat['per_round_ms'][stage]:>10.2f}"
                     f"{100 * lat['share'][stage]:>7.1f}%")
    draft = report.get("draft", {})
    if draft.get("proposes"):
        lines.append(f"draft ({draft['head'] or 'head not known'}): {draft['compute_ms_per_propose']:.2f} ms of "
                     f"draft compute per propose ({draft['proposes']} proposes), {draft['compute_ms_per_round']:.2f} "
                     f"ms per round waited on it")
    q = report.get("draft_probs", {})
    if q.get("bytes"):
        lines.append(f"q (sampled drafts' distributions): {q['bytes_per_round']:.0f} B per drafted round per session, "
                     f"{q['bytes_per_draft']:.0f} B per draft (draft -> coordinator, relayed to the target)")
    tree = report.get("tree", {})
    if tree.get("tree_rounds"):
        lines.append(f"draft trees: {tree['bytes_per_tree_round']:.0f} B of tree shape per tree round per session "
                     f"({tree['tree_rounds']} tree rounds; node ids count as token_ids)")
    grammar = report.get("grammar", {})
    if grammar.get("constrained_requests"):
        lines.append(f"grammar: {grammar['mask_ms_per_round']:.2f} ms of masks per round in the coordinator "
                     f"({100 * grammar['share_of_round_time']:.1f}% of round time), "
                     f"{grammar['cuts_per_round']:.2f} drafts cut and {grammar['forced_drafts_per_round']:.2f} "
                     f"forced per round ({grammar['constrained_requests']} constrained requests)")
    ov = report.get("overlap", {})
    if ov.get("rounds"):
        lines.append(
            f"overlap: {ov['hits']}/{ov['rounds']} verifies hit ({100 * ov['hit_rate']:.0f}%): "
            f"{ov['rounds_with_prepared_drafts']} rounds skipped a propose ({ov['propose_round_trip_ms']:.2f} ms "
            f"round trip), {ov['ahead_wait_ms_per_round']:.2f} ms/round waited on aheads; "
            f"saved {ov['saved_ms_per_round']:.2f} ms/round of {lat['round_ms']:.2f}"
        )
    lines.append(
        f"TTFT p50 {1e3 * lat['ttft_s']['p50']:.1f} ms, ITL p50 {1e3 * lat['itl_s']['p50']:.2f} ms, "
        f"e2e p50 {lat['e2e_s']['p50']:.3f} s; features: {report['transport']['feature_row_bytes']} B per position "
        f"({report['transport']['target_dtype']}, 3 x {report['transport']['target_hidden_size']})"
    )
    return "\n".join(lines)
