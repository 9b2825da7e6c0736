"""Hugging Face GPT-2 as a user brings it through the `(layers, loss_fn)` entrypoint form: the
model built whole by `transformers.GPT2LMHeadModel`, its modules wrapped as layers, and the
output projection left as Hugging Face ties it (`lm_head.weight` IS `wte.weight`, one
Parameter object). Imported by agents as ``hf_pair_model:gpt2_layers`` (tests/ on sys.path)."""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Embeddings(nn.Module):
    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: Tensor) -> Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[-1], device=idx.device))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def gpt2_layers(seq_len: int, n_layer: int = 2, n_embd: int = 32, n_head: int = 4, vocab_size: int = 256):
    import transformers

    # No dropout: a pipeline and one process must draw nothing at random while training.
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                                     n_positions=seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    config._attn_implementation = "sdpa"  # causal without a mask tensor
    model = transformers.GPT2LMHeadModel(config)
    body = model.transformer
    layers = [Embeddings(body.wte, body.wpe), *(Block(b) for b in body.h), Head(body.ln_f, model.lm_head)]
    return layers, lm_loss
