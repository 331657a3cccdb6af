"""Models that are not Qwen, as a project would bring them: the recipes of tests/test_own_model*.py (issue 15).

Module-level functions and classes, so the recipes pickle by reference into sub-worlds (the resume check).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytest_sprite import Recipe

# --- a small classifier with a frozen layer -----------------------------------------------------------


class FrozenMLP(nn.Module):
    """A frozen input projection (a stand-in for pretrained features), a trainable body and a 3-class head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.embed.requires_grad_(False)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.relu(self.embed(x))))


def mlp_rows(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The issue's rows: n deterministic (features, label) pairs from a seeded generator."""
    g = torch.Generator().manual_seed(7)
    xs, ys = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return [(xs[i], ys[i]) for i in range(n)]


def mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy over the batch's rows."""
    x, y = batch
    return F.cross_entropy(model(x), y)


MLP = Recipe(name="mlp", model=FrozenMLP, rows=mlp_rows, loss=mlp_loss)


# --- a body we did not write: Lightning's "Train a model (basic)" autoencoder ---------------------------
# Encoder, Decoder and the loss of LitAutoEncoder.training_step are taken from the Lightning docs page
# "Train a model (basic)" (https://lightning.ai/docs/pytorch/stable/model/train_model_basic.html):
# x.view(x.size(0), -1) -> encoder -> decoder -> F.mse_loss(x_hat, x). MNIST is replaced by seeded
# 28x28 images so the test needs no download; mse_loss's mean over every pixel of equally sized rows is
# the mean over rows that a recipe's loss must be.


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x)  # type: ignore[no-any-return]


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Sequential(nn.Linear(3, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l1(x)  # type: ignore[no-any-return]


class AutoEncoder(nn.Module):
    """The docs' LitAutoEncoder(encoder, decoder) as a plain module: the harness brings the Lightning side."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Decoder()


def image_rows(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n seeded (image, label) pairs shaped like MNIST's: 1x28x28 floats in [0, 1), labels 0-9."""
    g = torch.Generator().manual_seed(11)
    images, labels = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return [(images[i], labels[i]) for i in range(n)]


def autoencoder_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """LitAutoEncoder.training_step's loss, unchanged apart from ``self`` being ``model`` (and ``y`` -> ``_y``)."""
    x, _y = batch
    x = x.view(x.size(0), -1)
    z = model.encoder(x)
    x_hat = model.decoder(z)
    return F.mse_loss(x_hat, x)


AUTOENCODER = Recipe(name="lit-autoencoder", model=AutoEncoder, rows=image_rows, loss=autoencoder_loss)
