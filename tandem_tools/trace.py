"""trace.json: the profiled requests on one timeline, in the Chrome trace event format (chrome://tracing,
https://ui.perfetto.dev). One pid per process (client, coordinator, target, draft), one thread per
request; each round is a slice in the coordinator with its propose, verify and ahead round trips inside,
and the services' steps (queue, compute, codec) sit under them, joined by flow arrows.

Every process stamps CLOCK_MONOTONIC, which the processes of one host share. For services on other
hosts the offset is chosen from the round trips: a step must start after the coordinator sent it and
end before its answer arrived; of the offsets that satisfy every step, the one closest to 0 is used.
"""

from __future__ import annotations

from tandem_tools.report import RequestRecord

PIDS = {"client": 0, "coordinator": 1, "target": 2, "draft": 3}


def _offset(bounds: list[tuple[int, int]]) -> int:
    """The offset closest to 0 in the intersection of [low, high] intervals (their midpoints' median if empty)."""
    if not bounds:
        return 0
    low = max(b[0] for b in bounds)
    high = min(b[1] for b in bounds)
    if low <= high:
        return min(max(0, low), high)
    mids = sorted((a + b) // 2 for a, b in bounds)
    return mids[len(mids) // 2]


def clock_offsets(records: list[RequestRecord]) -> dict[str, int]:
    """ns to add to each process's timestamps to put them on the coordinator's clock."""
    bounds: dict[str, list[tuple[int, int]]] = {"client": [], "target": [], "draft": []}
    for rec in records:
        p = rec.profile
        if p is None:
            continue
        if rec.delta_ns:
            # the client sent before the coordinator started, and got the last answer after it ended
            bounds["client"].append((p.end_ns - rec.delta_ns[-1], p.start_ns - rec.sent_ns))
        for r in p.rounds:
            for who, step, sent, received in (("target", r.target, r.target_sent_ns, r.target_received_ns),
                                              ("draft", r.draft, r.draft_sent_ns, r.draft_received_ns),
                                              ("draft", r.ahead, r.ahead_sent_ns, r.ahead_received_ns)):
                if sent and received and step.received_ns:
                    bounds[who].append((sent - step.received_ns, received - step.sent_ns))
    return {who: _offset(b) for who, b in bounds.items()}


def _slice(name: str, pid: str, tid: int, start_ns: int, end_ns: int, origin: int, cat: str, **args) -> dict:
    event = {"name": name, "cat": cat, "ph": "X", "pid": PIDS[pid], "tid": tid,
             "ts": (start_ns - origin) / 1e3, "dur": max(end_ns - start_ns, 0) / 1e3}
    if args:
        event["args"] = args
    return event


def _flow(flow_id: int, name: str, src: tuple[str, int, int], dst: tuple[str, int, int], origin: int) -> list[dict]:
    (spid, stid, sts), (dpid, dtid, dts) = src, dst
    return [
        {"name": name, "cat": "transport", "ph": "s", "id": flow_id, "pid": PIDS[spid], "tid": stid,
         "ts": (sts - origin) / 1e3},
        {"name": name, "cat": "transport", "ph": "f", "bp": "e", "id": flow_id, "pid": PIDS[dpid], "tid": dtid,
         "ts": (dts - origin) / 1e3},
    ]


def _step(events: list[dict], who: str, name: str, step, offset: int, tid: int, origin: int, args: dict) -> None:
    """A service's step and its parts. The parts are laid out in the order they happen: the target
    waits for the engine, computes, then encodes; the draft decodes as chunks arrive, waits, computes."""
    start, end = step.received_ns + offset, step.sent_ns + offset
    events.append(_slice(name, who, tid, start, end, origin, who, **args))
    parts = [("queue", step.queue_ns), ("compute", step.compute_ns), ("encode features", step.codec_ns)]
    if who == "draft":
        parts = [("decode features", step.codec_ns), ("queue", step.queue_ns), ("compute", step.compute_ns)]
    at = start
    for part, ns in parts:
        if ns:
            events.append(_slice(part, who, tid, at, min(at + ns, end), origin, who))
            at = min(at + ns, end)


def build_trace(records: list[RequestRecord]) -> dict:
    offsets = clock_offsets(records)
    done = [r for r in records if r.profile is not None]
    starts = [r.profile.start_ns for r in done] + [r.sent_ns + offsets["client"] for r in done]
    origin = min(starts) if starts else 0
    events: list[dict] = []
    for name, pid in PIDS.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    flow_id = 0
    for rec in done:
        p = rec.profile
        tid = rec.index + 1
        for pid in PIDS.values():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": f"request {rec.index}"}})
        if rec.delta_ns:
            c = offsets["client"]
            events.append(_slice(f"request {rec.index}", "client", tid, rec.sent_ns + c, rec.delta_ns[-1] + c, origin,
                                 "request", tokens=len(rec.token_ids), finish_reason=rec.finish_reason))
            events.append({"name": "first token", "cat": "request", "ph": "i", "s": "t", "pid": PIDS["client"],
                           "tid": tid, "ts": (rec.delta_ns[0] + c - origin) / 1e3})
        events.append(_slice(f"request {rec.index}", "coordinator", tid, p.start_ns, p.end_ns, origin, "request"))
        for r in p.rounds:
            traffic = {t.link: sum(t.bytes.values()) for t in r.traffic}
            label = "prefill" if r.index == 0 else f"round {r.index}"
            events.append(_slice(label, "coordinator", tid, r.start_ns, r.end_ns, origin, "round", tokens=r.num_tokens,
                                 drafts=r.num_drafts, accepted=r.num_accepted, bytes=traffic))
            step_name = "prefill" if r.index == 0 else "verify"
            for who, step, sent, received, name in (
                ("draft", r.draft, r.draft_sent_ns, r.draft_received_ns, "propose"),
                ("target", r.target, r.target_sent_ns, r.target_received_ns, step_name),
                ("draft", r.ahead, r.ahead_sent_ns, r.ahead_received_ns, "ahead"),
            ):
                if not (sent and received):
                    continue
                out, back = f"coordinator->{who}", f"{who}->coordinator"
                events.append(_slice(name, "coordinator", tid, sent, received, origin, "step",
                                     sent_bytes=traffic.get(out, 0), received_bytes=traffic.get(back, 0)))
                if not step.received_ns:
                    continue
                off = offsets[who]
                _step(events, who, name, step, off, tid, origin,
                      {"received_bytes": traffic.get(out, 0), "sent_bytes": traffic.get(back, 0)})
                flow_id += 1
                events += _flow(flow_id, out, ("coordinator", tid, sent), (who, tid, step.received_ns + off), origin)
                flow_id += 1  # the answer: from just inside the end of the service's step to the coordinator's
                inside = min(1000, (step.sent_ns - step.received_ns) // 2, (received - sent) // 2)
                events += _flow(flow_id, back, (who, tid, step.sent_ns + off - inside),
                                ("coordinator", tid, received - inside), origin)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock_offsets_ns": offsets, "clock": "CLOCK_MONOTONIC, aligned on the coordinator"}}
