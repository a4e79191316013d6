"""The trainer's frozen target (Teacher), in a module of its own: it is the one place the draft side loads the
target (through target_server/loading.py).

The target is frozen and only read: one forward over a training sequence x_0..x_{T-1} gives the captured
features F_i [3Ht] and the logits L_i, which predict x_{i+1}. It is loaded and hooked as the target engine
loads it (target_server/loading.py): same aux layers, same EOS ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import DynamicCache

from target_server.loading import load_target


class Teacher:
    """The frozen target: features and logits of whole sequences, captured as TargetEngine captures them."""

    def __init__(
        self,
        target_dir: str | Path,
        device: str = "cpu",
        aux_layer_ids: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        self.target_dir = Path(target_dir)
        self.device = torch.device(device)
        loaded = load_target(self.target_dir, self.device, dtype, aux_layer_ids)
        self.model, self.capture, self.eos_token_ids = loaded.model, loaded.capture, loaded.eos_token_ids
        self.config = loaded.config
        self.aux_layer_ids, self.num_layers = loaded.aux_layer_ids, loaded.num_layers
        self.hidden_size, self.vocab_size = loaded.hidden_size, loaded.vocab_size

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, T], right-padded -> features [B, T, 3Ht], logits [B, T, V]."""
        logits = self.model(input_ids=ids.to(self.device), use_cache=False).logits
        return self.capture.take(), logits

    @torch.inference_mode()
    def outputs(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T], right-padded -> features [B, T, 3Ht], the final (normed) hidden state [B, T, Ht] and
        the argmax of the logits [B, T]: logits over any subset of the vocabulary are hidden @ rows.T."""
        hidden = self.model.get_decoder()(input_ids=ids.to(self.device), use_cache=False).last_hidden_state
        best = self.model.get_output_embeddings()(hidden).argmax(-1)
        return self.capture.take(), hidden, best

    def output_rows(self, t2d: torch.Tensor) -> torch.Tensor:
        """The output embedding's rows of the draft vocabulary [Vd, Ht] (float32)."""
        return self.model.get_output_embeddings().weight.detach()[t2d.to(self.device)].float()

    @torch.inference_mode()
    def continue_sequences(
        self, prompts: torch.Tensor, new_tokens: int, temperature: float = 0.0, generator=None
    ) -> torch.Tensor:
        """The target's own continuations of prompts [B, P] -> [B, P + new_tokens]. EOS does not end a row,
        as it does not with ignore_eos."""
        ids = prompts.to(self.device)
        cache = DynamicCache(config=self.config)
        step = ids
        for _ in range(new_tokens):
            logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits[:, -1]  # [B, V]
            self.capture.take()  # the hooks fire on every forward; drop what they kept
            if temperature > 0:
                step = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
            else:
                step = logits.argmax(-1, keepdim=True)  # [B, 1]
            ids = torch.cat([ids, step], dim=1)
        return ids.cpu()

    @torch.inference_mode()
    def answer(
        self, prompts: Sequence[Sequence[int]], new_tokens: int, temperature: float = 0.0, generator=None
    ) -> list[list[int]]:
        """The target's own answers to prompts of any length (chat prompts): each prompt followed by up to
        `new_tokens` tokens, cut after its first EOS. The batch is left-padded; the mask and the positions
        keep the padding out of every real token's view."""
        lengths = [len(p) for p in prompts]
        width = max(lengths)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.as_tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        eos = torch.tensor(sorted(self.eos_token_ids), device=self.device)
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        out, step = [], ids
        for _ in range(new_tokens):
            logits = self.model(input_ids=step, attention_mask=mask, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits[:, -1]  # [B, V]
            self.capture.take()
            if temperature > 0:
                step = torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)
            else:
                step = logits.argmax(-1, keepdim=True)  # [B, 1]
            out.append(step)
            done |= torch.isin(step[:, 0], eos)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)
            positions = positions[:, -1:] + 1
        answers = torch.cat(out, dim=1).tolist()
        sequences = []
        for prompt, answer in zip(prompts, answers):
            ends = [i for i, t in enumerate(answer) if t in self.eos_token_ids]
            sequences.append(list(prompt) + answer[: ends[0] + 1 if ends else len(answer)])
        return sequences

    def remove(self) -> None:
        self.capture.remove()
