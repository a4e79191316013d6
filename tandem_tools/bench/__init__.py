"""`tandem bench`: tokens/s of target-only decoding, EAGLE-3 at each K, and the peer a user has today
(transformers' assisted generation with a small draft LM), measured side by side in one run on held-out
prompts.

    tandem bench --demo                                   the demo pair (`tandem demo build`)
    tandem bench --target T --draft D [--assistant A]     any pair; --assistant adds the peer

Stacks: `services` starts the three processes (`tandem serve`; with `--overlap on,off` one stack per
setting, the coordinator's --overlap) and calls the coordinator with coordinator.client; `in-process`
runs both engines in this process (tandem_tools.inprocess). The peer (mode `assisted-peer`) is
`target.generate(..., assistant_model=assistant)` with num_assistant_tokens=K (constant schedule,
transformers' default confidence threshold), in this process. With `--peer vllm`, vLLM's CPU backend (its
own venv; tandem_tools/bench/vllm_peer.py) adds stack `vllm`: target-only and EAGLE-3 at each K on the same
target, head, prompts and concurrency, its blocks taking turns with Tandem's; skipped with one line where
vLLM is not installed. `--peer vllm-server` adds stack `vllm-server`: vLLM's OpenAI server (`vllm serve`),
driven by the bench's clients with streamed completions as Tandem's services are over gRPC.

Every case decodes every prompt to exactly --max-new-tokens tokens (EOS does not stop it), after one
short warm-up generation, and at each concurrency after one untimed block of c requests (a compiled
target meets the token buckets of that concurrency there, as vLLM's engine does in its warm-up). At concurrency c, c clients keep c requests in flight (a client starts its next
request as soon as one ends, vLLM's benchmark_serving --max-concurrency); the prompts repeat until
there are 8 requests per client. The cases take turns block by block (4c requests at a time), each
block in a rotated order, so that a change in the machine's load touches all of them alike.

Output: a markdown table on stdout; with --json PATH, {"runs": [...]} (one entry per case, the fields of
Case.result) and a PNG next to it; without, the PNG goes under --out. `accepted_per_position[k]` is the
fraction of verify rounds in which draft k+1 was accepted; `mean_acceptance_length` is tokens committed per
verify round (1 for target-only); latencies are percentiles of tandem.stats.percentile.

    runners.py    one generation on one stack (services, in-process, the assisted peer) -> Outcome
    schedule.py   the cases, their blocks and turns, and the run that times them
    table.py      the markdown table and the speedups over target-only
    plot.py       the PNG
    vllm_peer.py  --peer vllm: vLLM engines in subprocesses of vLLM's venv (vllm_worker.py), one per mode and K
    vllm_server.py --peer vllm-server: vLLM's OpenAI servers from that venv, one per mode and K
    command.py    the `tandem bench` flags and command
"""

from tandem_tools.bench.command import add_bench_parser, cmd_bench
from tandem_tools.bench.plot import plot_runs
from tandem_tools.bench.runners import EAGLE3, PEER, STACKS, TARGET_ONLY, Outcome
from tandem_tools.bench.schedule import BenchConfig, Case, make_cases, run_bench
from tandem_tools.bench.table import markdown_table, speedups

__all__ = [
    "EAGLE3", "PEER", "STACKS", "TARGET_ONLY", "BenchConfig", "Case", "Outcome", "add_bench_parser", "cmd_bench",
    "make_cases", "markdown_table", "plot_runs", "run_bench", "speedups",
]
