"""The trainer's wiring, pinned on real steps (real tiny model, real engine and BM25, real update).

Each test fails when one algorithm ingredient is silently swapped: the estimator a preset uses, a knob
that should change the update (alpha, delta), the behaviour log-probs of the first optimizer step (ratios
exactly 1 at any sampling temperature, with either old-log-prob source), the masking of observation tokens,
and where SORL's factor is applied. Spies record what the real functions receive and call them unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from stratarl.algos.advantages import (
    broadcast_to_tokens,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    stratified_advantages,
)
from stratarl.trainer.config import load_config
from stratarl.trainer.settings import UpdateSettings

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

STRATA_MODULE = '''
def token_sum_mod3(rollout):
    """A stratum key that varies inside groups (the random tiny model rarely searches)."""
    return sum(rollout.response_ids) % 3
'''


@pytest.fixture
def strata_key(reward_path):
    (reward_path / "stratarl_test_strata.py").write_text(STRATA_MODULE)
    return "stratarl_test_strata:token_sum_mod3"


@pytest.fixture
def spy():
    """Records the collected rollouts, the batch the update receives (and its prefix), every policy-loss call,
    and the optimizer steps between them; ``spy["install"](run)`` injects the recorders into a built run."""
    record = {"collected": None, "batch": None, "loss_calls": []}

    def install(run):
        real_collect, real_update, real_loss = run.parts.collect, run.parts.update, run.learner.policy_loss
        name = run.settings.algorithm.policy_loss

        def collect(*args, **kwargs):
            record["collected"] = real_collect(*args, **kwargs)
            return record["collected"]

        def update_policy(learner, batch, settings, generator, **kwargs):
            record["batch"], record["prefix"] = copy.deepcopy(batch), kwargs["forward"].prefix
            record["optimizer_steps"] = 0

            def counted(*_):
                record["optimizer_steps"] += 1

            handle = learner.optimizer.register_step_post_hook(counted)
            try:
                return real_update(learner, batch, settings, generator, **kwargs)
            finally:
                handle.remove()

        def policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
            record["loss_calls"].append(
                {
                    "name": name,
                    "level": kwargs.get("level"),
                    "after_steps": record.get("optimizer_steps", 0),
                    "log_ratio": (logprobs - old_logprobs).detach() * mask,
                    "mask": mask.clone(),
                }
            )
            return real_loss(logprobs, old_logprobs, advantages, mask, **kwargs)

        run.parts = dataclasses.replace(run.parts, collect=collect, update=update_policy)
        run.learner.policy_loss = policy_loss

    record["install"] = install
    return record


def _step(tmp_path, tiny_overrides, *overrides, name="run", spy=None):
    """One real RL step of the tiny config (with ``spy``'s recorders injected); returns (run, metrics)."""
    from stratarl.trainer.run import build_run
    from stratarl.trainer.step import rl_step

    cfg = load_config(TINY, [*tiny_overrides, "trainer.prompts_per_step=4", "rollout.group_size=4", *overrides])
    run = build_run(cfg, tmp_path / name)
    if spy is not None:
        spy["install"](run)
    try:
        return run, rl_step(run)
    finally:
        run.logger.close()


def _inputs(record):
    c = record["collected"]
    return (torch.tensor(c.rewards, dtype=torch.float32), torch.tensor(c.group_ids), record["batch"].response_mask)


# --------------------------------------------------------------------------- the estimator of each preset


def _expected_advantages(name, record, cfg_alpha=0.6, strata=None):
    rewards, groups, mask = _inputs(record)
    if name in ("grpo", "so_grpo"):
        return broadcast_to_tokens(grpo_advantages(rewards, groups, eps=1e-6), mask)
    if name == "stratified_grpo":
        return broadcast_to_tokens(
            stratified_advantages(rewards, groups, torch.tensor(strata), alpha=cfg_alpha, eps=1e-6), mask
        )
    advantages, _ = gae_advantages(
        outcome_to_token_rewards(rewards, mask), record["batch"].old_values, mask, gamma=1.0, lam=1.0
    )
    return advantages


@pytest.mark.parametrize("name", ["grpo", "stratified_grpo", "ppo", "so_ppo", "so_grpo"])
def test_the_update_uses_the_presets_own_estimator(name, tmp_path, tiny_overrides, strata_key, spy):
    _, metrics = _step(tmp_path, tiny_overrides, f"algo.name={name}", f"algo.stratum_key={strata_key}", spy=spy)
    strata = spy["collected"].strata
    used = spy["batch"].advantages
    expected = _expected_advantages(name, spy, strata=strata)
    torch.testing.assert_close(used, expected, rtol=1e-5, atol=1e-6)
    if name in ("grpo", "stratified_grpo", "so_grpo"):
        # The batch distinguishes the group estimators: GRPO's and Stratified GRPO's advantages differ on it.
        other = "grpo" if name == "stratified_grpo" else "stratified_grpo"
        assert not torch.allclose(used, _expected_advantages(other, spy, strata=strata), atol=1e-4)
    assert metrics["reward/flat_group_frac"] < 1.0  # real signal: some group has varied rewards


# --------------------------------------------------------------------------- knobs


def test_alpha_changes_the_update_exactly_when_strata_differ(tmp_path, tiny_overrides, strata_key, reward_path, spy):
    (reward_path / "stratarl_test_one_stratum.py").write_text("def same(rollout):\n    return 0\n")
    advantages = {}
    for key in (strata_key, "stratarl_test_one_stratum:same"):
        for alpha in (0.2, 0.9):
            _step(
                tmp_path,
                tiny_overrides,
                "algo.name=stratified_grpo",
                f"algo.alpha={alpha}",
                f"algo.stratum_key={key}",
                name=f"{key.split(':')[1]}-{alpha}",
                spy=spy,
            )
            advantages[key, alpha] = spy["batch"].advantages
    assert not torch.allclose(advantages[strata_key, 0.2], advantages[strata_key, 0.9], atol=1e-4)
    torch.testing.assert_close(
        advantages["stratarl_test_one_stratum:same", 0.2], advantages["stratarl_test_one_stratum:same", 0.9]
    )


def _params(run):
    return [p.detach().clone() for p in run.model.parameters()]


def test_delta_changes_the_update_exactly_when_the_clip_bias_norm_exceeds_it(tmp_path, tiny_overrides):
    """SO-GRPO at 4 optimizer steps per batch with SGD (no gradient clipping), against the same arm without the
    normalisation at lr / delta: while every ||C|| <= delta the factor is the constant 1 / delta, so the two take
    the same steps; with a delta below some ||C|| they do not."""
    common = [
        "trainer.epochs=2",
        "trainer.mini_batches=2",
        "optim.name=sgd",
        "optim.grad_clip=0",
        "optim.warmup_steps=0",
        "algo.kl_coef=0",
        "algo.clip_low=0.01",
        "algo.clip_high=0.01",
    ]
    lr = 0.5
    for delta, same in ((1e3, True), (1e-9, False)):
        runs = {}
        for normalise in (True, False):
            run, metrics = _step(
                tmp_path,
                tiny_overrides,
                *common,
                "algo.name=so_grpo",
                f"algo.normalizer={'sorl' if normalise else 'none'}",
                f"algo.sorl_delta={delta}",
                f"optim.lr={lr * delta if normalise else lr}",
                name=f"d{delta}-{normalise}",
            )
            runs[normalise] = (_params(run), metrics)
        metrics = runs[True][1]
        assert metrics["sorl/c_norm"] > 1e-7, "no clipping bias in the off-policy steps: deltas cannot be told apart"
        if same:
            assert metrics["sorl/engaged"] == 0.0
            for a, b in zip(runs[True][0], runs[False][0]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            assert metrics["sorl/engaged"] > 0.0
            assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(runs[True][0], runs[False][0]))


# --------------------------------------------------------------------------- on-policy first step


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
@pytest.mark.parametrize("source", ["rollout", "recompute"])
def test_first_optimizer_step_ratios_are_one(temperature, source, tmp_path, tiny_overrides, spy):
    _step(
        tmp_path,
        tiny_overrides,
        "algo.name=grpo",
        f"rollout.temperature={temperature}",
        f"algo.old_logprobs={source}",
        "trainer.epochs=1",
        "trainer.mini_batches=2",
        spy=spy,
    )
    first = [c for c in spy["loss_calls"] if c["after_steps"] == 0]
    later = [c for c in spy["loss_calls"] if c["after_steps"] > 0]
    assert first and later
    for call in first:
        assert call["mask"].sum() > 0
        assert float(call["log_ratio"].abs().max()) < 1e-4, "first optimizer step is off-policy"
    # After a step the ratios move: the spy sees real ratios (so the assertion above could fail).
    assert max(float(c["log_ratio"].abs().max()) for c in later) > 1e-6


# --------------------------------------------------------------------------- observation tokens


def test_observation_positions_never_move_the_gradient(tiny_model):
    """Whatever the batch holds at observation positions (response_mask 0: advantages, behaviour and reference
    log-probs, values, returns), the accumulated gradient is the same, for every preset."""
    from stratarl.trainer.batch import collate_sequences
    from stratarl.trainer.learner import build_learner
    from stratarl.trainer.update import accumulate_gradients, score_batch

    for name in ("grpo", "stratified_grpo", "ppo", "so_ppo", "so_grpo"):
        cfg = load_config(
            None, ["model.name=tiny-random", f"algo.name={name}", "algo.kl_coef=0.01", "trainer.logprob_chunk_tokens=7"]
        )
        grads = []
        for poison in (0.0, 1.0):
            model = copy.deepcopy(tiny_model)
            learner = build_learner(model, cfg, total_optimizer_steps=1)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(3, 500, (4,), generator=g).tolist() for _ in range(4)]
            responses = [torch.randint(3, 500, (8,), generator=g).tolist() for _ in range(4)]
            masks = [[1, 1, 1, 0, 0, 1, 1, 1]] * 4  # an observation block between two turns
            tokens = collate_sequences(prompts, responses, masks, pad_id=0)
            advantages = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * tokens.response_mask
            batch = score_batch(learner, tokens, UpdateSettings.from_config(cfg)).with_advantages(
                advantages, advantages.clone()
            )
            obs = (batch.response_mask == 0).float()
            obs[:, 8:] = 0.0
            assert obs.sum() == 8
            batch = dataclasses.replace(
                batch,
                advantages=batch.advantages + poison * 50.0 * obs,
                returns=batch.returns - poison * 9.0 * obs,
                # off-policy (clipping engages), and poisoned at the observation positions
                old_logprobs=batch.old_logprobs - 0.3 * batch.response_mask + poison * 3.0 * obs,
                ref_logprobs=batch.ref_logprobs - poison * 3.0 * obs,
                old_values=None if batch.old_values is None else batch.old_values + poison * 7.0 * obs,
            )
            accumulate_gradients(learner, batch, UpdateSettings.from_config(cfg))
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        assert grads[0]
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, msg=f"{name}: observation positions changed the gradient")


# --------------------------------------------------------------------------- which presets normalise


@pytest.mark.parametrize(
    "name, normalises, turn_level",
    [
        ("grpo", False, False),
        ("stratified_grpo", False, False),
        ("ppo", False, False),
        ("so_ppo", True, True),
        ("so_grpo", True, True),
    ],
)
def test_sorl_parts_of_each_preset_in_a_real_step(name, normalises, turn_level, tmp_path, tiny_overrides, spy):
    run, metrics = _step(tmp_path, tiny_overrides, f"algo.name={name}", spy=spy)
    assert (run.learner.normalizer is not None) is normalises
    assert ("sorl/scale" in metrics) is normalises
    assert {(c["name"], c["level"]) for c in spy["loss_calls"]} == {("ppo", "turn" if turn_level else "token")}
    assert ("loss/clip_frac_turn" in metrics) is turn_level
    assert (run.learner.value_head is not None) is (name in ("ppo", "so_ppo"))


# --------------------------------------------------------------------------- groups are prompts


def test_grpo_normalises_each_prompts_rollouts_as_one_group(tmp_path, tiny_overrides, spy):
    """Groups come from the prompts themselves, not from the trainer's own group ids: rollouts that share a
    prompt form one group of G, and the advantages are GRPO's over those groups. Fails if a step's rollouts
    are normalised as one group, or if rollouts of different prompts share a group id."""
    _step(tmp_path, tiny_overrides, "algo.name=grpo", spy=spy)
    collected, batch = spy["collected"], spy["batch"]
    prompts = [tuple(r.prompt_ids) for r in collected.rollouts]
    assert len(set(prompts)) == 4 and all(prompts.count(p) == 4 for p in prompts)
    by_prompt = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    groups = torch.tensor([by_prompt[p] for p in prompts])
    ids = collected.group_ids
    assert all((ids[i] == ids[j]) == (prompts[i] == prompts[j]) for i in range(16) for j in range(16))
    rewards = torch.tensor(collected.rewards, dtype=torch.float32)
    expected = broadcast_to_tokens(grpo_advantages(rewards, groups, eps=1e-6), batch.response_mask)
    torch.testing.assert_close(batch.advantages, expected, rtol=1e-5, atol=1e-6)
    one_group = broadcast_to_tokens(grpo_advantages(rewards, torch.zeros_like(groups), eps=1e-6), batch.response_mask)
    assert not torch.allclose(one_group, expected, atol=1e-4)  # the batch tells the two apart


# --------------------------------------------------------------------------- held-out eval is greedy


def test_held_out_eval_decodes_greedily(tmp_path, tiny_overrides):
    """`stratarl train`'s held-out eval at temperature 1: every first turn equals the argmax continuation of
    its prompt under the same model, computed independently with HF `generate(do_sample=False)`. A sampled
    turn of a random model over a 49k vocabulary leaves the argmax path at once, so sampling fails this."""
    import json

    from stratarl.rollout.prompt import encode_prompt
    from stratarl.trainer.rl import train
    from stratarl.trainer.setup import load_policy, load_task

    cfg = load_config(
        TINY,
        [
            *tiny_overrides,
            "trainer.steps=1",
            "eval.before_after=true",
            "eval.num_transcripts=4",
            "data.max_eval_examples=4",
            "rollout.temperature=1.0",
        ],
    )
    run_dir = tmp_path / "run"
    train(cfg, run_dir)
    records = [json.loads(line) for line in (run_dir / "eval" / "before_transcripts.jsonl").read_text().splitlines()]
    assert len(records) == 4
    task = load_task(cfg)
    model, tokenizer = load_policy(cfg.model, seed=cfg.trainer.seed, device="cpu", task=task)
    questions = {e.id: e for e in task.test}
    for record in records:
        example = questions[record["example_id"]]
        prompt = torch.tensor([encode_prompt(tokenizer, example.question, cfg.rollout.prompt_template)])
        with torch.no_grad():
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=cfg.rollout.max_tokens_per_turn,
                pad_token_id=tokenizer.pad_token_id,
            )
        argmax_text = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=False)
        first_turn = record["turns"][0]["text"]
        assert first_turn and argmax_text.startswith(first_turn), (first_turn, argmax_text)


# --------------------------------------------------------------------------- the frozen prefix from the rollouts


def test_the_step_takes_the_frozen_prefix_from_its_rollouts(tmp_path, tiny_overrides, spy):
    """With frozen lower layers, the update's prefix is the one the generator captured (no second pass over
    the frozen layers), and it equals what ``frozen_prefix`` computes for the same batch."""
    from stratarl.trainer.prefix import frozen_prefix

    run, metrics = _step(tmp_path, tiny_overrides, "algo.name=grpo", "model.trainable_layers=1", spy=spy)
    prefix, batch = spy["prefix"], spy["batch"]
    assert metrics["perf/prefix_from_rollouts"] == 1.0 and prefix.source == "rollouts"
    computed = frozen_prefix(run.model, batch.input_ids, batch.attention_mask, batch.prompt_lengths)
    valid = computed.prompt_valid[..., None]
    torch.testing.assert_close(prefix.prompt_hidden * valid, computed.prompt_hidden * valid, atol=1e-4, rtol=1e-4)
    used = (torch.arange(computed.response_hidden.shape[1])[None] < (computed.response_lengths - 1)[:, None])[..., None]
    torch.testing.assert_close(prefix.response_hidden * used, computed.response_hidden * used, atol=1e-4, rtol=1e-4)


def test_the_step_computes_the_prefix_when_the_generator_cannot_capture(tmp_path, tiny_overrides):
    _, metrics = _step(
        tmp_path, tiny_overrides, "algo.name=grpo", "model.trainable_layers=1", "rollout.backend=kv_cache_generic"
    )
    assert metrics["perf/prefix_from_rollouts"] == 0.0
