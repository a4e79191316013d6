"""The settings' defaults that were measured, and the help texts the CLI and the settings share; each
constant says why it is what it is. No torch, no pydantic: the coordinator and the tools read these too.
"""

# The CPUs and threads of the services on a CPU host are `tandem serve`'s to hand out (tandem_tools/serve.py:
# the target on half the CPUs, the draft and the coordinator on the rest, a torch thread per CPU, the target's
# forwards borrowing all of them where that measures faster), not product settings: these fields have no
# flag, and serve sets their variables for its children only. Two model processes on one CPU must not both
# spin a thread per core: oversubscribed, their spinning threads slow a round many times over.
THREADS_HELP = "internal to `tandem serve`, which sets it: torch CPU threads (default: torch's choice, one per core)"
CPUS_HELP = ("internal to `tandem serve`, which sets it: run on these CPUs only, every thread (Linux), e.g. 0 or "
             "2-3,6 (default: all)")
BURST_CPUS_HELP = ("internal to `tandem serve`, which sets it: a CPU target also uses these CPUs (a list as CPUS) "
                   "for the forwards that measure faster on them, a thread each (target_server/threads.py; "
                   "default: none)")
SHARED_GPU_HELP = ("the target and the draft run on one GPU (`tandem serve` sets it for both when their devices are "
                   "one; a deployment that puts both on one GPU sets it for both): the draft sizes its KV within "
                   "DRAFT_GPU_SHARE of the GPU's memory (tandem/memory.py), the target within the rest (default off)")

# How long `tandem serve` waits for its services, and a coordinator for the target and the draft, to report
# SERVING: a large checkpoint from a network volume loads for minutes.
STARTUP_TIMEOUT = 600.0
CONNECT_TIMEOUT_HELP = ("seconds the coordinator waits at start-up for the target and the draft to report SERVING "
                        f"(default {STARTUP_TIMEOUT:.0f}, as long as `tandem serve` waits for its services)")
# The coordinator checks the health of the target and the draft this often while they are up (while one is
# down it is retried with backoff, from 0.1 s up to this): a lost service is seen within a second.
HEALTH_INTERVAL = 1.0
# gRPC's 4 MiB default is raised deliberately, not removed: feature chunks are 2 MiB, and a big tokenizer
# travels in chunks too, so 16 MiB leaves room without inviting unbounded messages. The coordinator's
# clients; the target and the draft take BATCH_MESSAGE_MIB.
MESSAGE_MIB = 16

METRICS_PORT_HELP = "serve Prometheus /metrics on this port (default: off; 0 = any free port)"
SERVE_METRICS_PORT_HELP = ("Prometheus /metrics of the coordinator on this port, the target on the next and the "
                           "draft on the one after (default: off; 0 = each a free port)")
HTTP_PORT_HELP = ("serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                  "/metrics) on this port of --host (default: off; 0 = any free port)")
SERVED_MODEL_NAME_HELP = "the model name of the HTTP API (default: the target's directory name)"
CHAT_TEMPLATE_HELP = ("the HTTP API's chat template, a jinja2 file or the template itself (default: the target "
                      "checkpoint's)")


TLS_CERT_HELP = "serve this port over TLS with this certificate (PEM; with --tls-key)"
TLS_KEY_HELP = "the private key of --tls-cert (PEM)"
TLS_CA_HELP = ("target, draft: take only clients holding a certificate of this CA (mutual TLS); coordinator: check "
               "the target's and the draft's certificates against it and present its own")
API_KEY_HELP = "clients must send one of these keys (Bearer / authorization metadata); repeat it or separate by commas"
API_KEY_FILE_HELP = "more API keys, one a line"


# Adaptive K's draft tokens a step across the running requests: K = 24 // n - 1, so K=5 up to 4 running, K=2
# at 8, none from 13 (the gate sheds what does not pay); where drafting stopped paying on the 2-core CPU with
# the demo pair (docs/benchmarks.md, "Tandem beside vLLM"). A GPU's knee is elsewhere: measure it with
# `tandem bench --concurrency ...` and TANDEM_COORDINATOR_SPEC_TOKEN_BUDGET=0, then set the budget.
SPEC_TOKEN_BUDGET = 24
SPEC_TOKEN_BUDGET_HELP = (f"adaptive K: draft tokens per round over all running generations (default "
                          f"{SPEC_TOKEN_BUDGET}; 0 = off: every round drafts the request's K, no acceptance gate)")
# Acceptance gate (tandem.gates.AcceptanceGate): one draft token's cost as a share of a verify
# round, drafting and moving the features included: on the 2-core CPU it prices a K=3 round of the demo
# pair, 1 + 0.3 * 3, at what it cost (docs/benchmarks.md, "The acceptance gate's round costs").
# On GPUs, where a one-layer head is far cheaper than the target, it is smaller: measure it as
# (round time at K / target-only step time - 1) / K with `tandem bench`. Not a setting: the gate measures the
# round times it decides by, and this prior weighs only until it has (tandem/gates.py).
SPEC_DRAFT_COST = 0.3
# Overlap: outcomes of a verify the draft prepares the next round for while it runs. More branches hit more
# verifies; their rollouts are one batch, cheap on a GPU, but on a CPU core the ahead step grows past the
# verify it hides behind with them. Compiled (TANDEM_COMPILE, draft_server/ahead.py), a K=5 ahead of the demo
# head with 16 branches outlasts the verify, with 8 it does not and hits more verifies than 4: 8, the branches
# the draft compiles for.
OVERLAP_BRANCHES = 8
# On by default: a lone greedy generation through the services runs faster with it than without
# (docs/benchmarks.md, "Overlap"). Sampled generations stay off (OVERLAP_SAMPLED_HELP), and above one
# running generation the coordinator overlaps none (tandem/policy.py: OVERLAP_MAX_RUNNING).
OVERLAP_HELP = "on: the draft prepares a lone greedy generation's next round while the target verifies"
# Sampled generations do not overlap in the services: a sampled outcome is harder to guess, and there the
# ahead step costs a round more than its fewer hits save (docs/benchmarks.md, "Overlap"). In-process,
# Speculation(overlap_sampled=True) still runs them.
OVERLAP_SAMPLED = False
# Speculative sampling: a sampled request's drafts are drawn from the draft's q cut to its N likeliest
# tokens (renormalised), and q's support crosses to the target with each draft. On the demo pair
# (bench/q_truncation.py; docs/benchmarks.md, "Sampling") 256 keeps most of the whole q's acceptance, in
# bytes that do not grow with the vocabulary (a whole 32k head's q is 190 KB a draft; a feature row of an
# 8B target in bf16 is 24 KB).
DRAFT_Q_TOP_N = 256


# The scheduler's batches carry their steps' features inline on the grpc transport, one message a step: a
# 4096-token prefill of an 8B target in bf16 is 96 MiB, a batch of them more. The target's and the draft's
# limit, and the coordinator's to them; the coordinator's own clients keep MESSAGE_MIB.
BATCH_MESSAGE_MIB = 1024


TREE_HELP = ("EAGLE-2 draft trees for requests that name none: NODES[,DEPTH[,TOP_K]] (depth and top-k default "
             "to the EAGLE-3 reference's 7 and 10); unset: chains of K")
# Tokens a target-only request decodes in one step of the target while nothing drafts and nobody waits
# (Verify.decode): the round trip to the target is paid once per that many instead of once a token.
DECODE_STEPS = 16
MAX_WAITING_HELP = "requests that may wait for a place beyond max_sessions before RESOURCE_EXHAUSTED (default 1024)"
