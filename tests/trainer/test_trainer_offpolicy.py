"""Off-policy training on real steps (real tiny model, engine, BM25 and update): stale weights
(``trainer.policy_lag``), sampler numerics apart from the learner's (``rollout.precision``), and the
behaviour corrections (``algo.behaviour_correction``).

Each test fails when the off-policy machinery silently does something else: lag 0 not being today's loop,
behaviour log-probs that are not the snapshot's, a lag past its bound, a resume that loses the snapshots,
a correction that is skipped, or SORL's ratio not taken against the behaviour policy.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stratarl.config_errors import ConfigError
from stratarl.trainer.behaviour import fake_quantize_int8, lag_for_step
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
SMALL = ["trainer.prompts_per_step=3", "rollout.group_size=3", "algo.name=grpo"]


def _build(tmp_path, tiny_overrides, *overrides, name="run"):
    from stratarl.trainer.run import build_run

    cfg = load_config(TINY, [*tiny_overrides, *SMALL, *overrides])
    return build_run(cfg, tmp_path / name)


def _spy(run, monkeypatch=None):
    """Record every batch the update receives and every policy-loss call's keyword arguments; with ``monkeypatch``
    also each batch the step stamps with its weights version (``stamped``)."""
    record = {"batches": [], "loss_kwargs": [], "collected": [], "stamped": []}
    if monkeypatch is not None:
        from stratarl.trainer import step as step_module

        real_stamp = step_module.with_policy_version

        def stamp(collected, version):
            record["stamped"].append(real_stamp(collected, version))
            return record["stamped"][-1]

        monkeypatch.setattr(step_module, "with_policy_version", stamp)
    real_update, real_loss, real_collect = run.parts.update, run.learner.policy_loss, run.parts.collect

    def update(learner, batch, cfg, generator, **kwargs):
        record["batches"].append(copy.deepcopy(batch))
        return real_update(learner, batch, cfg, generator, **kwargs)

    def collect(*args, **kwargs):
        record["collected"].append(real_collect(*args, **kwargs))
        return record["collected"][-1]

    def policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        record["loss_kwargs"].append({**kwargs, "old_logprobs": old_logprobs.detach().clone()})
        return real_loss(logprobs, old_logprobs, advantages, mask, **kwargs)

    run.parts = dataclasses.replace(run.parts, update=update, collect=collect)
    run.learner.policy_loss = policy_loss
    return record


def _steps(run, n):
    from stratarl.trainer.step import rl_step

    out = []
    try:
        for _ in range(n):
            out.append(rl_step(run))
            run.step += 1
    finally:
        run.logger.close()
    return out


# --------------------------------------------------------------------------- lag 0 is today's loop


def _comparable(rows):
    return [{k: v for k, v in row.items() if not k.startswith(("time/", "perf/", "offpolicy/"))} for row in rows]


def _train(tmp_path, tiny_overrides, name, *overrides):
    from stratarl.trainer.rl import train

    cfg = load_config(TINY, [*tiny_overrides, *SMALL, "trainer.steps=3", *overrides])
    train(cfg, tmp_path / name)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    weights = load_file(next((tmp_path / name / "checkpoints").glob("step_*/model.safetensors")))
    return rows, weights


def test_lag_zero_builds_no_sampler_copy(tmp_path, tiny_overrides):
    run = _build(tmp_path, tiny_overrides, "trainer.policy_lag=0")
    run.logger.close()
    assert run.behaviour is None
    assert run.generator.model is run.model  # the learner samples, as it always did


def test_a_sampler_copy_at_lag_zero_trains_bit_for_bit_as_the_learner_sampling(tmp_path, tiny_overrides):
    """The off-policy machinery with nothing off-policy in it (a fp32 copy of an fp32 learner, loaded with the live
    weights every step) changes no metric and no weight: every difference a lag makes is the lag's."""
    rows_today, weights_today = _train(tmp_path, tiny_overrides, "today")
    rows_copy, weights_copy = _train(tmp_path, tiny_overrides, "copy", "rollout.precision=fp32")
    assert _comparable(rows_today) == _comparable(rows_copy)
    assert weights_today.keys() == weights_copy.keys()
    for key in weights_today:
        assert torch.equal(weights_today[key], weights_copy[key]), key
    assert all(row.get("offpolicy/lag") == 0.0 for row in rows_copy if "reward/mean" in row)
    # Both measure the same tiny kernel-rounding mismatch (the learner's log-probs are recomputed anyway here).
    assert all(row["offpolicy/mismatch"] < 1e-4 for row in rows_today if "offpolicy/mismatch" in row)


# --------------------------------------------------------------------------- stale weights


def test_lag_for_step_is_bounded_seeded_and_varied():
    for step in range(40):
        assert lag_for_step(3, "fixed", 0, step) == min(3, step)
        drawn = lag_for_step(3, "uniform", 5, step)
        assert 0 <= drawn <= min(3, step)
        assert drawn == lag_for_step(3, "uniform", 5, step)  # a resumed run draws the same lag
    assert len({lag_for_step(3, "uniform", 5, s) for s in range(3, 40)}) == 4
    assert lag_for_step(0, "uniform", 5, 10) == 0
    with pytest.raises(ValueError, match="policy_lag_mode"):
        lag_for_step(2, "sometimes", 0, 5)


def test_behaviour_logprobs_are_a_fresh_forward_of_the_snapshot_and_not_the_learners(
    tmp_path, tiny_overrides, monkeypatch
):
    from stratarl.trainer.logprobs import response_logprobs

    run = _build(
        tmp_path, tiny_overrides, "trainer.policy_lag=2", "trainer.epochs=1", "trainer.mini_batches=1", "optim.lr=0.02"
    )
    initial = copy.deepcopy(run.model).eval()
    record = _spy(run, monkeypatch)
    metrics = _steps(run, 3)
    assert [m["offpolicy/lag"] for m in metrics] == [0.0, 1.0, 2.0]
    assert [m["offpolicy/policy_version"] for m in metrics] == [0.0, 0.0, 0.0]
    batch = record["batches"][2]  # step 2 sampled with version 0: the initial weights
    assert all(r.policy_version == 0 for r in record["stamped"][2].rollouts)
    with torch.no_grad():
        fresh = response_logprobs(
            initial, batch.input_ids, batch.attention_mask, batch.prompt_lengths, batch.response_mask
        )["logprobs"]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.behaviour_logprobs[mask], fresh[mask], rtol=1e-4, atol=1e-4)
    # The learner has taken two updates since: its log-probs are not the sampler's.
    gap = (batch.learner_logprobs - batch.behaviour_logprobs)[mask].abs()
    assert float(gap.max()) > 1e-2
    assert metrics[2]["offpolicy/mismatch"] == pytest.approx(float(gap.mean()), rel=1e-4)


def test_the_lag_bound_holds_on_every_batch(tmp_path, tiny_overrides, monkeypatch):
    run = _build(
        tmp_path,
        tiny_overrides,
        "trainer.policy_lag=2",
        "trainer.policy_lag_mode=uniform",
        "trainer.epochs=1",
        "trainer.mini_batches=1",
        "trainer.prompts_per_step=2",
        "rollout.group_size=2",
    )
    record = _spy(run, monkeypatch)
    metrics = _steps(run, 7)
    lags = [m["offpolicy/lag"] for m in metrics]
    for step, (m, collected, stamped) in enumerate(zip(metrics, record["collected"], record["stamped"])):
        assert 0 <= m["offpolicy/lag"] <= min(2, step)
        assert m["offpolicy/policy_version"] == step - m["offpolicy/lag"]
        assert {r.policy_version for r in stamped.rollouts} == {step - int(m["offpolicy/lag"])}
        assert {r.policy_version for r in collected.rollouts} == {0}  # the collected batch itself is not changed
    assert len(set(lags[2:])) > 1  # uniform really draws
    assert len(run.behaviour.snapshots.weights) <= 3  # k + 1 versions at most


def test_resume_with_a_lag_is_exact(tmp_path, tiny_overrides):
    """4 straight steps at lag 2 end where 2 steps + resume + 2 steps end: the snapshots are in the
    checkpoint. Without them the resumed steps would sample with other weights."""
    from stratarl.trainer.rl import train

    common = [*tiny_overrides, *SMALL, "trainer.policy_lag=2", "optim.lr=0.02", "trainer.save_every=1"]
    train(load_config(TINY, [*common, "trainer.steps=4"]), tmp_path / "straight")
    train(load_config(TINY, [*common, "trainer.steps=2"]), tmp_path / "half")
    train(load_config(TINY, [*common, "trainer.steps=4"]), tmp_path / "half", resume=True)
    from safetensors.torch import load_file

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "perf/"))} for x in lines]

    assert rows("straight") == rows("half")
    a = load_file(tmp_path / "straight" / "checkpoints" / "step_000004" / "model.safetensors")
    b = load_file(tmp_path / "half" / "checkpoints" / "step_000004" / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    state = torch.load(tmp_path / "half" / "checkpoints" / "step_000004" / "state.pt", weights_only=True)
    assert state["behaviour"]["versions"] == [1, 2, 3]  # what steps 4 and 5 may sample with (k + 1 at most)


# --------------------------------------------------------------------------- sampler numerics


def test_fake_quantize_int8_hand_derived():
    # Row 0: max |w| = 1.27, s = 0.01: 0.123 -> round(12.3) = 12 -> 0.12; -1.27 -> -127 -> -1.27.
    # Row 1: all zero stays zero.  Row 2: s = 2/127: 1 -> round(63.5) = 64 (half to even) -> 64 * 2/127.
    w = torch.tensor([[0.123, -1.27, 0.004], [0.0, 0.0, 0.0], [1.0, 2.0, -2.0]], dtype=torch.float64)
    q = fake_quantize_int8(w)
    torch.testing.assert_close(q[0], torch.tensor([0.12, -1.27, 0.0], dtype=torch.float64))
    assert torch.equal(q[1], torch.zeros(3, dtype=torch.float64))
    torch.testing.assert_close(q[2], torch.tensor([64, 127, -127], dtype=torch.float64) * 2 / 127)
    assert fake_quantize_int8(q).equal(q)  # idempotent: already on the grid
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize_int8(torch.ones(3))


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_sampler_numerics_make_a_mismatch_the_fp32_sampler_does_not(precision, tmp_path, tiny_overrides):
    """At lag 0 the fp32 copy's log-probs are the learner's up to kernel rounding; int8 weights and bf16
    matmuls move them by far more. The int8 sampler's weights lie on the per-channel grid."""
    found = {}
    for p in ("fp32", precision):
        run = _build(
            tmp_path, tiny_overrides, f"rollout.precision={p}", "trainer.epochs=1", "trainer.mini_batches=1", name=p
        )
        found[p] = _steps(run, 1)[0]
        if p == "int8":
            weight = run.behaviour.sampler.model.layers[0].mlp.up_proj.weight
            assert torch.equal(weight, fake_quantize_int8(weight))
            assert not torch.equal(weight, run.model.model.layers[0].mlp.up_proj.weight)
    assert found["fp32"]["offpolicy/mismatch"] < 1e-4
    assert found[precision]["offpolicy/mismatch"] > 10 * max(found["fp32"]["offpolicy/mismatch"], 1e-6)
    assert found[precision]["offpolicy/mismatch_turn1"] > 0
    assert found[precision]["offpolicy/ratio_p99"] > found["fp32"]["offpolicy/ratio_p99"]


# --------------------------------------------------------------------------- corrections and SORL


@pytest.mark.parametrize("name", ["tis", "mis", "decoupled"])
def test_the_correction_weights_reach_the_loss(name, tmp_path, tiny_overrides):
    """The loss receives exactly the registered correction's weights of (pi_old, pi_behav = the sampler's
    log-probs of the batch); a run that silently skipped the correction would pass no token_weights, and its
    update would be the uncorrected one."""
    from stratarl.algos.registry import get_behaviour_correction

    common = ["rollout.precision=int8", "trainer.epochs=1", "trainer.mini_batches=1"]
    weights = {}
    for correction in ("none", name):
        extra = [f"algo.behaviour_correction={correction}"]
        if correction != "none":
            extra.append("algo.behaviour_correction_params.cap=1.001")
        run = _build(tmp_path, tiny_overrides, *common, *extra, name=correction)
        record = _spy(run)
        calls = []
        if run.learner.correction is not None:
            real = run.learner.correction

            def spied(old, behaviour, mask, real=real):
                out = real(old, behaviour, mask)
                calls.append((old, behaviour, mask, out.weights))
                return out

            run.learner.correction = spied
        metrics = _steps(run, 1)[0]
        weights[correction] = [p.detach().clone() for p in run.model.parameters()]
        if correction == "none":
            assert run.learner.correction is None and not calls
            assert all("token_weights" not in kw for kw in record["loss_kwargs"])
            continue
        assert len(calls) == len(record["loss_kwargs"]) > 0
        for (old, behaviour, mask, out), kwargs in zip(calls, record["loss_kwargs"]):
            assert kwargs["token_weights"] is out
            assert torch.equal(old, kwargs["old_logprobs"])
            expected = get_behaviour_correction(name)(old, behaviour, mask, cap=1.001).weights
            assert torch.equal(out, expected)
        batch = record["batches"][0]
        seen = torch.cat([b[m.bool()] for _, b, m, _ in calls]).sort().values
        assert torch.equal(seen, batch.behaviour_logprobs[batch.response_mask.bool()].sort().values)
        assert "offpolicy/is_weight_mean" in metrics
        # int8 sampling moves some ratios past 1.001: the weights are not all 1, so the correction acts.
        assert any(float((w - 1)[m.bool()].abs().max()) > 0 for _, _, m, w in calls)
    assert any(not torch.equal(a, b) for a, b in zip(weights["none"], weights[name]))


@pytest.mark.parametrize(
    "steps", [["trainer.epochs=2", "trainer.mini_batches=1"], ["trainer.epochs=1", "trainer.mini_batches=2"]]
)
def test_with_several_optimizer_steps_the_correction_reads_the_recomputed_pi_old(steps, tmp_path, tiny_overrides):
    """With more than one optimizer step per batch, pi_theta moves away from pi_old after the first step: the
    correction's first argument must stay the batch's recomputed pi_old (each row one of ScoredBatch.old_logprobs'),
    never the current policy's log-probs. With one step per batch the two are equal, so only this test tells a
    correction fed pi_theta from one fed pi_old."""
    run = _build(
        tmp_path,
        tiny_overrides,
        "rollout.precision=int8",
        "algo.behaviour_correction=tis",
        "algo.behaviour_correction_params.cap=1.001",
        "optim.lr=0.05",
        *steps,
    )
    record = _spy(run)
    current = []
    real_loss = run.learner.policy_loss

    def policy_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        current.append(logprobs.detach().clone())
        return real_loss(logprobs, old_logprobs, advantages, mask, **kwargs)

    run.learner.policy_loss = policy_loss
    calls = []
    real = run.learner.correction

    def spied(old, behaviour, mask):
        calls.append((old.clone(), mask.bool()))
        return real(old, behaviour, mask)

    run.learner.correction = spied
    metrics = _steps(run, 1)[0]
    assert metrics["optim/steps"] == 2.0
    batch = record["batches"][0]

    def rows(logprobs, mask):
        return {tuple(logprobs[i][mask[i]].tolist()) for i in range(logprobs.shape[0])}

    pi_old = rows(batch.old_logprobs, batch.response_mask.bool())
    assert len(calls) == len(current) >= 2
    for old, mask in calls:
        assert rows(old, mask) <= pi_old  # every row the correction saw is a row of the recomputed pi_old
    # ... and after the first optimizer step pi_theta is not pi_old: a correction fed pi_theta would fail above
    moved = [float((theta - old)[mask].abs().max()) for (old, mask), theta in zip(calls[1:], current[1:]) if mask.any()]
    assert moved and max(moved) > 1e-4


def test_sorl_against_the_behaviour_policy_uses_the_samplers_logprobs(tmp_path, tiny_overrides):
    run = _build(
        tmp_path,
        tiny_overrides,
        "algo.name=so_grpo",
        "algo.old_logprobs=rollout",
        "trainer.policy_lag=1",
        "trainer.epochs=1",
        "trainer.mini_batches=1",
        "optim.lr=0.02",
    )
    record = _spy(run)
    metrics = _steps(run, 2)
    batch = record["batches"][1]
    assert metrics[1]["offpolicy/lag"] == 1.0
    assert torch.equal(batch.old_logprobs, batch.behaviour_logprobs)  # the clip is centred on pi_behav
    mask = batch.response_mask.bool()
    assert float((batch.learner_logprobs - batch.behaviour_logprobs)[mask].abs().max()) > 1e-3
    assert batch.on_policy is False  # not the on-policy shortcut: the ratio is pi_theta / pi_behav
    assert metrics[1]["loss/ratio_max"] != 1.0


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.policy_lag=-1"], "trainer.policy_lag"),
        (["trainer.policy_lag_mode=sometimes"], "trainer.policy_lag_mode"),
        (["rollout.precision=fp8"], "rollout.precision"),
        (["algo.behaviour_correction=tiss"], "did you mean 'tis'"),
        (["algo.behaviour_correction=tis", "algo.old_logprobs=rollout"], "old_logprobs=recompute"),
        (["algo.behaviour_correction_params.cap=2"], "no behaviour correction is in use"),
        (["algo.behaviour_correction=tis", "algo.behaviour_correction_params.caps=2"], "valid parameters"),
        (["algo.policy_loss_params.token_weights=1"], "algo.behaviour_correction"),
    ],
)
def test_bad_off_policy_settings_are_refused_in_one_line(overrides, message, tiny_overrides):
    with pytest.raises(ConfigError, match=message) as error:
        load_config(TINY, [*tiny_overrides, *overrides])
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- command line and report


@pytest.mark.slow
def test_off_policy_run_and_its_report_from_the_command_line(tmp_path, tiny_overrides, reward_path):
    """`stratarl train` with a lag, an int8 sampler and TIS, then `stratarl report`: the run logs the regime and
    the page shows it (the lag histogram: step 1 at lag 0, step 2 at lag 1)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_path), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stratarl.cli",
            "train",
            str(TINY),
            *tiny_overrides,
            "trainer.policy_lag=1",
            "rollout.precision=int8",
            "algo.behaviour_correction=tis",
            "--run-dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "behaviour correction tis (cap=2.0, level=token)" in out.stdout
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["offpolicy/lag"] for r in steps] == [0.0, 1.0]
    assert all("offpolicy/mismatch_turn1" in r and "offpolicy/is_weight_mean" in r for r in steps)
    page_path = tmp_path / "report.html"
    out = subprocess.run(
        [sys.executable, "-m", "stratarl.cli", "report", str(run_dir), "--out", str(page_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    page = page_path.read_text()
    assert "Off-policy regime" in page and "<td>0: 1, 1: 1</td>" in page
    assert (tmp_path / "offpolicy.png").is_file()
