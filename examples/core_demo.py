"""Sixteen digits classifiers trained at once in one fused bucket, no Ray.

    .venv/bin/python examples/core_demo.py
"""
from __future__ import annotations

import time

from torch import nn

import chorus_tune as ct
from chorus_tune.examples_data import digits_split


def mlp(config: dict) -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def main(epochs: int = 10) -> None:
    task = ct.Task(mlp, digits_split(), optimizer="sgd", batch_size=64)
    bucket = ct.Bucket(task, capacity=16)
    configs = [dict(lr=lr, momentum=m, seed=i)
               for i, (lr, m) in enumerate((lr, m) for lr in (0.003, 0.01, 0.03, 0.1) for m in (0.0, 0.5, 0.9, 0.95))]
    slots = {bucket.add(c): c for c in configs}
    start = time.perf_counter()
    for _ in range(epochs):
        results = bucket.run_iteration()
    elapsed = time.perf_counter() - start
    print(f"{len(slots)} members x {epochs} epochs in {elapsed:.2f} s, route={bucket.route}")
    for slot, config in sorted(slots.items(), key=lambda kv: -results[kv[0]]["val_accuracy"]):
        accuracy = results[slot]["val_accuracy"]
        print(f"  lr={config['lr']:<6} momentum={config['momentum']:<5} val_accuracy={accuracy:.3f}")


if __name__ == "__main__":
    main()
