"""BatchOrder, each member's stream of batch indices, checked on its own.

The fused bucket and reference.py both draw batches from BatchOrder, so
test_fidelity.py cannot see an order that is wrong in both: these tests hold
it to what its docstring promises (a fresh permutation per epoch, the partial
last batch dropped, seeded) and, for its first epoch, to the stock torch
sampler it stands for.
"""
from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, RandomSampler

from chorus_tune.data import BatchOrder

N, BATCH = 10, 3  # 3 batches an epoch; one sample left out of each


def epochs(order: BatchOrder, count: int) -> list[torch.Tensor]:
    """The next ``count`` epochs of indices, one ``(batches, BATCH)`` tensor each."""
    per_epoch = N // BATCH
    return list(order.take(per_epoch * count).split(per_epoch))


def test_each_epoch_takes_every_index_at_most_once_and_drops_only_the_partial_batch():
    for epoch in epochs(BatchOrder(N, BATCH, seed=0), 5):
        assert epoch.shape == (N // BATCH, BATCH)
        seen = epoch.flatten().tolist()
        assert len(set(seen)) == len(seen) == N - N % BATCH
        assert set(seen) <= set(range(N))


def test_each_epoch_is_a_fresh_order():
    orders = [tuple(e.flatten().tolist()) for e in epochs(BatchOrder(N, BATCH, seed=0), 6)]
    assert len(set(orders)) == len(orders)


def test_an_order_is_reproducible_from_its_seed_and_differs_between_seeds():
    assert torch.equal(BatchOrder(N, BATCH, seed=7).take(12), BatchOrder(N, BATCH, seed=7).take(12))
    assert not torch.equal(BatchOrder(N, BATCH, seed=7).take(12), BatchOrder(N, BATCH, seed=8).take(12))


def test_each_epoch_is_the_next_randperm_of_the_seeded_generator_cut_to_whole_batches():
    generator = torch.Generator().manual_seed(5)
    expected = [torch.randperm(N, generator=generator)[:N - N % BATCH].reshape(-1, BATCH) for _ in range(4)]
    assert torch.equal(BatchOrder(N, BATCH, seed=5).take(4 * (N // BATCH)), torch.cat(expected))


def test_the_first_epoch_is_what_a_stock_shuffling_sampler_dropping_the_last_batch_gives():
    # Only the first: RandomSampler draws a second randperm at each epoch's end
    # (for its empty remainder), so its later epochs are another stream.
    sampler = BatchSampler(RandomSampler(range(N), generator=torch.Generator().manual_seed(5)), BATCH,
                           drop_last=True)
    assert BatchOrder(N, BATCH, seed=5).take(N // BATCH).tolist() == list(sampler)


def test_peek_shows_the_next_batch_without_taking_it():
    order = BatchOrder(N, BATCH, seed=3)
    order.take(2)
    peeked = order.peek()
    assert torch.equal(peeked, order.take(1)[0])
    assert torch.equal(order.take(1)[0], BatchOrder(N, BATCH, seed=3).take(4)[3])  # take(1) moved on; peek did not


def test_an_order_restored_from_its_state_continues_the_same_stream():
    whole = BatchOrder(N, BATCH, seed=4).take(10)
    first = BatchOrder(N, BATCH, seed=4)
    head = first.take(4)  # mid-epoch
    resumed = BatchOrder(N, BATCH, seed=99)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(torch.cat([head, resumed.take(6)]), whole)
