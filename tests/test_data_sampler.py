"""The global-batch sampler: same batches for any split of ranks and accumulation, exact resume; the eval sampler."""

import math

import pytest

from shardtune.data import EvalSampler, GlobalBatchSampler
from shardtune.errors import UsageError

# (world_size, gradient_accumulation_steps, micro_batch_size): all make global batches of 8 rows
SPLITS = [(1, 4, 2), (2, 2, 2), (4, 1, 2), (1, 1, 8), (8, 1, 1), (2, 4, 1)]


def global_steps(num_rows, world, accum, micro, seed=0, epoch=0, state=None):
    """Per optimizer step, the rows of every rank (rank -> micro-batches), run from ``state`` if given."""
    samplers = [GlobalBatchSampler(num_rows, micro_batch_size=micro, gradient_accumulation_steps=accum,
                                   world_size=world, rank=r, seed=seed) for r in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
        if state:
            s.load_state_dict(state)
    return [list(per_rank) for per_rank in zip(*samplers)], samplers


def test_same_global_batches_for_every_split():
    reference = None
    for world, accum, micro in SPLITS:
        steps, samplers = global_steps(100, world, accum, micro, seed=3)
        assert samplers[0].steps_per_epoch == len(steps) == 100 // 8
        sets = []
        for per_rank in steps:
            flat = [i for rank_batches in per_rank for mb in rank_batches for i in mb]
            assert len(flat) == len(set(flat)) == 8  # each rank reads only its own share
            assert all(len(rank_batches) == accum and all(len(mb) == micro for mb in rank_batches)
                       for rank_batches in per_rank)
            sets.append(frozenset(flat))
        reference = reference or sets
        assert sets == reference
    every = [i for s in reference for i in s]
    assert len(every) == len(set(every)) == 96  # no row twice in an epoch; the incomplete last batch is dropped


def test_epochs_and_seeds_reshuffle():
    a, sa = global_steps(64, 2, 2, 2, seed=0, epoch=0)
    b, _ = global_steps(64, 2, 2, 2, seed=0, epoch=1)
    c, _ = global_steps(64, 2, 2, 2, seed=1, epoch=0)
    assert a != b and a != c
    assert set(sa[0].global_batch(0)) == {i for rb in a[0] for mb in rb for i in mb}
    unshuffled = GlobalBatchSampler(16, micro_batch_size=2, gradient_accumulation_steps=1, world_size=2, rank=1,
                                    seed=0, shuffle=False)
    assert list(unshuffled)[0] == [[2, 3]]


@pytest.mark.parametrize("resume_split", [(2, 2, 2), (4, 1, 2), (1, 8, 1)])
def test_resume_continues_at_the_next_step_with_another_world_size(resume_split):
    full, _ = global_steps(80, 1, 4, 2, seed=5, epoch=1)
    full_sets = [{i for rb in per_rank for mb in rb for i in mb} for per_rank in full]
    # run 4 steps, checkpoint after the 4th optimizer step
    sampler = GlobalBatchSampler(80, micro_batch_size=2, gradient_accumulation_steps=4, world_size=1, rank=0, seed=5)
    sampler.set_epoch(1)
    it = iter(sampler)
    for _ in range(4):
        next(it)
    state = sampler.state_dict()
    assert state["epoch"] == 1 and state["step_in_epoch"] == 4 and len(sampler) == 10 - 4
    world, accum, micro = resume_split
    resumed, samplers = global_steps(80, world, accum, micro, seed=5, epoch=1, state=state)
    resumed_sets = [{i for rb in per_rank for mb in rb for i in mb} for per_rank in resumed]
    assert resumed_sets == full_sets[4:]
    samplers[0].set_epoch(2)  # the next epoch starts from its first step
    assert samplers[0].step_in_epoch == 0 and len(samplers[0]) == 10


def test_resume_refuses_another_global_batch_or_seed():
    state = GlobalBatchSampler(80, micro_batch_size=2, gradient_accumulation_steps=4, world_size=1, rank=0,
                               seed=5).state_dict()
    other = GlobalBatchSampler(80, micro_batch_size=2, gradient_accumulation_steps=2, world_size=1, rank=0, seed=5)
    with pytest.raises(UsageError, match="global_batch_size=8"):
        other.load_state_dict(state)
    reseeded = GlobalBatchSampler(80, micro_batch_size=2, gradient_accumulation_steps=4, world_size=1, rank=0, seed=6)
    with pytest.raises(UsageError, match="seed=5"):
        reseeded.load_state_dict(state)


def test_too_few_rows_for_one_global_batch():
    with pytest.raises(UsageError, match="fewer than one global batch of 16"):
        GlobalBatchSampler(10, micro_batch_size=2, gradient_accumulation_steps=4, world_size=2, rank=0, seed=0)


@pytest.mark.parametrize("num_rows,batch,world", [(10, 3, 2), (7, 2, 4), (8, 2, 2), (1, 4, 3)])
def test_eval_sampler_covers_every_row_once_with_equal_batches(num_rows, batch, world):
    samplers = [EvalSampler(num_rows, batch_size=batch, world_size=world, rank=r) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    # as many batches on every rank, and no more than the rows need: a global batch takes batch x world rows
    needed = math.ceil(num_rows / (batch * world))
    assert [len(p) for p in per_rank] == [len(s) for s in samplers] == [needed] * world
    assert all(len(b) == batch for p in per_rank for b in p)
    seen = [i for p in per_rank for b in p for i in b if i is not None]
    assert sorted(seen) == list(range(num_rows))


def grouped_steps(lengths, world, accum, micro, seed=0, state=None):
    """``global_steps`` with ``group_by_length``: the rows of each length-grouped step, per rank."""
    samplers = [GlobalBatchSampler(len(lengths), micro_batch_size=micro, gradient_accumulation_steps=accum,
                                   world_size=world, rank=r, seed=seed, lengths=lengths) for r in range(world)]
    for s in samplers:
        if state:
            s.load_state_dict(state)
    return [list(per_rank) for per_rank in zip(*samplers)], samplers


LENGTHS = [(i * 37) % 97 + 3 for i in range(1000)]  # 3..99 tokens, in no order


def padded_tokens(steps, lengths) -> int:
    """Tokens a step's micro-batches hold once each is padded to its longest row, summed over the epoch."""
    return sum(len(mb) * max(lengths[i] for i in mb) for per_rank in steps for batches in per_rank for mb in batches)


def test_group_by_length_keeps_the_global_batches_of_every_split():
    reference = None
    for world, accum, micro in SPLITS:
        steps, samplers = grouped_steps(LENGTHS, world, accum, micro, seed=3)
        assert len(steps) == samplers[0].steps_per_epoch == 1000 // 8
        sets = [frozenset(i for batches in per_rank for mb in batches for i in mb) for per_rank in steps]
        reference = reference or sets
        assert sets == reference
    every = [i for s in reference for i in s]
    assert len(every) == len(set(every)) == 1000 // 8 * 8


def test_group_by_length_cuts_padding_and_puts_the_longest_row_first():
    plain, _ = global_steps(1000, 2, 2, 2, seed=3)
    grouped, _ = grouped_steps(LENGTHS, 2, 2, 2, seed=3)
    real = sum(LENGTHS[i] for per_rank in grouped for batches in per_rank for mb in batches for i in mb)
    # Random micro-batches of 2 rows pad to the longer of two random lengths; grouped ones to almost their own.
    assert padded_tokens(grouped, LENGTHS) < 1.05 * real < 1.2 * padded_tokens(plain, LENGTHS)
    first = [i for batches in grouped[0] for mb in batches for i in mb]
    assert max(LENGTHS) in [LENGTHS[i] for i in first]
    # The steps are not in length order: the grouped batches are shuffled (unshuffled, each run of
    # LENGTH_GROUP_BATCHES steps after the first, the longest, would descend).
    from shardtune.data.sampler import LENGTH_GROUP_BATCHES

    longest = [max(LENGTHS[i] for batches in per_rank for mb in batches for i in mb) for per_rank in grouped]
    run = longest[1:LENGTH_GROUP_BATCHES]
    assert run != sorted(run, reverse=True)


def test_group_by_length_resumes_exactly_and_refuses_a_changed_setting():
    whole, _ = grouped_steps(LENGTHS, 2, 2, 2, seed=5)
    sampler = GlobalBatchSampler(1000, micro_batch_size=2, gradient_accumulation_steps=2, world_size=2, rank=0,
                                 seed=5, lengths=LENGTHS)
    for _ in zip(range(7), iter(sampler)):
        pass
    state = sampler.state_dict()
    assert state["step_in_epoch"] == 7
    resumed, _ = grouped_steps(LENGTHS, 1, 4, 2, seed=5, state=state)  # another split of the same global batch
    flat = lambda steps: [frozenset(i for batches in p for mb in batches for i in mb) for p in steps]  # noqa: E731
    assert flat(resumed) == flat(whole)[7:]
    plain = GlobalBatchSampler(1000, micro_batch_size=2, gradient_accumulation_steps=2, world_size=2, rank=0, seed=5)
    with pytest.raises(UsageError, match="group_by_length=True, this run has False"):
        plain.load_state_dict(state)
