"""Streams of fresh synthetic worlds for the warm start: demonstration worlds, reading worlds, rehearsal worlds.

Every world is drawn from the task's shared name pool but is never the task's own world: its seed lies in a
range of its own, far from any seed a user writes (``world_seed``; the reading, rehearsal and probe worlds
have their own offsets), so no fact of the task is ever trained on.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from stratarl.data.synth import generate_knowledge_base
from stratarl.trainer.warmstart.demos import Demonstration, render_demonstrations, render_reading_examples
from stratarl.trainer.warmstart.settings import WarmStartSettings, WorldSettings

# Demonstration worlds of task seed s are seeds WORLD_SEED_STRIDE * (s + 1) + i, i = 0, 1, ...: far
# from any task seed a user writes, so the task's own world is never among them (checked, too).
WORLD_SEED_STRIDE = 1_000_003


def world_seed(task_seed: int, index: int) -> int:
    """Seed of the ``index``-th demonstration world of the task with seed ``task_seed``."""
    return WORLD_SEED_STRIDE * (task_seed + 1) + index


def _world(worlds: WorldSettings, index: int, **overrides):
    """The ``index``-th demonstration world (a SyntheticKB) and its BM25 retriever."""
    options = worlds.generator_options(**overrides)
    try:
        kb = generate_knowledge_base(seed=world_seed(worlds.task_seed, index), **options)
    except TypeError as error:
        raise ValueError(
            f"sft.world_options {dict(worlds.world_options)!r} do not fit generate_knowledge_base: {error}. "
            "Fix: use its keyword arguments (size, num_train, hop_mix, ...)"
        ) from None
    from stratarl.retrieval.bm25 import BM25Retriever  # bm25s is optional (gpu_check.py)

    return kb, BM25Retriever.from_passages(kb.passages)


def _mixed_batches(
    render: Callable[[int, int], list[Demonstration]], *, batch_size: int, mix_worlds: int, rng: random.Random
) -> Iterator[list[Demonstration]]:
    """Endless batches drawn from a shuffled pool that holds at least ``mix_worlds`` batches' worth:
    ``render(world_index, batches_so_far)`` refills it one fresh world at a time (so one batch is not
    one world's facts)."""
    pool: list[Demonstration] = []
    index, produced = 0, 0
    while True:
        while len(pool) < batch_size * mix_worlds:
            pool += render(index, produced)
            index += 1
        rng.shuffle(pool)
        batch, pool = pool[:batch_size], pool[batch_size:]
        produced += 1
        yield batch


def reading_batches(
    settings: WarmStartSettings,
    tokenizer,
    *,
    batch_size: int,
    curriculum: int,
    mix_worlds: int = 4,
    first_world: int | None = None,
) -> Iterator[list[Demonstration]]:
    """Endless batches of reading examples (``render_reading_examples``) from fresh single-hop worlds; a world
    rendered after i batches shortens observations to one sentence with probability max(0, 1 - i / curriculum).
    Reading worlds are numbered from ``first_world`` (default ``READING_WORLD_OFFSET``, the far end of the
    demonstration worlds' range), so the stages never share a world; the rehearsal stream that
    ``sft.reading_mix`` adds to the demonstrations starts at ``REHEARSAL_WORLD_OFFSET``."""

    first_world = READING_WORLD_OFFSET if first_world is None else first_world
    rng = random.Random(settings.seed + 1 + first_world - READING_WORLD_OFFSET)
    style = settings.style

    def render(index: int, produced: int) -> list[Demonstration]:
        kb, retriever = _world(settings.worlds, first_world + index, hop_mix=(1.0, 0.0, 0.0))
        return render_reading_examples(
            kb.train,
            tokenizer,
            retriever,
            {p.id: p.contents for p in kb.passages},
            topk=style.topk,
            max_obs_tokens=style.max_obs_tokens,
            rng=rng,
            sentence_probability=max(0.0, 1.0 - produced / curriculum) if curriculum else 0.0,
            agent_probability=settings.reading.agent_fraction,
            prompt_template=style.prompt_template,
            protocol=style.protocol,
            tools=style.tools,
        )

    return _mixed_batches(render, batch_size=batch_size, mix_worlds=mix_worlds, rng=rng)


# Reading worlds start here (demonstration worlds count up from 0): far apart, never the same seed.
READING_WORLD_OFFSET = WORLD_SEED_STRIDE // 2
# The rehearsal stream's reading worlds (``sft.reading_mix``), past the reading stage's (it draws a few hundred).
REHEARSAL_WORLD_OFFSET = READING_WORLD_OFFSET + 100_000


def world_demonstrations(settings: WarmStartSettings, tokenizer, index: int) -> list[Demonstration]:
    """All demonstrations of the ``index``-th fresh world: a synthetic KB drawn from the task's name pool
    with ``sft.world_options`` over ``data.synthetic.options``, indexed with its own BM25, rendered with the
    same prompt, observation caps and imperfect-demo mix as ``sft.source: task``, shuffled."""

    kb, retriever = _world(settings.worlds, index)
    seed = world_seed(settings.worlds.task_seed, index)
    return render_demonstrations(
        kb.train, tokenizer, retriever, num_demos=len(kb.train), seed=seed, **settings.style.kwargs()
    )


def world_batches(
    settings: WarmStartSettings, tokenizer, *, batch_size: int, mix_worlds: int = 4
) -> Iterator[list[Demonstration]]:
    """Endless batches of demonstrations never seen before: worlds 0, 1, 2, ... are rendered on demand and
    each batch draws from ``mix_worlds`` worlds at a time (so one batch is not one world's facts)."""
    return _mixed_batches(
        lambda index, _: world_demonstrations(settings, tokenizer, index),
        batch_size=batch_size,
        mix_worlds=mix_worlds,
        rng=random.Random(settings.seed),
    )
