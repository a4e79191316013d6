"""The draft's compiled calls (TANDEM_COMPILE): a lone session's rollout step, greedy and sampled proposes and
the greedy ahead of a one-layer chain head, or a P-EAGLE head's greedy propose (of any layers), over one
unpacked copy of the head (inductor cannot lower PackedLinear). The engine runs its eager paths wherever a
call is not there (yet).

TANDEM_COMPILE=background compiles them on a thread of their own while the draft answers eagerly, as the
target compiles its buckets: a real head's ~50 graphs take minutes on a CPU, past the services' 600 s start-up
timeout together with the target's. Any other non-zero value compiles them before the service answers."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from draft_server.ahead import GreedyAhead
from draft_server.model import Eagle3Draft
from draft_server.rollout import GreedyPropose, GreedyStep, ParallelPropose, SampledPropose

log = logging.getLogger("tandem.draft")


def compile_mode() -> bool | str:
    """"background", True (compile before answering) or False (eager: TANDEM_COMPILE unset or 0)."""
    value = os.environ.get("TANDEM_COMPILE", "0")
    return "background" if value == "background" else value != "0"


@dataclass(frozen=True)
class CompiledCalls:
    step: GreedyStep | None = None  # a one-layer chain head's
    propose: GreedyPropose | None = None
    ahead: GreedyAhead | None = None
    sampled: SampledPropose | None = None
    parallel: ParallelPropose | None = None  # a P-EAGLE head's

    @classmethod
    def build(cls, unpacked: Eagle3Draft, draft_id: torch.Tensor, q_top_n: int) -> CompiledCalls:
        if unpacked.config.parallel_drafting:
            return cls(parallel=ParallelPropose(unpacked))
        step = GreedyStep(unpacked)
        return cls(step, GreedyPropose(step.model), GreedyAhead(step.model, draft_id),
                   SampledPropose(step.model, q_top_n))


def compile_calls(unpacked: Eagle3Draft, draft_id: torch.Tensor, q_top_n: int,
                  install: Callable[[CompiledCalls], None], background: bool) -> threading.Event:
    """Build the calls and hand them to `install`, here or (`background`) on a thread of its own -> an event
    set once that is over. In the background a failure is logged and the engine stays eager."""
    done = threading.Event()

    def run() -> None:
        started = time.monotonic()
        try:
            install(CompiledCalls.build(unpacked, draft_id, q_top_n))
            log.info("compiled the draft's calls in %.0f s%s", time.monotonic() - started,
                     " (eager until now)" if background else "")
        except Exception:
            if not background:
                raise
            log.exception("compiling the draft's calls failed; it stays eager")
        finally:
            done.set()

    if background:
        threading.Thread(target=run, name="draft-compile", daemon=True).start()
    else:
        run()
    return done
