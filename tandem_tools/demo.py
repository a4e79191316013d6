"""The demo pair, built from local data only: a small Llama-family target trained on this machine's own
Python standard library, its EAGLE-3 head (draft_server.train), and a small plain Llama LM, the draft a user
of transformers' assisted generation would reach for today.

    tandem demo build [--out DIR]      ->  DIR (default $TANDEM_CACHE/demo, else ~/.cache/tandem/demo)
      target/         LlamaForCausalLM + its byte-level BPE tokenizer (tandem_tools.tiny.build_tokenizer)
      draft/          the EAGLE-3 head, reference layout (no embed_tokens: read from target/)
      draft-peagle/   a P-EAGLE head (all K drafts in one forward), same data and steps as draft/
                      (`tandem demo build --peagle-only` adds it to a pair built before it existed)
      assistant/      a 2-layer Llama LM, same tokenizer and data (`generate(..., assistant_model=...)`)
      prompts.jsonl   held-out prompts: cut from standard-library files no model saw in training
      build.json      the spec, seconds per stage, final losses

The standard library is split by file: every `heldout_every`-th file (sorted by name) is held out. Code is
repetitive, so a small model learns its patterns in minutes on a 2-core CPU and its greedy continuations
are predictable; the target is sized so that one of its forwards costs several draft steps on a CPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem_tools.lm_training import pick_threads, train_lm

# no torch at import: `tandem` registers this module's subcommand, and the coordinator has no torch
DEMO_FILES = ("target/config.json", "draft/config.json", "assistant/config.json", "prompts.jsonl")


@dataclass
class DemoSpec:
    """Defaults: minutes on a 2-core CPU. Tests shrink everything."""

    # data: the standard library's top-level modules; every heldout_every-th one is held out
    train_bytes: int = 3_000_000  # training text (the tokenizer is trained on it too): ~900k tokens
    heldout_every: int = 10
    vocab_size: int = 2048
    # 192 wide, 8 deep: on a CPU a forward of 1 token costs several draft steps and one of K+1 = 6 tokens
    # little more than one of 1 (at 256 the verify costs more: it eats the speed-up); it also trains faster
    hidden_size: int = 192
    num_layers: int = 8  # EAGLE-3 captures the inputs of layers (2, 4, 5); 6 layers would give (2, 3, 3)
    intermediate_size: int = 512
    num_heads: int = 3
    num_kv_heads: int = 1
    target_steps: int = 500  # ~1M tokens: the loss is still falling, but a build stays within minutes
    target_batch: int = 16
    target_lr: float = 3e-3
    seq_len: int = 128
    # the assistant of the assisted-generation peer: a plain small Llama LM on the same text
    assistant_hidden_size: int = 128
    assistant_layers: int = 2
    assistant_steps: int = 300
    assistant_lr: float = 3e-3
    # the EAGLE-3 head: trained on the target's own continuations of prompts cut from the training text
    # 1800 steps on 3072 sequences: K=5 rounds accept clearly more tokens than after 600 on 1536 (the accuracy
    # still rises slowly at 1800)
    head_steps: int = 1800
    head_sequences: int = 3072
    head_seq_len: int = 96
    head_batch: int = 16
    head_ttt_steps: int = 4
    head_lr: float = 1e-2
    draft_vocab_size: int = 1024
    # the P-EAGLE head (draft-peagle/): the same data, steps and width as the EAGLE-3 head, one layer as it has
    # (two layers would double a training step), and depths for K up to 5
    peagle_layers: int = 1
    peagle_depths: int = 5
    # held-out prompts for bench
    num_prompts: int = 32
    prompt_tokens: int = 48
    seed: int = 0
    threads: int | None = None  # torch threads while training (None: pick_threads())


def default_demo_dir() -> Path:
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    return cache / "demo"


def is_built(directory: str | Path) -> bool:
    return all((Path(directory) / name).is_file() for name in DEMO_FILES)


# -- data ----------------------------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules in a fixed order (the files draft_server.train_data.stdlib_text reads)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def split_files(files: list[Path], heldout_every: int) -> tuple[list[Path], list[Path]]:
    """-> (training files, held-out files): every `heldout_every`-th file, from the middle of each group."""
    heldout = [f for i, f in enumerate(files) if i % heldout_every == heldout_every // 2]
    train = [f for i, f in enumerate(files) if i % heldout_every != heldout_every // 2]
    return train, heldout


def read_texts(files: list[Path], max_bytes: int) -> list[str]:
    texts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text[: max_bytes - size])
        size += len(texts[-1])
        if size >= max_bytes:
            break
    return texts


def token_stream(tokenizer, texts: list[str], eos_id: int):
    """All texts as one stream of ids, EOS between files -> [N]."""
    import torch

    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def heldout_prompts(tokenizer, files: list[Path], count: int, length: int, seed: int) -> list[dict]:
    """`count` prompts of `length` tokens, each starting at the beginning of a random line of a held-out file."""
    rng = random.Random(seed)
    pool = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="ignore").splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.strip() and not line.startswith((" ", "\t", "#"))]
        pool.extend((path, lines, i) for i in starts)
    rng.shuffle(pool)
    prompts = []
    for path, lines, start in pool:
        ids = tokenizer("".join(lines[start : start + 40]))["input_ids"]
        if len(ids) < length + 16:  # a prompt with text after it
            continue
        ids = ids[:length]
        prompts.append({"file": path.name, "prompt": tokenizer.decode(ids), "prompt_ids": ids})
        if len(prompts) == count:
            break
    if len(prompts) < count:
        raise ValueError(f"the held-out files gave {len(prompts)} prompts of {length} tokens, not {count}")
    return prompts


def load_prompts(directory: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(directory) / "prompts.jsonl").read_text().splitlines() if line]


# -- the build -----------------------------------------------------------------------------------------------


def build_demo(out_dir: str | Path | None = None, spec: DemoSpec | None = None, progress: bool = True) -> Path:
    """Build the demo pair into `out_dir` (default: default_demo_dir()); returns that path. The files appear
    at once when everything is done (built in a sibling directory, then renamed)."""
    # Waiting torch workers sleep instead of spinning: on a 2-core machine that something else also uses,
    # spinning made 2 threads slower than 1. Read when torch loads, so only a first import sees it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from draft_server.train import train_draft
    from tandem_tools.tiny import build_tokenizer, tiny_target_config

    spec = spec or DemoSpec()
    out = Path(out_dir) if out_dir is not None else default_demo_dir()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads or pick_threads())
    torch.manual_seed(spec.seed)
    started = time.monotonic()
    seconds: dict[str, float] = {}

    def stage(name: str, t0: float) -> None:
        seconds[name] = round(time.monotonic() - t0, 1)
        _say(progress, f"demo: {name} done in {seconds[name]:.0f}s")

    try:
        t0 = time.monotonic()
        train_files, heldout_files = split_files(stdlib_files(), spec.heldout_every)
        texts = read_texts(train_files, spec.train_bytes)
        tokenizer = build_tokenizer(spec.vocab_size, "\n".join(texts))
        eos = tokenizer.eos_token_id
        stream = token_stream(tokenizer, texts, eos)
        _say(progress, f"demo: {len(texts)} training files, {stream.numel()} tokens; "
                       f"{len(heldout_files)} held-out files")
        stage("tokenizer", t0)

        t0 = time.monotonic()
        config = tiny_target_config(
            len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads, initializer_range=0.02, max_position_embeddings=4096,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        )
        target = LlamaForCausalLM(config)
        target_losses = train_lm(target, stream, steps=spec.target_steps, batch_size=spec.target_batch,
                                 seq_len=spec.seq_len, lr=spec.target_lr, seed=spec.seed, desc="demo target",
                                 progress=progress, threads=spec.threads)
        target.save_pretrained(tmp / "target", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "target")
        stage("target", t0)

        t0 = time.monotonic()
        assistant_config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=spec.assistant_hidden_size,
            intermediate_size=int(spec.assistant_hidden_size * 8 / 3 + 7) // 8 * 8,
            num_hidden_layers=spec.assistant_layers, num_attention_heads=max(1, spec.assistant_hidden_size // 64),
            max_position_embeddings=4096, initializer_range=0.02, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
        )
        assistant = LlamaForCausalLM(assistant_config)
        assistant_losses = train_lm(assistant, stream, steps=spec.assistant_steps, batch_size=spec.target_batch,
                                    seq_len=spec.seq_len, lr=spec.assistant_lr, seed=spec.seed + 1,
                                    desc="demo assistant", progress=progress, threads=spec.threads)
        assistant.save_pretrained(tmp / "assistant", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "assistant")
        stage("assistant", t0)

        t0 = time.monotonic()
        _say(progress, "demo: EAGLE-3 head: the target writes its training data, then training-time test")
        torch.set_num_threads(spec.threads or pick_threads())
        history: list = []
        train_draft(
            tmp / "target", ["\n".join(texts)[: spec.train_bytes // 2]], tmp / "draft", self_distill=True,
            steps=spec.head_steps, num_sequences=spec.head_sequences, seq_len=spec.head_seq_len,
            batch_size=spec.head_batch, ttt_steps=spec.head_ttt_steps, lr=spec.head_lr,
            draft_vocab_size=min(spec.draft_vocab_size, len(tokenizer)), seed=spec.seed, progress=progress,
            history=history,
        )
        stage("draft", t0)

        t0 = time.monotonic()
        peagle_history = train_peagle_head(tmp, spec, texts, progress)
        stage("draft-peagle", t0)

        prompts = heldout_prompts(tokenizer, heldout_files, spec.num_prompts, spec.prompt_tokens, spec.seed)
        (tmp / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
        seconds["total"] = round(time.monotonic() - started, 1)
        info = {
            "spec": asdict(spec),
            "seconds": seconds,
            "threads": torch.get_num_threads(),
            "training_tokens": stream.numel(),
            "target_loss": _tail_mean(target_losses),
            "assistant_loss": _tail_mean(assistant_losses),
            "draft_loss": _tail_mean([h.loss for h in history]),
            "draft_accuracy": [round(a, 3) for a in history[-1].accuracy] if history else [],
            "peagle_loss": _tail_mean([h.loss for h in peagle_history]),
            "peagle_accuracy": [round(a, 3) for a in peagle_history[-1].accuracy] if peagle_history else [],
            "heldout_files": [f.name for f in heldout_files],
        }
        (tmp / "build.json").write_text(json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"demo: built {out} in {seconds['total']:.0f}s (target loss {info['target_loss']:.2f}, "
                   f"assistant loss {info['assistant_loss']:.2f}, head accuracy per step {info['draft_accuracy']})")
    return out


def demo_training_texts(spec: DemoSpec) -> list[str]:
    """The training text of a build of `spec` (the tokenizer's, the target's and the heads')."""
    train_files, _ = split_files(stdlib_files(), spec.heldout_every)
    return read_texts(train_files, spec.train_bytes)


def train_peagle_head(directory: str | Path, spec: DemoSpec | None = None, texts: list[str] | None = None,
                      progress: bool = True) -> list:
    """Train the P-EAGLE head of the pair in `directory` (its target/) into directory/draft-peagle, on the
    data and for the steps of the EAGLE-3 head (build_demo's), and return its per-step stats. Run alone, it
    adds the head to a pair built before this step existed (the target is read, never changed)."""
    import torch

    from draft_server.train import train_draft
    from draft_server.train_parallel import ParallelDrafting

    spec = spec or DemoSpec()
    directory = Path(directory)
    texts = texts if texts is not None else demo_training_texts(spec)
    out = directory / "draft-peagle"
    staging = directory / f"draft-peagle.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    _say(progress, "demo: P-EAGLE head: the target writes its training data, then COD-sampled parallel drafting")
    torch.set_num_threads(spec.threads or pick_threads())
    vocab = json.loads((directory / "target" / "config.json").read_text())["vocab_size"]
    history: list = []
    try:
        train_draft(
            directory / "target", ["\n".join(texts)[: spec.train_bytes // 2]], staging, self_distill=True,
            steps=spec.head_steps, num_sequences=spec.head_sequences, seq_len=spec.head_seq_len,
            batch_size=spec.head_batch, lr=spec.head_lr, draft_vocab_size=min(spec.draft_vocab_size, vocab),
            seed=spec.seed, progress=progress, history=history,
            parallel=ParallelDrafting(num_depths=spec.peagle_depths, num_layers=spec.peagle_layers, seed=spec.seed),
        )
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return history


def ensure_demo(directory: str | Path | None = None, progress: bool = True) -> Path:
    """The demo pair, built on first use."""
    out = Path(directory) if directory is not None else default_demo_dir()
    if not is_built(out):
        _say(progress, f"demo: {out} is not built yet; building it (a few minutes on a 2-core CPU)")
        build_demo(out, progress=progress)
    return out


def _tail_mean(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 4) if tail else float("nan")


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)
