"""A small user model following the hetlaunch entrypoint contract, for tests.

Imported as ``user_model:make_mlp_lm`` with this directory on sys.path.
"""

import torch.nn.functional as F
from torch import Tensor, nn


class TokenEmbed(nn.Module):
    def __init__(self, vocab_size: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)

    def forward(self, idx: Tensor) -> Tensor:
        return self.emb(idx)


class ResidualMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_mlp_lm(vocab_size: int = 256, d: int = 32, n_hidden: int = 3, seq_len: int = 16):
    # seq_len is part of the contract (the data pipeline reads it); this model ignores it.
    layers = [TokenEmbed(vocab_size, d)]
    layers += [ResidualMLP(d) for _ in range(n_hidden)]
    layers.append(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab_size)))
    return layers, lm_loss


# Deliberately broken entrypoints for the loader's error tests.
def returns_module():
    return nn.Linear(2, 2)


def returns_bad_layers():
    return [nn.Linear(2, 2), "not a module"], lm_loss


def returns_bad_loss():
    return [nn.Linear(2, 2)], 42


NOT_CALLABLE = 3
