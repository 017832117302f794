"""Real example data that ships with the installed packages: no downloads at run time."""
from __future__ import annotations

import torch


def digits_split(n_train: int = 1400) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 digits (bundled inside scikit-learn), scaled to [0, 1],
    as ``((X_train, y_train), (X_val, y_val))`` with 64 features and 10 classes."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
