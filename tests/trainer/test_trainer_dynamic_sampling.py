"""Dynamic sampling: the filter reads the raw outcome (a shaped reward cannot fool it), refills come from the
run's sampler within the configured attempts, the metrics say what happened, and a resumed run draws the same
prompts. The collection is scripted (each prompt's outcomes and shaped rewards are fixed by its index), so the
numbers are hand-derived."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from stratarl.infra.checkpoint import DataSampler
from stratarl.infra.metrics import PhaseTimer
from stratarl.rollout.collect import CollectedBatch
from stratarl.rollout.config import RolloutConfig
from stratarl.trainer.dynamic import concat_batches, informative_groups, keep_groups, refill_size
from stratarl.trainer.settings import StepSettings
from stratarl.trainer.step import _collect

G = 2


def _script(index: int) -> tuple[list[float], list[float]]:
    """(raw outcomes, shaped totals) of prompt ``index``'s G rollouts. Prompts 0 mod 3 have outcomes that vary and
    a shaped total that does not; every other prompt's outcomes are constant (0) and its shaped totals vary (a
    format floor earned by one rollout only). A filter on the shaped total keeps exactly the wrong groups."""
    if index % 3 == 0:
        return [0.0, 1.0], [0.5, 0.5]
    return [0.0, 0.0], [0.2, 0.0]


def fake_collect(generator, retriever, tokenizer, examples, rollout, scoring, *, group_size, **kwargs):
    outcomes, totals, group_ids, flat = [], [], [], []
    for g, example in enumerate(examples):
        o, t = _script(example.index)
        outcomes += o
        totals += t
        group_ids += [g] * group_size
        flat += [example] * group_size
    n = len(flat)
    rollouts = [SimpleNamespace(tool_errors=int(getattr(e, "faulty", False)), response_mask=[1]) for e in flat]
    return CollectedBatch(
        rollouts, flat, group_ids, totals, outcomes, [0] * n, 1.0, 0.5,
        outcomes=outcomes, components=[{"answer": o} for o in outcomes], reward_faults=[""] * n, overlong=[False] * n,
    )  # fmt: skip


def _run(prompts: int, attempts: int, num_items: int = 30, seed: int = 0):
    step = StepSettings(
        rollout=RolloutConfig(group_size=G),
        prompts_per_step=prompts,
        seed=0,
        random_strata=False,
        prefix_from_rollouts=False,
        max_failed_fraction=0.5,
        num_transcripts=0,
        device="cpu",
        dynamic_sampling=True,
        dynamic_sampling_attempts=attempts,
    )
    return SimpleNamespace(
        settings=SimpleNamespace(step=step, update=SimpleNamespace(mini_batches=1)),
        task=SimpleNamespace(train=[SimpleNamespace(index=i, id=str(i)) for i in range(num_items)]),
        sampler=DataSampler(num_items, seed),
        parts=SimpleNamespace(collect=fake_collect),
        generator=None,
        retriever=None,
        tokenizer=None,
        scoring=None,
        prompt_cache={},
        timer=PhaseTimer(),
        reward_fault="",
    )


def _expected(run, prompts: int, attempts: int):
    """The prompts a refill loop draws and keeps, replayed on a copy of the sampler with refill_size."""
    sampler = DataSampler(run.sampler.num_items, run.sampler.seed, run.sampler.epoch, run.sampler.position)
    kept, seen, drawn, made = [], 0, 0, 0
    while made < attempts and len(kept) < prompts:
        size = refill_size(prompts - len(kept), len(kept), seen, prompts)
        draw = sampler.next(size)
        made, drawn, seen = made + 1, drawn + size, seen + size
        kept += [i for i in draw if i % 3 == 0][: prompts - len(kept)]
    return kept, seen, drawn, made


@pytest.mark.parametrize(("prompts", "attempts"), [(4, 4), (4, 1), (3, 10)])
def test_the_filter_reads_the_raw_outcome_and_refills_from_the_sampler(prompts, attempts):
    run = _run(prompts, attempts)
    kept, seen, drawn, made = _expected(run, prompts, attempts)
    collected, metrics = _collect(run, None)
    indices = [e.index for e in collected.examples[::G]]
    # Only the groups whose outcome varies, though every group's shaped total varies or is flat the other way.
    assert indices == kept and all(i % 3 == 0 for i in indices)
    assert collected.group_ids == [g for g in range(len(kept)) for _ in range(G)]
    assert collected.outcomes == [0.0, 1.0] * len(kept) and collected.rewards == [0.5, 0.5] * len(kept)
    assert metrics["dynsample/attempts"] == made <= attempts
    assert metrics["dynsample/prompts_drawn"] == drawn
    assert metrics["dynsample/kept_groups"] == len(kept)
    informative = sum(i % 3 == 0 for i in DataSampler(30, 0).next(drawn))
    assert metrics["dynsample/filtered_share"] == pytest.approx((seen - informative) / seen)
    assert (metrics["dynsample/groups_seen"], metrics["dynsample/groups_dropped"]) == (seen, seen - informative)
    assert metrics["dynsample/short"] == float(len(kept) < prompts)
    # The sampler moved by exactly the prompts drawn: nothing else draws from it.
    assert run.sampler.epoch * 30 + run.sampler.position == drawn


def test_a_short_step_says_so_and_keeps_what_it_found():
    # Hand-derived: prompts 1, 2, 4, 5 only (no informative one) -> every group dropped in each of 2 attempts.
    run = _run(prompts=2, attempts=2)
    run.task.train = [SimpleNamespace(index=i, id=str(i)) for i in (1, 2, 4, 5)]
    run.sampler = DataSampler(4, 0)
    collected, metrics = _collect(run, None)
    assert collected.rollouts == [] and metrics["dynsample/short"] == 1.0
    assert metrics["dynsample/attempts"] == 2.0 and metrics["dynsample/filtered_share"] == 1.0
    assert metrics["dynsample/prompts_drawn"] == 4.0  # 2, then 2 again (none kept yet: a full batch)
    assert metrics["dynsample/groups_seen"] == metrics["dynsample/groups_dropped"] == 4.0


def test_off_by_default_one_collection_of_every_group():
    run = _run(prompts=4, attempts=4)
    run.settings.step = StepSettings(**{**run.settings.step.__dict__, "dynamic_sampling": False})
    collected, metrics = _collect(run, None)
    assert len(collected.examples) == 4 * G and not any(key.startswith("dynsample/") for key in metrics)


def test_a_resumed_sampler_draws_the_same_prompts():
    straight = _run(prompts=3, attempts=3)
    _collect(straight, None)
    saved = straight.sampler.state_dict()
    second = [e.index for e in _collect(straight, None)[0].examples[::G]]
    resumed = _run(prompts=3, attempts=3)
    resumed.sampler.load_state_dict(saved)
    assert [e.index for e in _collect(resumed, None)[0].examples[::G]] == second


def test_refill_size_hand_derived():
    assert refill_size(4, 0, 0, 8) == 8  # nothing seen yet: a full batch
    assert refill_size(4, 0, 8, 8) == 8  # nothing kept yet: a full batch
    assert refill_size(3, 2, 8, 8) == 8  # 3 missing at a keep rate of 2/8 -> 12, capped at 8
    assert refill_size(2, 6, 8, 8) == 3  # 2 / (6/8) = 2.67 -> 3
    assert refill_size(0, 8, 8, 8) == 0


def test_keep_groups_and_concat_renumber_and_stay_aligned():
    batch = fake_collect(None, None, None, [SimpleNamespace(index=i) for i in (0, 1, 3)], None, None, group_size=G)
    assert informative_groups(batch) == [0, 2]
    kept = keep_groups(batch, [2, 0], first_id=5)
    assert kept.group_ids == [6, 6, 5, 5]  # rows in batch order; group 2 -> 5, group 0 -> 6 (the order named)
    both = concat_batches([kept, keep_groups(batch, [1], first_id=7)])
    assert both.group_ids == [6, 6, 5, 5, 7, 7] and len(both.outcomes) == len(both.rollouts) == 6
    assert both.generation_s == 2.0 and both.retrieval_s == 1.0
    # the run's tools survive the filter, so every tool keeps its tools/<name>/* metrics
    with_open = replace(batch, tools=("search", "open"))
    assert keep_groups(with_open, [0]).tools == ("search", "open")
    assert concat_batches([keep_groups(with_open, [0]), keep_groups(with_open, [2], first_id=1)]).tools == (
        "search",
        "open",
    )


class ScriptedSampler:
    """Hands out the given index lists in order (a stand-in for the data sampler)."""

    def __init__(self, *draws: list[int]) -> None:
        self.draws = list(draws)

    def next(self, k: int) -> list[int]:
        draw = self.draws.pop(0)
        assert len(draw) == k, (draw, k)
        return draw


def test_faults_over_the_refills_are_one_share_and_a_small_refill_is_never_too_small():
    # Attempt 1 draws [0, 1]; prompt 1's rollouts failed (2 of 4: share 0.5, not above 0.5): prompt 0 is kept.
    # Attempt 2 draws refill_size(1, 1, 1, 2) = 1 prompt, [3]: kept. Faulty share (0.5 x 2 + 0 x 1) / 3 = 1/3.
    run = _run(prompts=2, attempts=3)
    run.settings.update.mini_batches = 4  # more than the refill's 2 rollouts: no skip for that
    run.task.train = [SimpleNamespace(index=i, id=str(i), faulty=i == 1) for i in range(6)]
    run.sampler = ScriptedSampler([0, 1], [3])
    collected, metrics = _collect(run, None)
    assert [e.index for e in collected.examples[::G]] == [0, 3]
    assert metrics["update/skipped"] == 0.0 and metrics["retrieval/faulty_rollout_frac"] == pytest.approx(1 / 3)


def test_a_collection_with_too_many_faults_skips_the_step():
    run = _run(prompts=2, attempts=3)
    run.task.train = [SimpleNamespace(index=i, id=str(i), faulty=i in (0, 1)) for i in range(6)]
    run.sampler = ScriptedSampler([0, 1])
    _, metrics = _collect(run, None)
    assert metrics["update/skipped"] == 1.0 and metrics["retrieval/faulty_rollout_frac"] == 1.0
    assert metrics["dynsample/attempts"] == 1.0
