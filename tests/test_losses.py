"""The vmap form of a named loss (``losses.vmap_form``): what a vmapped fused
call computes in its place must be the loss itself, value and gradient: bit for
bit where it runs torch's kernels, to float32 rounding where it lays 8 to 15
classes out class-first on a CPU (a faster kernel, summing in another order)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from chorus_tune import losses


def _values_and_grads(loss_fn, output: torch.Tensor, target: torch.Tensor):
    output = output.detach().clone().requires_grad_(True)
    values = loss_fn(output, target)
    (grad,) = torch.autograd.grad(values.sum(), output)
    return values, grad


# 20 classes: torch's own log_softmax kernel (bit for bit); 10: the class-first layout.
TORCH_KERNEL, CLASS_FIRST = 20, 10


def _agree(got: torch.Tensor, expected: torch.Tensor, classes: int) -> bool:
    if classes == TORCH_KERNEL:
        return torch.equal(got, expected)
    return torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("classes", [TORCH_KERNEL, CLASS_FIRST])
@pytest.mark.parametrize("case", ["classes", "ignore_index", "spatial"])
def test_the_vmap_form_of_cross_entropy_is_torch_s_value_and_gradient(case, classes):
    torch.manual_seed(0)
    if case == "spatial":  # (N, C, d1, d2) logits, (N, d1, d2) targets: the class dimension is 1
        output, target = torch.randn(4, classes, 5, 6), torch.randint(0, classes, (4, 5, 6))
    else:
        output, target = torch.randn(64, classes) * 4, torch.randint(0, classes, (64,))
        if case == "ignore_index":
            target[::7] = losses.IGNORE_INDEX  # torch counts these as 0, with no gradient
    expected = _values_and_grads(losses.cross_entropy, output, target)
    got = _values_and_grads(losses.vmap_form(losses.cross_entropy), output, target)
    assert _agree(got[0], expected[0], classes) and _agree(got[1], expected[1], classes)
    if case == "ignore_index":
        assert (got[0][target == losses.IGNORE_INDEX] == 0).all()


@pytest.mark.parametrize("classes", range(2, 33))
def test_the_vmap_form_of_cross_entropy_agrees_with_torch_s_for_every_class_count(classes):
    torch.manual_seed(classes)
    output, target = torch.randn(256, classes) * 8, torch.randint(0, classes, (256,))
    expected = _values_and_grads(losses.cross_entropy, output, target)
    got = _values_and_grads(losses.vmap_form(losses.cross_entropy), output, target)
    assert torch.allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("classes", [TORCH_KERNEL, CLASS_FIRST])
def test_the_vmap_form_of_cross_entropy_runs_in_float32_under_autocast_as_torch_s_does(classes):
    torch.manual_seed(0)
    layer, x, target = torch.nn.Linear(20, classes), torch.randn(64, 20), torch.randint(0, classes, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = layer(x)
        expected = losses.cross_entropy(output, target)
        got = losses.vmap_form(losses.cross_entropy)(output, target)
    assert output.dtype == torch.bfloat16 and got.dtype == expected.dtype == torch.float32
    assert _agree(got, expected, classes)


@pytest.mark.parametrize("classes", [TORCH_KERNEL, CLASS_FIRST])
def test_the_vmap_form_of_cross_entropy_under_vmap_matches_torch_per_member(classes):
    torch.manual_seed(0)
    outputs, targets = torch.randn(8, 32, classes), torch.randint(0, classes, (8, 32))
    fused = torch.func.vmap(torch.func.grad(lambda o, t: losses.vmap_form(losses.cross_entropy)(o, t).mean()))
    got = fused(outputs, targets)
    for k in range(8):
        expected = torch.func.grad(lambda o: F.cross_entropy(o, targets[k]))(outputs[k])  # noqa: B023
        assert _agree(got[k], expected, classes), k


def test_class_probability_targets_go_to_torch_s_own_cross_entropy():
    torch.manual_seed(0)
    output, probabilities = torch.randn(16, 5), torch.softmax(torch.randn(16, 5), dim=1)
    assert torch.equal(losses.vmap_form(losses.cross_entropy)(output, probabilities),
                       F.cross_entropy(output, probabilities, reduction="none"))


def test_other_losses_have_no_other_form():
    assert losses.vmap_form(losses.mse) is losses.mse

    def custom(output, target):
        return (output - target).abs().mean(dim=1)

    assert losses.vmap_form(custom) is custom


def test_a_bucket_on_the_vmap_route_trains_and_evaluates_without_importing_sympy():
    # Torch's decomposition of nll_loss, which vmap runs for F.cross_entropy,
    # imports sympy (through torch._check): 0.47 CPU-s in every bucket process.
    # The bucket hands its vmapped calls the vmap form (training and evaluation).
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})\n"
        "import chorus_tune as ct\n"
        "from models import mlp_task\n"
        "bucket = ct.Bucket(mlp_task(), 2, route='vmap')\n"
        "for lr in (0.05, 0.1):\n"
        "    bucket.add({'lr': lr}, seed=1)\n"
        "results = bucket.run_iteration()\n"
        "assert {r['route'] for r in results.values()} == {'vmap'}, results\n"
        "print('sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_accuracy_against_class_probabilities_counts_the_argmax_of_each_target():
    output = torch.eye(3)[[0, 1, 2]] * 5  # predicts 0, 1, 2
    target = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.0, 0.1, 0.9]])  # classes 0, 2, 2
    assert losses.accuracy_count(output, target).item() == 2
