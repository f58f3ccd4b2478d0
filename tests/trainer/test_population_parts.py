"""The parts of a population (stratarl.trainer.population), each against what it replaces: the lockstep
scheduler, the stacked generation (each member's ``KVCacheGenerator.generate`` alone), the stacked update (each
member's ``update_policy`` alone), on real tiny word-level policies of the lab's architecture."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from stratarl.infra.lockstep import Lockstep
from stratarl.infra.stacked import StackedParams, causal_hidden, stack_reason
from stratarl.rollout.kv_cache_generator import KVCacheGenerator
from stratarl.trainer.config import load_config

LAB = Path(__file__).resolve().parents[2] / "configs" / "lab.yaml"
# Copies of a learner (deepcopy) make torch's scheduler believe optimizer.step was replaced.
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def lab_overrides(tmp_path, seed: int = 0, world: int = 0) -> list[str]:
    """configs/lab.yaml at test size: a random 32-wide word-level policy, a 120-passage world, no warm start."""
    return [
        "model.tiny_hidden_size=32",
        "model.tiny_intermediate_size=64",
        "model.tiny_num_heads=2",
        (
            "data.synthetic.options={size: 120, num_train: 30, num_test: 6, hop_mix: [0.3, 0.7, 0.0], guessable: none, "
            "name_pool: 300}"
        ),
        f"data.synthetic.seed={world}",
        "data.max_eval_examples=6",
        "eval.batch_size=6",
        "eval.before_after=false",
        "sft.enabled=false",
        "trainer.steps=2",
        "trainer.prompts_per_step=2",
        "trainer.eval_every=0",
        "trainer.save_every=0",
        "rollout.group_size=3",
        "rollout.max_tokens_per_turn=12",
        "logging.progress=false",
        "logging.num_transcripts=1",
        f"trainer.seed={seed}",
        f"data.synthetic.cache_dir={tmp_path / f'kb-w{world}'}",
        f"trainer.output_dir={tmp_path / 'runs'}",
        "algo.reward=stratarl_test_rewards:length_parity_reward",
    ]


# --------------------------------------------------------------------------- the lockstep scheduler


def test_lockstep_batches_calls_across_members_in_member_order():
    seen = []

    def double(batch):
        seen.append([i for i, _ in batch])
        return [x * 2 for _, x in batch]

    lockstep = Lockstep({"double": double})

    def body(k: int, calls: int):
        return [lockstep.call("double", k * 10 + c) for c in range(calls)]

    outcomes = lockstep.run([lambda: body(0, 2), lambda: body(1, 3), lambda: body(2, 1)])
    assert [o.value for o in outcomes] == [[0, 2], [20, 22, 24], [40]]
    assert seen == [[0, 1, 2], [0, 1], [1]]  # every waiting member in one call; members that ended leave
    assert lockstep.batches == [("double", 3), ("double", 2), ("double", 1)]


def test_lockstep_serves_kinds_in_priority_and_runs_one_member_at_a_time():
    log, running = [], []

    def handler(kind):
        def run(batch):
            log.append((kind, [i for i, _ in batch]))
            return [None] * len(batch)

        return run

    lockstep = Lockstep({"gen": handler("gen"), "upd": handler("upd")}, priority=("gen", "upd"))

    def body(turns: int):
        for _ in range(turns):
            running.append(lockstep.member)
            assert len(running) == 1  # nobody else runs meanwhile
            running.pop()
            lockstep.call("gen", None)
        lockstep.call("upd", None)

    lockstep.run([lambda: body(1), lambda: body(3)])
    # member 0 waits in the update while member 1 still generates: its generation is served first, and
    # both updates then run together.
    assert log == [("gen", [0, 1]), ("gen", [1]), ("gen", [1]), ("upd", [0, 1])]


def test_a_failing_member_is_reported_and_the_others_finish():
    def handler(batch):
        return [ValueError("bad payload") if payload == "bad" else payload for _, payload in batch]

    lockstep = Lockstep({"echo": handler})

    def raises():
        raise RuntimeError("warm start refused")

    outcomes = lockstep.run(
        [
            lambda: lockstep.call("echo", "ok"),
            raises,
            lambda: lockstep.call("echo", "bad"),
            lambda: [lockstep.call("echo", "a"), lockstep.call("echo", "b")],
        ]
    )
    assert outcomes[0].value == "ok" and outcomes[0].error is None
    assert isinstance(outcomes[1].error, RuntimeError) and "warm start refused" in outcomes[1].trace
    assert isinstance(outcomes[2].error, ValueError)
    assert outcomes[3].value == ["a", "b"]


def test_a_handler_that_raises_fails_only_its_batch():
    def broken(batch):
        raise KeyError("oops")

    lockstep = Lockstep({"broken": broken, "fine": lambda batch: [1] * len(batch)}, priority=("fine", "broken"))
    outcomes = lockstep.run([lambda: lockstep.call("broken", None), lambda: lockstep.call("fine", None)])
    assert isinstance(outcomes[0].error, RuntimeError) and "oops" in str(outcomes[0].error)
    assert outcomes[1].value == 1


# --------------------------------------------------------------------------- stacked forward passes


@pytest.fixture
def policies(tmp_path, reward_path):
    """Three word-level policies of one architecture with different weights, and their tokenizer and task."""
    from stratarl.trainer.setup import load_policy, load_task

    cfg = load_config(LAB, lab_overrides(tmp_path))
    task = load_task(cfg)
    models, tokenizer = [], None
    for seed in range(3):
        model, tokenizer = load_policy(cfg.model, seed=seed, task=task)
        models.append(model)
    return models, tokenizer, task, cfg


def test_the_lab_policy_can_be_stacked_and_its_stacked_forward_is_the_models(policies):
    models, tokenizer, _, _ = policies
    assert stack_reason(models[0]) is None
    ids = torch.randint(3, len(tokenizer), (3, 4, 17))
    stack = StackedParams(models)
    hidden = causal_hidden(stack, stack.fused(), ids)
    for k, model in enumerate(models):
        with torch.no_grad():
            ref = model.model(input_ids=ids[k]).last_hidden_state
        torch.testing.assert_close(hidden[k], ref, rtol=1e-5, atol=1e-5)


def test_stacked_generation_samples_what_each_generator_samples_alone(policies, monkeypatch):
    """Same tokens, finish reasons and log-probs (1e-5) per member, over two turns: the second reuses each
    member's prefix cache (as alone), rows of different members end at different steps, and a member's
    finished rows leave its batch (drop_finished)."""
    from stratarl.rollout.collect import encode_prompts
    from stratarl.rollout.generator import SamplingParams
    from stratarl.rollout.population_generate import GenerateCall, generate_together

    models, tokenizer, task, cfg = policies
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_strings=cfg.rollout.sampling_params().stop_strings)
    alone = [KVCacheGenerator(m, tokenizer, seed=5 + k) for k, m in enumerate(models)]
    together = [KVCacheGenerator(m, tokenizer, seed=5 + k) for k, m in enumerate(models)]
    prompts = [
        encode_prompts(tokenizer, task.train[k * 3 : k * 3 + n], template=cfg.rollout.prompt_template)
        for k, n in enumerate((3, 2, 3))
    ]
    prompts = [[p for p in ps for _ in range(2)] for ps in prompts]  # groups of 2: identical prompts
    budgets = [[12 - (i % 5) for i in range(len(ps))] for ps in prompts]
    for turn in range(2):
        keys = [[(k, i) for i in range(len(ps))] for k, ps in enumerate(prompts)]
        expected = [g.generate(prompts[k], params, budgets[k], cache_keys=keys[k]) for k, g in enumerate(alone)]
        got = generate_together(
            [GenerateCall(g, prompts[k], params, budgets[k], keys[k]) for k, g in enumerate(together)]
        )
        for k in range(3):
            assert not isinstance(got[k], BaseException), got[k]
            for a, b in zip(expected[k], got[k]):
                assert (a.token_ids, a.finish_reason, a.stop_string) == (b.token_ids, b.finish_reason, b.stop_string)
                torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-5, atol=1e-5)
            assert together[k].last_reused_tokens == alone[k].last_reused_tokens
            assert torch.equal(together[k].rng.get_state(), alone[k].rng.get_state())
        if turn == 1:
            assert all(g.last_reused_tokens > 0 for g in together)
        prompts = [[p + a.token_ids + p[:3] for p, a in zip(ps, expected[k])] for k, ps in enumerate(prompts)]


def _recorded_update_calls(tmp_path, arms: list[tuple[int, str, list[str]]]):
    """One real step of each (seed, algo, overrides) run, its update recorded (copies of the learner, the batch
    and the shuffle generator before the update) and then run alone: (calls, solo results, solo learners)."""
    from stratarl.trainer.population_update import UpdateCall
    from stratarl.trainer.run import RunParts, build_run
    from stratarl.trainer.step import rl_step
    from stratarl.trainer.update import update_policy

    calls, solo = [], []

    def recorder(learner, batch, settings, generator, **kw):
        calls.append(UpdateCall(copy.deepcopy(learner), batch, settings, copy.deepcopy(generator), kw.get("forward")))
        out = update_policy(learner, batch, settings, generator, **kw)
        solo.append((out, learner))
        return out

    for seed, algo, extra in arms:
        cfg = load_config(LAB, [*lab_overrides(tmp_path, seed), f"algo.name={algo}", *extra])
        run = build_run(cfg, tmp_path / f"run-{seed}-{algo}", parts=RunParts(update=recorder))
        rl_step(run)
    return calls, solo


@pytest.mark.parametrize(
    "arms",
    [
        [(0, "grpo", []), (1, "stratified_grpo", ["optim.lr=3e-4"]), (2, "ppo", [])],
        [
            (0, "so_grpo", ["trainer.epochs=2", "trainer.mini_batches=2", "optim.lr=0.01", "algo.sorl_delta=1e-8"]),
            (1, "grpo", ["trainer.epochs=2", "trainer.mini_batches=3", "optim.lr=0.01"]),
        ],
    ],
    ids=["on_policy_arms", "off_policy_sorl"],
)
def test_stacked_update_takes_each_members_solo_optimizer_steps(tmp_path, reward_path, arms):
    """Every metric (losses, clip fractions, SORL's C norm and scale, gradient norms, learning rates) and every
    weight after the update equal the member's own ``update_policy`` to float tolerance (weights: 1e-5 absolute,
    after up to six Adam steps at lr 0.01, where a near-zero gradient's m / sqrt(v) amplifies rounding); members
    with other numbers of optimizer steps and micro-batches share the stacked passes they have in common."""
    from stratarl.trainer.population_update import update_together

    calls, solo = _recorded_update_calls(tmp_path, arms)
    results = update_together(calls)
    for call, result, (expected, learner) in zip(calls, results, solo):
        assert not isinstance(result, BaseException), result
        assert set(result) == set(expected)
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, rel=2e-4, abs=1e-6), key
        for a, b in zip(call.learner.model.parameters(), learner.model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        if call.learner.value_head is not None:
            for a, b in zip(call.learner.value_head.parameters(), learner.value_head.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    if any(algo == "so_grpo" for _, algo, _ in arms):
        assert solo[0][0]["sorl/c_norm"] > 0  # the clip-bias gradient path ran


def test_stacked_update_keeps_gradients_in_their_member(tmp_path, reward_path):
    """A member's update does not depend on who it is stacked with: alone (a stack of one) or beside two
    others, the same weights to float tolerance."""
    from stratarl.trainer.population_update import update_together

    calls, _ = _recorded_update_calls(tmp_path, [(0, "grpo", []), (1, "grpo", []), (2, "grpo", [])])
    lone = [
        dataclasses.replace(
            calls[0], learner=copy.deepcopy(calls[0].learner), generator=copy.deepcopy(calls[0].generator)
        )
    ]
    update_together(lone)
    update_together(calls)
    for a, b in zip(lone[0].learner.model.parameters(), calls[0].learner.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
