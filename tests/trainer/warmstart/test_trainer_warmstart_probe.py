"""The warm start's reading probe: it ends the warm start when greedy single-hop EM on an unseen world
passes the threshold, extends it otherwise, and fails loudly (caching nothing) when it never passes.
Also the progress display that warm starts and RL runs print off a terminal."""

from __future__ import annotations

import io
import json

import pytest
from warmstart_lab import lab_sections

from stratarl.infra.progress import LineProgress, format_duration
from stratarl.trainer.config import ConfigError, config_from_dict
from stratarl.trainer.warmstart.probe import PROBE_WORLD_OFFSET, WarmStartFailed, probe_questions
from stratarl.trainer.warmstart.settings import WarmStartSettings
from stratarl.trainer.warmstart.worlds import READING_WORLD_OFFSET, world_seed

# The probe's variant of the lab: shorter turns, two SFT steps, a probe after each.
LAB = lab_sections(
    rollout={"max_tokens_per_turn": 16},
    sft={"steps": 2, "probe_every": 1, "probe_questions": 4},
    eval={"batch_size": 8},
)


def _cfg(**sft):
    data = json.loads(json.dumps(LAB))
    data["sft"].update(sft)
    return config_from_dict(data)


def _probe_rows(folder):
    rows = [json.loads(line) for line in (folder / "sft_metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "probe/single_hop_em" in r], [r for r in rows if "sft/loss" in r]


def test_a_passing_probe_ends_the_warm_start_at_its_steps(tmp_path):
    from stratarl.trainer.warmstart.stages import warm_start

    summary = warm_start(_cfg(probe_min_em=0.0, max_steps=5), tmp_path, progress=False)
    assert summary["steps"] == 2 and summary["probe_passed"] is True
    assert [p["step"] for p in summary["probes"]] == [2]
    probes, steps = _probe_rows(tmp_path)
    assert [r["step"] for r in probes] == [2] and len(steps) == 2
    assert probes[0]["probe/single_hop_em"] == summary["probes"][0]["single_hop_em"]
    assert (tmp_path / "model" / "config.json").is_file()


def test_a_failing_probe_extends_the_warm_start_then_fails_loudly(tmp_path, monkeypatch):
    from stratarl.trainer.warmstart.stages import cached_warm_start, warm_start_cache_dir

    monkeypatch.setenv("STRATARL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(probe_min_em=1.01 - 0.01, max_steps=4, cache=True)  # EM 1.0 on unseen names: never, untrained
    with pytest.raises(WarmStartFailed) as error:
        cached_warm_start(cfg, progress=False)
    message = str(error.value)
    assert "\n" not in message and "sft.probe_min_em=1" in message and "after 4 steps" in message
    assert "sft.max_steps=4" in message and "Fix:" in message
    final = warm_start_cache_dir(cfg)
    assert not final.exists()  # nothing cached
    # No temporary folder left; the files the message names are kept beside the cache, with no model.
    kept = final.parent / f"{final.name}.failed"
    assert [p.name for p in final.parent.iterdir()] == [kept.name] and not (kept / "model").exists()
    assert f"{kept / 'demos_sample.jsonl'}" in message and (kept / "demos_sample.jsonl").is_file()
    assert f"{kept / 'sft_metrics.jsonl'}" in message and (kept / "sft_metrics.jsonl").is_file()


def test_probe_steps_follow_probe_every(tmp_path):
    from stratarl.trainer.warmstart.stages import warm_start

    with pytest.raises(WarmStartFailed):
        warm_start(_cfg(probe_min_em=1.0, steps=2, probe_every=2, max_steps=6), tmp_path, progress=False)
    probes, steps = _probe_rows(tmp_path)
    assert [r["step"] for r in probes] == [2, 4, 6] and len(steps) == 6


def test_probe_world_is_none_the_warm_start_trains_on():
    cfg = _cfg()
    probe_seed = world_seed(0, PROBE_WORLD_OFFSET)
    assert probe_seed != 0
    assert not {world_seed(0, i) for i in range(10_000)} & {probe_seed}
    assert not {world_seed(0, READING_WORLD_OFFSET + i) for i in range(10_000)} & {probe_seed}
    settings = WarmStartSettings.from_config(cfg)
    single, multi, _retriever = probe_questions(settings.worlds, 4, seed=probe_seed)
    assert len(single) == 4 and len(multi) == 4
    assert all(len(e.metadata["hops"]) == 1 for e in single) and all(len(e.metadata["hops"]) == 2 for e in multi)
    from stratarl.trainer.warmstart.worlds import world_demonstrations

    demo_facts = {d.meta["answer"] for i in range(3) for d in world_demonstrations(settings, _tokenizer(cfg), i)}
    probe_answers = {e.golden_answers[0] for e in single}
    assert len(probe_answers - demo_facts) >= 2  # a pool world shares words, but the probe's facts are its own


def _tokenizer(cfg):
    from stratarl.trainer.setup import load_policy, load_task

    return load_policy(cfg.model, task=load_task(cfg))[1]


def test_probe_settings_are_validated():
    with pytest.raises(ConfigError, match="sft.probe_min_em"):
        _cfg(probe_min_em=1.5)
    with pytest.raises(ConfigError, match="sft.max_steps"):
        _cfg(steps=10, max_steps=5)
    data = json.loads(json.dumps(LAB))
    data["sft"].update(source="task")
    del data["sft"]["steps"]
    with pytest.raises(ConfigError, match="sft.probe_every"):
        config_from_dict(data)


def test_subword_models_need_no_name_pool():
    """A subword tokenizer spells any invented name, so every demonstration world may invent its own."""
    data = json.loads(json.dumps(LAB))
    del data["data"]["synthetic"]["options"]["name_pool"]
    data["model"] = {
        "name": "tiny-random",
        "tiny_hidden_size": 32,
        "tiny_num_layers": 2,
        "tiny_num_heads": 2,
        "tiny_intermediate_size": 64,
    }
    assert config_from_dict(data).sft.source == "worlds"


def test_line_progress_prints_an_eta_at_most_every_interval():
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(10, "sft", interval_s=30, stream=out, clock=lambda: now[0])
    for _ in range(4):
        now[0] += 10
        bar.update(1)
        bar.set_postfix(loss="0.500")
    lines = out.getvalue().splitlines()
    assert lines == ["sft: 3/10 steps (30%), loss=0.500, 10.00 s/step, elapsed 30s, ETA 1m10s"]
    bar.close()
    assert out.getvalue().splitlines()[-1] == "sft: 4/10 steps (40%), loss=0.500, 10.00 s/step, elapsed 40s, ETA 1m00s"
    assert format_duration(3725) == "1h02m"


def test_probe_reports_what_sampling_at_the_rl_temperature_does(tmp_path):
    """The probe's sampled measurement uses rollout.temperature, not greedy decoding: at a very low
    temperature it equals the greedy share of 2-search rollouts; the fields are shares in [0, 1]."""
    from stratarl.trainer.warmstart.stages import warm_start

    summary = warm_start(_cfg(probe_min_em=0.0, max_steps=2), tmp_path, progress=False)
    probe = summary["probes"][0]
    assert 0.0 <= probe["sampled_two_search"] <= 1.0 and 0.0 <= probe["sampled_two_search_em"] <= 1.0
    greedy_two = 1.0 - probe["multi_hop_one_search"] - _share_without_search(tmp_path)
    cold = config_from_dict({**json.loads(json.dumps(LAB)), "rollout": {**LAB["rollout"], "temperature": 1e-4}})
    from stratarl.models import load_model
    from stratarl.trainer.setup import load_policy, load_task
    from stratarl.trainer.warmstart.probe import probe_questions, sampled_second_searches

    tokenizer = load_policy(cold.model, task=load_task(cold))[1]
    model = load_model(str(tmp_path / "model"))
    settings = WarmStartSettings.from_config(cold)
    _, multi, retriever = probe_questions(settings.worlds, 4, seed=world_seed(0, PROBE_WORLD_OFFSET))
    share, _ = sampled_second_searches(model, tokenizer, settings.probe, multi, retriever, step=0)
    assert share == pytest.approx(greedy_two)


def _share_without_search(folder) -> float:
    """Share of the probe's 2-hop questions that the greedy policy answered with 0 searches (from the metrics:
    the mean number of searches and the one-search share pin it when at most 2 searches are allowed)."""
    rows = [json.loads(line) for line in (folder / "sft_metrics.jsonl").read_text().splitlines()]
    probe = next(r for r in rows if "probe/single_hop_em" in r)
    mean, one = probe["probe/multi_hop_searches"], probe["probe/multi_hop_one_search"]
    # mean = 1 * one + 2 * two (+ 0 * none), one + two + none = 1  ->  two = (mean - one) / 2
    two = (mean - one) / 2
    return 1.0 - one - two
