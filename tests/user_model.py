"""A small user model following the hetlaunch entrypoint contract, for tests.

Imported as ``user_model:make_mlp_lm`` with this directory on sys.path.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TokenEmbed(nn.Module):
    def __init__(self, vocab_size: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)

    def forward(self, idx: Tensor) -> Tensor:
        return self.emb(idx)


class ResidualMLP(nn.Module):
    def __init__(self, d: int, mult: int = 2) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, mult * d)
        self.out = nn.Linear(mult * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(F.gelu(self.fc(self.ln(x))))


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def make_mlp_lm(vocab_size: int = 256, d: int = 32, n_hidden: int = 3, seq_len: int = 16, hidden_mult: int = 2):
    # seq_len is part of the contract (the data pipeline reads it); this model ignores it.
    layers = [TokenEmbed(vocab_size, d)]
    layers += [ResidualMLP(d, hidden_mult) for _ in range(n_hidden)]
    layers.append(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab_size)))
    return layers, lm_loss


# The LayeredModel form: each layer built alone, so a stage allocates only its own.
BUILT_LAYERS: list[tuple[int, str]] = []  # (index, device) of every make_layer call, for the tests


def make_layered_mlp_lm(vocab_size: int = 256, d: int = 32, n_hidden: int = 3, seq_len: int = 16,
                        hidden_mult: int = 2):
    from hetlaunch.runtime.model import LayeredModel

    num_layers = n_hidden + 2

    def make_layer(index: int) -> nn.Module:
        BUILT_LAYERS.append((index, str(torch.get_default_device())))
        if index == 0:
            return TokenEmbed(vocab_size, d)
        if index == num_layers - 1:
            return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab_size))
        return ResidualMLP(d, hidden_mult)
    return LayeredModel(num_layers, make_layer, lm_loss, vocab_size=vocab_size)


# Deliberately broken entrypoints for the loader's error tests.
def returns_module():
    return nn.Linear(2, 2)


def returns_bad_layers():
    return [nn.Linear(2, 2), "not a module"], lm_loss


def returns_bad_loss():
    return [nn.Linear(2, 2)], 42


NOT_CALLABLE = 3


# Boundaries that carry a tuple: every layer after the embedding takes and returns (hidden, mask),
# the mask a bool tensor that zeroes the padding positions' updates (token 0 counts as padding).
class MaskedEmbed(nn.Module):
    def __init__(self, vocab_size: int, d: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        return self.emb(idx), idx != 32  # a space byte "pads"


class MaskedMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = ResidualMLP(d)

    def forward(self, hidden_mask: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, mask = hidden_mask
        update = self.inner(hidden) - hidden
        return hidden + update * mask.unsqueeze(-1).to(hidden.dtype), mask


class MaskedHead(nn.Module):
    def __init__(self, d: int, vocab_size: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab_size))

    def forward(self, hidden_mask: tuple[Tensor, Tensor]) -> Tensor:
        return self.out(hidden_mask[0])


def make_masked_lm(vocab_size: int = 256, d: int = 32, n_hidden: int = 3, seq_len: int = 16):
    from hetlaunch.runtime.model import LayeredModel

    num_layers = n_hidden + 2

    def make_layer(index: int) -> nn.Module:
        if index == 0:
            return MaskedEmbed(vocab_size, d)
        if index == num_layers - 1:
            return MaskedHead(d, vocab_size)
        return MaskedMLP(d)
    return LayeredModel(num_layers, make_layer, lm_loss, vocab_size=vocab_size)


# A known pattern in the activations: the capture test (tests/stage/test_encrypted_data_plane.py)
# looks for these bytes on the wire.
PLANTED = 2.7182817
PLANTED_WIDTH = 8  # floats of every token's activation after layer 0


class PlantedEmbed(TokenEmbed):
    def forward(self, idx: Tensor) -> Tensor:
        out = self.emb(idx)
        return torch.cat([out[..., PLANTED_WIDTH:], torch.full_like(out[..., :PLANTED_WIDTH], PLANTED)], dim=-1)


def make_planted_lm(vocab_size: int = 256, d: int = 32, n_hidden: int = 1, seq_len: int = 16):
    layers, loss = make_mlp_lm(vocab_size, d, n_hidden, seq_len)
    layers[0] = PlantedEmbed(vocab_size, d)
    return layers, loss
