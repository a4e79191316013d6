"""Tiny models the project builds itself, saved in the real formats (no model hub here).

`make_tiny(dir)` writes:
  dir/target                HF Llama checkpoint: config.json, model.safetensors, tokenizer (byte-level BPE)
  dir/draft                 EAGLE-3 head, reference layout (`midlayer.*`), no embed_tokens
  dir/draft-speculators     the same weights in the speculators layout (`layers.0.*`), embed_tokens included
The draft has a reduced vocabulary (d2t offsets), as published heads do. The tests, `tandem serve`
without a checkpoint, and the demo build on these.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draft_server.checkpoint import REFERENCE, SPECULATORS, save_draft
from draft_server.model import Eagle3Config, Eagle3Draft
from draft_server.train_data import draft_vocab_from_counts, stdlib_text

BOS, EOS = "<s>", "</s>"
# A chat template in the usual shape (Zephyr's): roles as markers, each turn closed by EOS, the BOS
# token first; it refuses roles it does not know, as real templates do with raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, got ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LOGIT_SCALE = 4.0


def build_tokenizer(vocab_size: int, text: str) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE)


def tiny_target_config(vocab_size: int, **overrides) -> LlamaConfig:
    defaults = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 8,  # capture ids (2, 4, 5): three distinct layers
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "initializer_range": 0.15,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    defaults.update(overrides)
    return LlamaConfig(**defaults)


def tiny_draft_config(target: LlamaConfig, draft_vocab_size: int) -> Eagle3Config:
    layer = LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        max_position_embeddings=target.max_position_embeddings,
        rms_norm_eps=target.rms_norm_eps,
        rope_theta=10000.0,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
    )
    return Eagle3Config(layer=layer, target_hidden_size=target.hidden_size, draft_vocab_size=draft_vocab_size)


def make_tiny(out_dir: str | Path, seed: int = 0, vocab_size: int = 512, draft_vocab_size: int = 384) -> Path:
    out = Path(out_dir)
    torch.manual_seed(seed)
    text = stdlib_text()
    tokenizer = build_tokenizer(vocab_size, text)
    config = tiny_target_config(len(tokenizer))
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        # Peaked next-token distributions, like a trained model's: sampling tests then have their mass
        # on few tokens, and greedy decoding has no near-ties between the top two logits.
        target.lm_head.weight.mul_(LOGIT_SCALE)
    target_dir = out / "target"
    target.save_pretrained(target_dir, safe_serialization=True)
    tokenizer.save_pretrained(target_dir)

    draft = Eagle3Draft(tiny_draft_config(config, draft_vocab_size))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        counts = torch.bincount(torch.tensor(tokenizer(text[:100_000])["input_ids"]), minlength=config.vocab_size)
        counts[config.eos_token_id] = counts.max() + 1  # the draft can always propose EOS
        d2t, t2d = draft_vocab_from_counts(counts, draft_vocab_size)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
    save_draft(draft, out / "draft", layout=REFERENCE)
    save_draft(draft, out / "draft-speculators", layout=SPECULATORS, include_embeddings=True)
    return out


def default_tiny_dir() -> Path:
    """Where `tandem serve` and friends keep the built-in tiny pair (built on first use)."""
    cache = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
    return cache / "tiny"


def ensure_tiny() -> Path:
    directory = default_tiny_dir()
    if not (directory / "draft-speculators" / "config.json").is_file():
        tmp = directory.with_name(f"tiny.tmp{os.getpid()}")
        make_tiny(tmp)
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(directory)
        except OSError:  # built concurrently by another process: keep theirs
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    add_chat_template(directory / "target")
    return directory


def add_chat_template(target: Path) -> None:
    """A tiny pair built before it had a chat template gets it (tokenization does not change)."""
    import json

    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if config.get("chat_template") or (target / "chat_template.jinja").is_file():
        return
    config["chat_template"] = CHAT_TEMPLATE
    tmp = config_path.with_name(f".{config_path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    tmp.replace(config_path)


def cmd_make_tiny(args) -> int:
    """`tandem make-tiny DIR`."""
    out = make_tiny(args.dir, seed=args.seed)
    print(f"wrote {out}/target, {out}/draft (reference layout), {out}/draft-speculators")
    return 0
