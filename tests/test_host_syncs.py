"""Host syncs of every kind, counted on the CPU by what the code asks of the device (tandem_tools/opcount.py):
reads of device data, uploads from pageable memory, data-dependent sizes and waits. A step's host tables go
to the device in one non_blocking copy from pinned memory (tandem/staging.py), so the target's verify and
the draft's rollout each sync the host once: when its result is read."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draft_server.engine import DraftEngine
from draft_server.model import DraftKV
from draft_server.rollout import Draws, read_rollout, rollout
from draft_server.sampling import DraftSampler, QSettings
from tandem.params import SamplingParams
from tandem.protocol import Propose
from tandem.staging import upload
from tandem_tools.opcount import OpCounter
from target_server.engine import TargetEngine

K = 5


def test_the_counter_sees_every_kind_of_host_sync():
    weights = torch.randn(4, 4)  # made before the count: a device tensor, as a model's weights
    with OpCounter() as ops:
        torch.tensor([1, 2, 3]).to("cpu")  # an upload from pageable memory
        torch.tensor([1, 2], device="cpu")  # torch stages the data in pageable memory
        torch.from_numpy(np.zeros(3)).to(torch.device("cpu"))
        torch.zeros(3, device="cpu").copy_(torch.tensor([1.0, 2.0, 3.0]))
        (weights @ weights).sum().item()
        weights.tolist()
        weights.cpu().numpy()  # one read, however it is then viewed
        bool(weights.sum() > 0)
        weights[weights > 0]  # a data-dependent size
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.synchronize()  # counted, then torch says there is no CUDA
    assert ops.uploads == 4 and ops.reads == 6 and ops.syncs == 10, dict(ops.sync_ops)


def test_host_work_and_staged_uploads_are_no_syncs():
    with OpCounter() as ops:
        rows = torch.tensor([3, 1, 2]).long() + 1
        assert rows.tolist() == [4, 2, 3]  # host data read on the host
        torch.tensor([1, 2]).to("cpu", non_blocking=True)  # pinned where CUDA is: see opcount
        torch.arange(4, device="cpu") * 2  # made on the device: no copy
        tokens, table, uniforms = upload([([7, 8, 9], torch.long), ([[1, 2], [3, 4]], torch.int32),
                                          ([[0.25, 0.5]], torch.float64)], torch.device("cpu"))
    assert ops.syncs == 0, dict(ops.sync_ops)
    assert tokens.tolist() == [7, 8, 9] and tokens.dtype == torch.long
    assert table.tolist() == [[1, 2], [3, 4]] and table.dtype == torch.int32
    assert uniforms.tolist() == [[0.25, 0.5]] and uniforms.dtype == torch.float64


@pytest.fixture(scope="module")
def target(tiny_dir) -> TargetEngine:
    return TargetEngine(tiny_dir / "target", engine="native")


@pytest.mark.parametrize("drafts", [[1, 2, 3, 4, 5], [], [9]])
def test_a_target_verify_syncs_the_host_once_counting_every_kind(target, drafts):
    token = target.prefill("v", [5, 6, 7, 8], SamplingParams()).token
    with OpCounter() as ops:
        target.verify("v", token, drafts)
    target.release("v")
    assert ops.syncs <= 1, dict(ops.sync_ops)


@pytest.fixture(scope="module")
def draft(tiny_dir) -> DraftEngine:
    return DraftEngine(tiny_dir / "draft", tiny_dir / "target")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_batched_rollout_syncs_the_host_once_counting_every_kind(draft, sampled):
    """16 rows over a padded KV, K=5, read back in one copy; a sampled batch's draws uploaded with it."""
    model, b, past = draft.model, 16, 8
    attention = model.midlayer.self_attn
    g = torch.Generator().manual_seed(0)
    kv = DraftKV()
    kv.k, kv.v = (torch.randn(b, attention.num_kv_heads, past, attention.head_dim, generator=g) for _ in range(2))
    a = torch.randn(b, 1, model.config.hidden_size, generator=g)
    position = torch.full((b, 1), past)
    valid = torch.ones(b, past + K - 1, dtype=torch.bool)  # the past, then the rollout's own columns
    settings = QSettings.of([DraftSampler.for_request(SamplingParams(temperature=0.8, seed=i)) for i in range(b)],
                            model.config.draft_vocab_size, torch.device("cpu")) if sampled else None
    with torch.inference_mode(), OpCounter() as ops:
        draws = None
        if sampled:
            (uniforms,) = upload([(np.full((b, K), 0.5), torch.float64)], torch.device("cpu"))
            draws = Draws(None, settings, uniforms)
        drafts, q, _ = rollout(model, 8, a, kv, position, K, draws, valid)
        drafts, q, _ = read_rollout(drafts, q)
    assert ops.syncs <= 1, dict(ops.sync_ops)
    assert len(drafts) == b * K and (q is not None) == sampled


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_draft_propose_syncs_the_host_once_counting_every_kind(draft, sampled):
    """A lone propose and a batch of two, their features inline (host tensors, as the wire gives them):
    the host tables go up in one upload that leaves the host free, the drafts come back in one read."""
    g = torch.Generator().manual_seed(1)
    sampling = SamplingParams(temperature=0.8, seed=3) if sampled else None
    for name in ("p", "q"):
        draft.propose(name, torch.randn(6, draft.feature_size, generator=g), list(range(6)), K, create=True,
                      sampling=sampling)
    with OpCounter() as ops:
        draft.propose("p", torch.randn(2, draft.feature_size, generator=g), [3, 4], K)
    assert ops.syncs <= 1, dict(ops.sync_ops)
    with OpCounter() as ops:
        draft.run([Propose("p", torch.randn(2, draft.feature_size, generator=g), [3, 4], K),
                   Propose("q", torch.randn(3, draft.feature_size, generator=g), [3, 4, 5], K)])
    assert ops.syncs <= 1, dict(ops.sync_ops)
    draft.release("p")
    draft.release("q")


def _cuda_syncs(call) -> int:
    """The host syncs torch itself reports in `call` (its sync debug mode warns at each one)."""
    import warnings

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_target_verify_and_a_batched_rollout_each_sync_the_host_once(tiny_dir):
    target = TargetEngine(tiny_dir / "target", device="cuda", engine="native")
    token = target.prefill("c", [5, 6, 7, 8], SamplingParams()).token
    target.verify("c", token, [1, 2])  # warm: the first forward's allocations
    token = target.prefill("d", [5, 6, 7, 8], SamplingParams()).token
    assert _cuda_syncs(lambda: target.verify("d", token, [1, 2, 3, 4, 5])) <= 1
    engine = DraftEngine(tiny_dir / "draft", tiny_dir / "target", device="cuda")
    model, b, past = engine.model, 16, 8
    attention = model.midlayer.self_attn
    kv = DraftKV()

    def step() -> None:
        kv.k, kv.v = (torch.randn(b, attention.num_kv_heads, past, attention.head_dim, device="cuda") for _ in range(2))
        a = torch.randn(b, 1, model.config.hidden_size, device="cuda")
        drafts, q, _ = rollout(model, 8, a, kv, torch.full((b, 1), past, device="cuda"), K, None,
                               torch.ones(b, past + K - 1, dtype=torch.bool, device="cuda"))
        read_rollout(drafts, q)

    with torch.inference_mode():
        step()
        assert _cuda_syncs(step) <= 1
