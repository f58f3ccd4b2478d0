"""Populations end to end (stratarl.trainer.population): a member's run equals its solo run bit for bit,
members never share state, a population resumes
per member, a failing member is dropped without stopping the others, and `stratarl population` writes run
directories that `stratarl report --aggregate` reads as solo runs'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from stratarl.trainer.config import load_config
from stratarl.trainer.population import Member, run_population
from stratarl.trainer.rl import train
from stratarl.trainer.step import rl_step

pytestmark = [pytest.mark.slow]
LAB = Path(__file__).resolve().parents[2] / "configs" / "lab.yaml"
REWARD_MODULE = '''
def length_parity_reward(response_text, golds):
    """Deterministic, varied across rollouts: non-zero advantages from a random policy."""
    return float(len(response_text) % 2 == 0)
'''
# (name, trainer.seed, world = data.synthetic.seed, overrides): members differ in seed, world, arm and lr.
MEMBERS = [
    ("grpo-w0-s0", 0, 0, ["algo.name=grpo"]),
    ("strat-w1-s1", 1, 1, ["algo.name=stratified_grpo", "optim.lr=3e-4"]),
    ("ppo-w0-s2", 2, 0, ["algo.name=ppo"]),
]
# Metrics that are timings (a member's include the time it waited for the others).
TIMING = ("time/", "perf/")


def overrides(root: Path, seed: int, world: int, steps: int = 3) -> list[str]:
    """configs/lab.yaml at test size (random 32-wide word-level policy, a 120-passage world, no warm start)."""
    return [
        "model.tiny_hidden_size=32",
        "model.tiny_intermediate_size=64",
        "model.tiny_num_heads=2",
        (
            "data.synthetic.options={size: 120, num_train: 30, num_test: 6, hop_mix: [0.3, 0.7, 0.0], guessable: none, "
            "name_pool: 300}"
        ),
        f"data.synthetic.seed={world}",
        f"data.synthetic.cache_dir={root / f'kb-w{world}'}",  # an explicit cache_dir is the world's folder
        "data.max_eval_examples=6",
        "eval.batch_size=6",
        "eval.before_after=true",
        "sft.enabled=false",
        f"trainer.steps={steps}",
        "trainer.prompts_per_step=2",
        "trainer.eval_every=2",
        "trainer.save_every=2",
        "rollout.group_size=3",
        "rollout.max_tokens_per_turn=12",
        "logging.progress=false",
        "logging.num_transcripts=2",
        f"trainer.seed={seed}",
        f"trainer.output_dir={root / 'runs'}",
        "algo.reward=stratarl_test_rewards:length_parity_reward",
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder with the test reward module on sys.path (module-wide: the solo runs are shared by the tests)."""
    path = tmp_path_factory.mktemp("population")
    (path / "rewards").mkdir()
    (path / "rewards" / "stratarl_test_rewards.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(path / "rewards"))
    yield path
    sys.path.remove(str(path / "rewards"))


def members(root: Path, folder: str, steps: int = 3, specs=MEMBERS) -> list[Member]:
    return [
        Member(name, load_config(LAB, overrides(root, seed, world, steps) + extra), root / folder / name)
        for name, seed, world, extra in specs
    ]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING)}


@pytest.fixture(scope="module")
def solo(root) -> Path:
    """Each member trained alone, as `stratarl train` trains it."""
    for member in members(root, "solo"):
        train(member.cfg, member.run_dir)
    return root / "solo"


@pytest.fixture(scope="module")
def alone(root):
    """The members trained as one population."""
    report = run_population(members(root, "alone"))
    assert all(r.ok for r in report.members), [r.error for r in report.members]
    assert [r.name for r in report.members] == [name for name, *_ in MEMBERS]
    return root / "alone"


def test_members_equal_their_solo_runs_bit_for_bit(root, solo, alone):
    for name, *_ in MEMBERS:
        a, b = rows(solo / name), rows(root / "alone" / name)
        assert [numbers(r) for r in a] == [numbers(r) for r in b], name
        for tag in ("before", "step_000002", "after"):
            assert (solo / name / "eval" / f"{tag}.json").is_file() and (
                root / "alone" / name / "eval" / f"{tag}.json"
            ).is_file()
        after = [json.loads((d / name / "eval" / "after.json").read_text()) for d in (solo, root / "alone")]
        assert after[0]["per_question"] == after[1]["per_question"]
        for step in (1, 2, 3):
            transcript = f"transcripts/step_{step:06d}.jsonl"
            assert (solo / name / transcript).read_text() == (root / "alone" / name / transcript).read_text()


def test_a_members_run_directory_is_laid_out_as_a_solo_runs(solo, alone):
    def layout(run_dir: Path) -> set[str]:
        return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.name != "train.log"}

    for name, *_ in MEMBERS:
        assert layout(solo / name) == layout(alone / name)
        assert "step 3/3" in (alone / name / "train.log").read_text()  # its output went to its own log
        summary = json.loads((alone / name / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["exit_code"] == 0 and "eval_after" in summary


def test_members_never_share_a_model_an_optimizer_a_world_or_a_group(root):
    runs = {}

    def recording(cfg, run_dir, *, resume, start_over, parts):
        def step(run):
            runs[run_dir.name] = run
            return rl_step(run)

        return train(cfg, run_dir, resume=resume, start_over=start_over, parts=parts, step=step)

    report = run_population(members(root, "isolation", steps=2), pipeline=recording)
    assert all(r.ok for r in report.members)
    assert len(runs) == len(MEMBERS)
    states = list(runs.values())

    def storages(run) -> set[int]:
        params = {p.data_ptr() for p in run.model.parameters()}
        moments = {
            t.data_ptr()
            for s in run.learner.optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        return params | moments

    for i, a in enumerate(states):
        assert a.learner.optimizer.state, "the optimizer took a step"
        for b in states[i + 1 :]:
            assert storages(a).isdisjoint(storages(b))
            for attr in ("model", "learner", "retriever", "task", "sampler", "shuffle_rng", "logger", "prompt_cache"):
                assert getattr(a, attr) is not getattr(b, attr), attr
            assert a.generator.rng is not b.generator.rng and a.generator is not b.generator
            assert a.learner.optimizer is not b.learner.optimizer
    # Each member's rollouts are its own questions, of its own world, in groups of its own.
    for name, _, world, _ in MEMBERS:
        run = runs[name]
        own = {(e.question, tuple(e.golden_answers)) for e in run.task.train}
        other_worlds = {
            (e.question, tuple(e.golden_answers))
            for r in runs.values()
            if r.cfg.data.synthetic.seed != world
            for e in r.task.train
        }
        assert own and len(own & other_worlds) < len(own) / 2  # another world (names of one pool may repeat)
        for line in (root / "isolation" / name / "transcripts" / "step_000001.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert (record["question"], tuple(record["golds"])) in own
        for row in rows(root / "isolation" / name):
            if "rollout/num" in row:  # each member's batch: its prompts x its group size, no one else's rollouts
                assert row["rollout/num"] == run.cfg.trainer.prompts_per_step * run.cfg.rollout.group_size


def test_a_population_resumes_per_member(root):
    """Two steps, then a resume to four (each member from its own newest checkpoint), equals four steps in one go,
    and each member's metrics.jsonl holds each step once."""
    folder = "resume"
    specs = MEMBERS[:2]
    straight = run_population(members(root, f"{folder}/straight", steps=4, specs=specs))
    first = run_population(members(root, f"{folder}/parts", steps=2, specs=specs))
    assert all(r.ok for r in straight.members + first.members)
    resumed = [
        Member(m.name, m.cfg, m.run_dir, resume=True) for m in members(root, f"{folder}/parts", steps=4, specs=specs)
    ]
    second = run_population(resumed)
    assert all(r.ok for r in second.members), [r.error for r in second.members]
    for result in second.members:
        assert result.summary["start_step"] == 2 and result.summary["steps"] == 4
    for name, *_ in specs:
        a, b = rows(root / folder / "straight" / name), rows(root / folder / "parts" / name)
        assert [r["step"] for r in b if "optim/grad_norm" in r] == [1, 2, 3, 4]
        assert [numbers(r) for r in a if "optim/grad_norm" in r] == [numbers(r) for r in b if "optim/grad_norm" in r]


def test_a_failing_member_is_dropped_and_the_others_finish(root):
    """A member whose model cannot load (as a refused warm start) fails at once; one whose update leaves
    non-finite weights is dropped at that step (its Adam state poisoned before its second update); the third
    trains to the end, with the numbers it has alone."""
    good, broken, poisoned = members(root, "failures", steps=3)
    (root / "not-a-model").mkdir(exist_ok=True)
    broken = Member(
        broken.name,
        load_config(LAB, [*overrides(root, 1, 1), f"model.init_from={root / 'not-a-model'}"]),
        broken.run_dir,
    )

    def pipeline(cfg, run_dir, *, resume, start_over, parts):
        def step(run):
            if run_dir.name == poisoned.name and run.step == 1:
                for state in run.learner.optimizer.state.values():
                    state["exp_avg_sq"].fill_(-1.0)  # sqrt of a negative second moment: NaN weights
            return rl_step(run)

        return train(cfg, run_dir, resume=resume, start_over=start_over, parts=parts, step=step)

    report = run_population([good, broken, poisoned], pipeline=pipeline)
    by_name = {r.name: r for r in report.members}
    assert by_name[good.name].ok and by_name[good.name].summary["steps"] == 3
    assert not by_name[broken.name].ok and by_name[broken.name].summary is None
    assert not by_name[poisoned.name].ok and "non-finite" in by_name[poisoned.name].error
    assert [r["step"] for r in rows(root / "failures" / poisoned.name) if "optim/grad_norm" in r] == [1]
    alone = run_population(members(root, "failures-alone", steps=3)[:1])
    assert alone.members[0].ok
    first = [
        next(r for r in rows(root / d / good.name) if "optim/grad_norm" in r) for d in ("failures", "failures-alone")
    ]
    assert first[0]["reward/mean"] == first[1]["reward/mean"]
    assert first[0]["optim/grad_norm"] == first[1]["optim/grad_norm"]


def test_the_command_line_trains_a_population_that_report_aggregate_reads(root, capsys):
    from stratarl.cli import main

    runs = []
    for name, seed, world, extra in [
        ("grpo-s0", 0, 0, ["algo.name=grpo"]),
        ("grpo-s1", 1, 1, ["algo.name=grpo"]),
        ("strat-s0", 0, 0, ["algo.name=stratified_grpo"]),
        ("strat-s1", 1, 1, ["algo.name=stratified_grpo"]),
    ]:
        runs.append(
            {
                "run_dir": str(root / "cli" / name),
                "config": str(LAB),
                "overrides": overrides(root, seed, world, steps=2) + extra,
            }
        )
    spec = root / "cli-spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    assert main(["population", str(spec), "--summary", str(root / "cli" / "population.json")]) == 0
    summary = json.loads((root / "cli" / "population.json").read_text())
    assert [m["ok"] for m in summary["members"]] == [True] * 4 and summary["exit_code"] == 0
    for run in runs:
        assert "step 2/2" in (Path(run["run_dir"]) / "train.log").read_text()
    out = root / "cli" / "aggregate" / "report.html"
    assert main(["report", "--aggregate", "--baseline", "grpo", "--out", str(out), *[r["run_dir"] for r in runs]]) == 0
    aggregate = json.loads((out.parent / "aggregate.json").read_text())
    assert "stratified_grpo" in json.dumps(aggregate) and "grpo" in json.dumps(aggregate)
