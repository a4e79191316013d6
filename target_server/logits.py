"""Per-request logits processing on the target, at every position a batch scores: the penalties, then a
constrained generation's masks (tandem/constraint.py), before anything is accepted or sampled.

Both depend on the tokens before the position, a verify's drafts included: the row of d_j is penalised
for t, d_1..d_j (a tree node's for its path) as well as for what the session committed, and masked by the
row the round loop computed for that prefix. So p_j is, at every position, the distribution the target alone
would sample from there, and acceptance stays lossless (target_server/acceptance.py works on it unchanged).

The penalties are vLLM's (vllm/model_executor/layers/utils.py apply_penalties): repetition over the prompt's
and the generated tokens (a positive logit divided by it, a negative one multiplied), then frequency
(minus the count) and presence (minus 1 where the count is positive) over the generated tokens. A session
that asks for them keeps its generated tokens' counts [V] and the prompt's tokens [V] on its device.
The masks of a whole batch are unpacked on its device and applied in one masked_fill.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.constraint import words
from tandem.sessions import InvalidRequest
from target_server.steps import Session, Step


def open_session(session: Session, prompt_ids: list[int], output_start: int | None, vocab_size: int,
                 device: torch.device) -> None:
    """A prefill's session: the counts its penalties need (nothing for a session without penalties).
    prompt_ids[output_start:] are the generation's own tokens (a preempted one's, recomputed): they count
    as generated, as they did before it was preempted."""
    if not session.params.penalised:
        return
    start = len(prompt_ids) if output_start is None else output_start
    prompt = torch.tensor(prompt_ids[:start], dtype=torch.long, device=device)
    produced = torch.tensor(prompt_ids[start:], dtype=torch.long, device=device)
    session.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    session.counts.index_add_(0, produced, torch.ones(len(produced), device=device))
    seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    seen[prompt] = True
    session.prompt_seen = seen


def checked(step: Step, vocab_size: int) -> Step:
    """The step, or InvalidRequest if its masks are not one row of ceil(V / 32) words per scored position."""
    if step.allowed is None:
        return step
    rows = 1 if step.kind == "prefill" else len(step.ids)
    width = 4 * words(vocab_size)
    if len(step.allowed) != rows * width:
        raise InvalidRequest(f"the masks have {len(step.allowed)} bytes; {rows} rows of {width} bytes were expected")
    return step


def process(steps: list[Step], logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits [N, V] of the batch (each step's `rows` in order) -> the logits the target accepts and
    samples from: `logits` itself where no step asks for anything, else a processed copy (the raw ones
    stay for logprobs, which are of the raw distribution)."""
    wanted = [s.session.params.penalised or s.allowed is not None for s in steps]
    if not any(wanted):
        return logits
    out = logits.float().clone()
    start = 0
    masked_rows, masks = [], []
    for step, n in zip(steps, rows, strict=True):
        if step.session.params.penalised:
            _penalise(out[start : start + n], step)
        if step.allowed is not None:
            masked_rows.append(torch.arange(start, start + n))
            masks.append(np.frombuffer(step.allowed, dtype=np.uint8).reshape(n, -1))
        start += n
    if masks:
        vocab = out.shape[-1]
        packed = torch.from_numpy(np.concatenate(masks)).to(out.device, non_blocking=True)  # [M, 4W] uint8
        shifts = torch.arange(8, dtype=torch.uint8, device=out.device)
        bits = ((packed[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [M, V]
        allowed = torch.ones_like(out, dtype=torch.bool)
        allowed[torch.cat(masked_rows).to(out.device)] = bits
        out.masked_fill_(~allowed, float("-inf"))
    return out


def _penalise(logits: torch.Tensor, step: Step) -> None:
    """logits [n, V] of one step, in place. Row i's generated tokens: the session's and the step's tokens
    from t to node i along its path (a prefill's one row: none yet)."""
    session, params = step.session, step.session.params
    counts = session.counts[None].expand(logits.shape[0], -1)  # [n, V]
    if step.kind == "verify":
        ids = torch.tensor(step.ids, dtype=torch.long, device=logits.device)
        onehot = torch.nn.functional.one_hot(ids, logits.shape[-1]).float()  # [n, V]
        counts = counts + _ancestry(step, logits.device) @ onehot
    if params.repetition_penalty != 1.0:
        seen = (counts > 0) | session.prompt_seen[None]
        r = params.repetition_penalty
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits))
    if params.frequency_penalty:
        logits.sub_(params.frequency_penalty * counts)
    if params.presence_penalty:
        logits.sub_(params.presence_penalty * (counts > 0).float())


def _ancestry(step: Step, device: torch.device) -> torch.Tensor:
    """[n, n]: row i has a 1 for node i and each of its ancestors (node 0 is t, the root); a chain's is
    lower triangular."""
    n = len(step.ids)
    if step.parents is None:
        return torch.ones(n, n, device=device).tril()
    anc = torch.zeros(n, n)
    anc[0, 0] = 1
    for i, parent in enumerate(step.parents):
        anc[i + 1] = anc[parent + 1]
        anc[i + 1, i + 1] = 1
    return anc.to(device)


def commit(step: Step, kept: range | list[int]) -> None:
    """The tokens a verify keeps (t and the accepted drafts) join the session's generated counts."""
    session = step.session
    if step.kind != "verify" or not session.params.penalised:
        return
    ids = torch.tensor([step.ids[i] for i in kept], dtype=torch.long, device=session.counts.device)
    session.counts.index_add_(0, ids, torch.ones(len(ids), device=session.counts.device))
