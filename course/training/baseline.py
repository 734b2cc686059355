"""The course's reference experiment (notebook 01), for later notebooks to compare with.

Seed 123, inputs and labels ``torch.randn(20, 10)``, ``nn.Linear(10, 10)``, SGD with
lr=1, MSE loss, one step. The random draws happen in that order: data first, then the
model's initial weights.
"""

import torch
from torch import nn

SEED = 123
N_SAMPLES = 20
N_FEATURES = 10


def classic_data(seed: int = SEED):
    """Inputs and labels, both ``(20, 10)``, drawn right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    inputs = torch.randn(N_SAMPLES, N_FEATURES)
    labels = torch.randn(N_SAMPLES, N_FEATURES)
    return inputs, labels


def train_step(model, inputs, labels, lr: float = 1.0):
    """One SGD step on the MSE loss. Returns the loss before the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def single_device_step(seed: int = SEED) -> nn.Linear:
    """The whole baseline: data, model, one step, on one device. Returns the model."""
    inputs, labels = classic_data(seed)
    model = nn.Linear(N_FEATURES, N_FEATURES)  # initialised from the RNG *after* the data
    train_step(model, inputs, labels)
    return model
