"""One vLLM offline engine, driven over stdin/stdout by tandem_tools/bench/vllm_peer.py.

Run by the vLLM venv's python, never imported by Tandem: it needs vllm and the standard library only, so
that Tandem's venv never imports vllm and vLLM's pinned torch/transformers never meet ours.

    python vllm_worker.py --target DIR [--head DIR -k K] --dtype float32 --max-model-len N

Protocol, one JSON object a line. The worker prints {"ready": true, ...} once the engine is built (its
compile included), then answers each request line with one reply line:

    {"prompts": [[ids], ...], "concurrency": c, "max_tokens": n, "temperature": t, "seeds": [...]}
    -> {"seconds": s, "outputs": [{"tokens": n, "seconds": latency}, ...],
        "spec": {"drafts": d, "draft_tokens": dt, "accepted": a, "per_position": [K]}}

`concurrency` clients keep that many requests in flight, as `tandem bench` does: the engine starts the
next prompt as soon as one finishes (a closed loop over LLMEngine.add_request/step, no server in
between). "spec" holds the engine's speculative-decoding counters over this request line (deltas of
vllm:spec_decode_*; zeros without a head): drafts are verify rounds that carried drafts, accepted the
drafts the target kept. With "return_tokens": true each output carries its "token_ids" too (the tests
compare them with Tandem's). {"quit": true} or end of input stops the worker. An error is answered with
{"error": "..."} and the worker goes on.

vLLM's own logs go to stderr: stdout is the protocol's alone (fd 1 is pointed at stderr at start, so
that nothing written by vLLM's C++ or its logger lands in the protocol).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# this file sits beside tandem_tools/bench/openai.py: without this, `import openai` inside vllm finds that
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--head", help="an EAGLE-3 head directory: speculative_config method eagle3")
    p.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--eager", action="store_true", help="enforce_eager: no compile (quick start, slower)")
    args = p.parse_args()

    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    started = time.perf_counter()
    from vllm import LLM, SamplingParams, __version__

    kwargs = {}
    if args.head:
        kwargs["speculative_config"] = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.k}
    # prefix caching off: the bench repeats its prompts, and Tandem prefills each request afresh
    llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enable_prefix_caching=False,
              enforce_eager=args.eager, disable_log_stats=False, seed=0, **kwargs)
    engine = llm.llm_engine
    protocol.write(json.dumps({"ready": True, "vllm": __version__, "startup_s": round(time.perf_counter() - started, 1),
                               "ld_preload": os.environ.get("LD_PRELOAD", "")}) + "\n")

    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("quit"):
                break
            reply = run_closed_loop(engine, llm, SamplingParams, request)
        except Exception as e:  # noqa: BLE001 - reported to the bench, which decides
            reply = {"error": f"{type(e).__name__}: {e}"}
        protocol.write(json.dumps(reply) + "\n")
    return 0


def run_closed_loop(engine, llm, sampling_params, request: dict) -> dict:
    """The prompts through the engine with `concurrency` in flight; a finished request's slot is refilled
    at once."""
    prompts, concurrency = request["prompts"], int(request["concurrency"])
    seeds = request.get("seeds") or [0] * len(prompts)
    temperature = float(request.get("temperature", 0.0))

    def params(i: int):
        return sampling_params(max_tokens=int(request["max_tokens"]), ignore_eos=True, temperature=temperature,
                               seed=seeds[i] if temperature > 0 else None, detokenize=False)

    before = spec_counters(llm)
    outputs: list[dict | None] = [None] * len(prompts)
    began: dict[str, tuple[int, float]] = {}
    queued = 0

    def submit() -> None:
        nonlocal queued
        rid = f"r{time.monotonic_ns()}-{queued}"
        began[rid] = (queued, time.perf_counter())
        engine.add_request(rid, {"prompt_token_ids": prompts[queued]}, params(queued))
        queued += 1

    started = time.perf_counter()
    while queued < min(concurrency, len(prompts)):
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            i, t0 = began.pop(out.request_id)
            tokens = list(out.outputs[0].token_ids)
            outputs[i] = {"tokens": len(tokens), "seconds": round(time.perf_counter() - t0, 5)}
            if request.get("return_tokens"):
                outputs[i]["token_ids"] = tokens
            if queued < len(prompts):
                submit()
    seconds = time.perf_counter() - started
    after = spec_counters(llm)
    spec = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    spec["per_position"] = [a - b for a, b in zip(after["per_position"],
                                                    before["per_position"] + [0] * len(after["per_position"]))]
    return {"seconds": round(seconds, 5), "outputs": outputs, "spec": spec}


def spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters, summed over engines (vllm:spec_decode_*)."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    for metric in llm.get_metrics():
        if metric.name in names:
            counters[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(metric.values)
            old = counters["per_position"] + [0] * (len(values) - len(counters["per_position"]))
            counters["per_position"] = [a + int(b) for a, b in zip(old, values)]
    return counters


if __name__ == "__main__":
    sys.exit(main())
