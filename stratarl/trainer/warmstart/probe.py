"""The warm start's reading probe: greedy rollouts on a world the warm start never trains on.

A warm start on fresh worlds learns to copy names from the passages it reads, and that skill can
arrive suddenly or not at all, depending on the stream of worlds it happens to see. So a fixed
step count is not evidence that it worked. The probe measures the skill directly, with the run's
own prompt, rollout engine, retriever kind and greedy decoding:

- ``single_hop_em``: greedy EM on single-hop questions of an unseen world (copying one name from
  one search's passages);
- ``multi_hop_searches`` / ``multi_hop_one_search``: on that world's 2-hop questions, the mean
  number of searches and the share answered after exactly one search (the weak search policy
  that RL is meant to improve);
- ``sampled_two_search`` / ``sampled_two_search_em``: the same 2-hop questions sampled at the RL
  temperature (``rollout.temperature``): the share of rollouts that search at least twice, and
  their EM. This is what GRPO can reinforce: a policy that never samples a second search, or whose
  second searches never succeed, gives RL no signal on 2-hop questions whatever its greedy EM.

The probe world's seed comes from its own range (``PROBE_WORLD_OFFSET``), far from the task's
seed and from the demonstration and reading worlds, so no fact of it is ever trained on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from stratarl.data.synth import generate_knowledge_base
from stratarl.evaluation.greedy import evaluate
from stratarl.infra.threads import step_threads
from stratarl.retrieval.timed import TimedRetriever
from stratarl.rollout.backends import make_generator
from stratarl.rollout.collect import collect
from stratarl.trainer.warmstart.settings import ProbeSettings, WorldSettings

# Demonstration worlds count up from WORLD_SEED_STRIDE * (s + 1); reading worlds start half a stride
# further; probe worlds a quarter of a stride further: the three ranges never meet.
PROBE_WORLD_OFFSET = 250_000


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured (greedy rollouts, one per question)."""

    step: int
    single_hop_em: float
    multi_hop_searches: float
    multi_hop_one_search: float
    num_single_hop: int
    num_multi_hop: int
    seconds: float
    sampled_two_search: float = 0.0
    sampled_two_search_em: float = 0.0

    def passed(self, min_em: float) -> bool:
        return self.single_hop_em >= min_em

    def metrics(self) -> dict[str, float]:
        return {
            "probe/single_hop_em": self.single_hop_em,
            "probe/multi_hop_searches": self.multi_hop_searches,
            "probe/multi_hop_one_search": self.multi_hop_one_search,
            "probe/sampled_two_search": self.sampled_two_search,
            "probe/sampled_two_search_em": self.sampled_two_search_em,
            "time/probe": self.seconds,
        }

    def line(self) -> str:
        return (
            f"probe at step {self.step}: single-hop EM {self.single_hop_em:.3f} ({self.num_single_hop} questions "
            f"of an unseen world); 2-hop: {self.multi_hop_searches:.2f} searches, "
            f"{self.multi_hop_one_search:.0%} answered after one search ({self.num_multi_hop} questions); sampled "
            f"at the RL temperature, {self.sampled_two_search:.0%} search twice or more, with EM "
            f"{self.sampled_two_search_em:.2f}"
        )


def probe_questions(worlds: WorldSettings, num_questions: int, *, seed: int):
    """(single-hop questions, 2-hop questions, BM25 retriever) of the probe world with ``seed``: ``num_questions``
    of each (fewer if the world holds fewer), generated with ``sft.world_options`` over ``data.synthetic.options``."""
    options = worlds.generator_options(hop_mix=(0.5, 0.5, 0.0), num_train=2 * num_questions, num_test=0)
    kb = generate_knowledge_base(seed=seed, **options)
    questions = [*kb.train, *kb.test]
    single = [e for e in questions if len(e.metadata.get("hops") or []) == 1][:num_questions]
    multi = [e for e in questions if len(e.metadata.get("hops") or []) == 2][:num_questions]
    if not single:
        raise ValueError(
            f"the probe world (options {options}) holds no single-hop question. Fix: drop hop_mix and "
            "num_train from sft.world_options"
        )
    from stratarl.retrieval.bm25 import BM25Retriever  # bm25s is optional (gpu_check.py)

    return single, multi, BM25Retriever.from_passages(kb.passages)


def run_probe(model, tokenizer, settings: ProbeSettings, questions, *, step: int) -> ProbeResult:
    """Greedy rollouts of ``model`` on the probe questions (``probe_questions``), with the run's rollout settings."""
    single, multi, retriever = questions
    start = time.perf_counter()
    result = evaluate(model, tokenizer, retriever, [*single, *multi], settings.eval, num_transcripts=0)
    records = result["per_question"]
    single_em = [r["em"] for r in records[: len(single)]]
    multi_searches = [r["searches"] for r in records[len(single) :]]
    two_search_share, two_search_em = sampled_second_searches(model, tokenizer, settings, multi, retriever, step=step)
    return ProbeResult(
        step=step,
        sampled_two_search=two_search_share,
        sampled_two_search_em=two_search_em,
        single_hop_em=sum(single_em) / len(single_em),
        multi_hop_searches=sum(multi_searches) / len(multi_searches) if multi_searches else 0.0,
        multi_hop_one_search=sum(s == 1 for s in multi_searches) / len(multi_searches) if multi_searches else 0.0,
        num_single_hop=len(single),
        num_multi_hop=len(multi),
        seconds=time.perf_counter() - start,
    )


def sampled_second_searches(
    model, tokenizer, settings: ProbeSettings, questions, retriever, *, step: int
) -> tuple[float, float]:
    """(share of sampled rollouts with >= 2 searches, their EM) on ``questions`` at ``rollout.temperature``,
    one rollout each, seeded by ``step`` (the same draw for the same weights and step)."""
    if not questions:
        return 0.0, 0.0
    policy = settings.eval.policy
    generator = make_generator(model, tokenizer, settings.backend, seed=1_000 + step, policy=policy)
    with step_threads(model):
        batch = collect(
            generator,
            TimedRetriever(retriever),
            tokenizer,
            list(questions),
            settings.eval.rollout,
            settings.eval.scoring,
            group_size=1,
            greedy=False,
        )
    searched = [em for r, em in zip(batch.rollouts, batch.em) if r.num_searches >= 2]
    return len(searched) / len(batch.rollouts), (sum(searched) / len(searched) if searched else 0.0)


class WarmStartFailed(RuntimeError):
    """The warm start never passed its reading probe within ``sft.max_steps``. ``folder`` holds the losses
    (sft_metrics.jsonl) and a sample of the demonstrations (demos_sample.jsonl) that the message points to."""

    def __init__(self, probe: ProbeResult, min_em: float, steps: int, step_limit: int, folder: Path) -> None:
        self.probe, self.min_em, self.steps, self.step_limit, self.folder = (
            probe,
            min_em,
            steps,
            step_limit,
            Path(folder),
        )
        super().__init__(
            f"the warm start did not pass its reading probe: greedy single-hop EM {probe.single_hop_em:.3f} < "
            f"sft.probe_min_em={min_em:g} on {probe.num_single_hop} questions of an unseen world after {steps} "
            f"steps (sft.max_steps={step_limit}); nothing was cached. Fix: raise sft.max_steps or sft.lr, or read "
            f"the demonstrations in {self.folder / 'demos_sample.jsonl'} and the losses in "
            f"{self.folder / 'sft_metrics.jsonl'}"
        )

    def moved_to(self, folder: Path) -> WarmStartFailed:
        """The same failure, its files now in ``folder``."""
        return WarmStartFailed(self.probe, self.min_em, self.steps, self.step_limit, folder)
