"""Real example data that ships inside this package: no download, and no
scikit-learn, at run time.

``data_files/digits.npz`` holds the "Optical Recognition of Handwritten Digits"
data set of the UCI Machine Learning Repository (E. Alpaydin and C. Kaynak,
1998; CC BY 4.0): the 1,797 8x8 images that scikit-learn bundles as
``sklearn.datasets.load_digits``, with the same pixel counts (0-16, stored as
uint8), labels and order. ``tests/test_packaging.py`` checks them against
scikit-learn's copy, and that an installed wheel loads them without it.
"""
from __future__ import annotations

import io
from importlib import resources

import numpy as np
import torch

DIGITS_FILE = "data_files/digits.npz"


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(data, target)`` as ``load_digits()`` gives them: ``(1797, 64)`` float64
    pixel counts in 0..16 and ``(1797,)`` int64 labels in 0..9."""
    raw = resources.files("chorus_tune").joinpath(DIGITS_FILE).read_bytes()
    with np.load(io.BytesIO(raw)) as stored:
        return stored["data"].astype(np.float64), stored["target"].astype(np.int64)


def digits_split(n_train: int = 1400) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The 8x8 digits (the set scikit-learn bundles, shipped here), scaled to
    [0, 1], as ``((X_train, y_train), (X_val, y_val))`` with 64 features and 10
    classes: the first ``n_train`` rows train, the rest validate."""
    data, target = digits_arrays()
    x = torch.tensor(data, dtype=torch.float32) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])
