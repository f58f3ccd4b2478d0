"""The lab's warm start: worlds drawn from a shared name pool, a stream of fresh demonstrations,
weak-search demonstrations, the observation loss, and the warm-start cache."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from warmstart_lab import LAB, POOL, lab_sections

from stratarl.data.synth import generate_knowledge_base, name_pool_words
from stratarl.data.wordlevel import unknown_words
from stratarl.trainer.config import ConfigError, config_from_dict
from stratarl.trainer.warmstart.demos import Demonstration
from stratarl.trainer.warmstart.settings import WarmStartSettings
from stratarl.trainer.warmstart.sft import sft_step
from stratarl.trainer.warmstart.worlds import world_batches, world_demonstrations, world_seed


def _cfg(**sections):
    return config_from_dict(lab_sections(**sections))


def test_name_pool_worlds_share_words_not_facts():
    pool = name_pool_words(POOL)
    assert pool == name_pool_words(POOL)  # the same list in any process
    assert len(set(pool)) == POOL
    a = generate_knowledge_base(seed=1, size=120, name_pool=POOL, num_train=20, num_test=5)
    b = generate_knowledge_base(seed=2, size=120, name_pool=POOL, num_train=20, num_test=5)
    words = set(pool)
    for kb in (a, b):
        names = {w for p in kb.passages for w in p.contents.replace('"', " ").replace(".", " ").split() if w in words}
        assert len(names) > 50  # the names are pool words ...
    facts_a = {(e.question, e.golden_answers[0]) for e in a.train}
    facts_b = {(e.question, e.golden_answers[0]) for e in b.train}
    assert not facts_a & facts_b  # ... but the worlds tell different stories
    assert a.config["name_pool"] == POOL


def test_name_pool_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match="name_pool"):
        generate_knowledge_base(seed=0, size=2000, name_pool=100)


def test_world_seeds_never_hit_the_task_seed():
    for task_seed in range(50):
        assert all(world_seed(task_seed, i) != task_seed for i in range(100))
    assert len({world_seed(0, i) for i in range(1000)}) == 1000


def test_task_vocabulary_covers_every_world_of_the_pool():
    from stratarl.trainer.setup import load_policy, load_task

    cfg = _cfg()
    task = load_task(cfg)
    _, tokenizer = load_policy(cfg.model, task=task)
    for index in range(3):
        for demo in world_demonstrations(WarmStartSettings.from_config(cfg), tokenizer, index)[:20]:
            text = tokenizer.decode(demo.prompt_ids + demo.response_ids)
            assert unknown_words(tokenizer, text) == []


def test_world_stream_is_fresh_and_mixes_weak_search_demos():
    from stratarl.trainer.setup import load_policy, load_task

    cfg = _cfg()
    _, tokenizer = load_policy(cfg.model, task=load_task(cfg))
    stream = world_batches(WarmStartSettings.from_config(cfg), tokenizer, batch_size=4)
    batches = [next(stream) for _ in range(30)]
    demos = [d for b in batches for d in b]
    assert all(len(b) == 4 for b in batches)
    ids = [d.example_id for d in demos]
    # example ids repeat across worlds (synthkb-train-i), so freshness is checked on the text
    texts = [tuple(d.prompt_ids + d.response_ids) for d in demos]
    assert len(set(texts)) == len(texts)
    kinds = {d.kind for d in demos}
    assert {"correct", "early_answer"} <= kinds, kinds
    for d in demos:
        if d.kind == "early_answer":
            assert len(d.meta["searches"]) == 1  # one search where the question needs two
    task_questions = {e.question for e in load_task(cfg).train + load_task(cfg).test}
    assert ids and not task_questions & {tokenizer.decode(d.prompt_ids) for d in demos}


def test_observation_loss_weights_observation_tokens():
    torch.manual_seed(0)
    from stratarl.data.wordlevel import build_word_tokenizer
    from stratarl.models import build_tiny_model

    tok = build_word_tokenizer(["a b c d e f g"])
    demos = [Demonstration([3, 4], [5, 6, 7, 8], [1, 0, 0, 1]), Demonstration([4], [6, 5, 7], [1, 1, 0])]

    def grads(weight):
        model = build_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
        stats = sft_step(
            model, demos, tok.pad_token_id, micro_batch_tokens=64, chunk_tokens=8, observation_weight=weight
        )
        return stats, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain, g0 = grads(0.0)
    weighted, g1 = grads(0.5)
    assert plain["loss"] == pytest.approx(plain["weighted_loss"])
    assert weighted["loss"] == pytest.approx(plain["loss"], rel=1e-5)  # the reported loss is policy tokens only
    assert weighted["weighted_loss"] != pytest.approx(plain["loss"])
    assert not torch.allclose(g0, g1)
    # hand check of the weighted loss: -(sum policy logp + 0.5 sum obs logp) / (4 + 0.5 * 3)
    model = build_tiny_model(tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    logp = []
    with torch.no_grad():
        for d in demos:
            seq = torch.tensor([d.prompt_ids + d.response_ids])
            lp = torch.log_softmax(model(input_ids=seq).logits[0, :-1], -1)
            targets = seq[0, 1:]
            row = lp.gather(-1, targets[:, None]).squeeze(-1)[len(d.prompt_ids) - 1 :]
            logp.append((row, torch.tensor(d.response_mask, dtype=torch.float32)))
    num = sum(float((r * m).sum() + 0.5 * (r * (1 - m)).sum()) for r, m in logp)
    assert weighted["weighted_loss"] == pytest.approx(-num / (4 + 0.5 * 3), rel=1e-5)


def test_worlds_source_needs_a_name_pool():
    data = json.loads(json.dumps(LAB))
    del data["data"]["synthetic"]["options"]["name_pool"]
    with pytest.raises(ConfigError, match="name_pool"):
        config_from_dict(data)
    with pytest.raises(ConfigError, match="sft.steps"):
        _cfg(sft={"steps": 0})
    with pytest.raises(ConfigError, match="sum to"):
        _cfg(sft={"no_search_fraction": 0.5, "early_answer_fraction": 0.6})


def test_cached_warm_start_is_built_once_and_keyed_by_its_settings(tmp_path, monkeypatch):
    from stratarl.trainer.warmstart.stages import cached_warm_start, warm_start_cache_dir

    monkeypatch.setenv("STRATARL_CACHE", str(tmp_path / "cache"))
    cfg = _cfg(sft={"cache": True})
    model_dir, summary = cached_warm_start(cfg, progress=False)
    assert summary is not None and summary["steps"] == 3 and summary["source"] == "worlds"
    assert summary["num_demos"] == 12 and sum(summary["demo_kinds"].values()) == 12
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    again, summary2 = cached_warm_start(cfg, progress=False)
    assert again == model_dir and summary2 is None  # reused
    # RL settings do not change the key; warm-start settings do
    assert warm_start_cache_dir(_cfg(sft={"cache": True}, algo={"name": "ppo"})) == warm_start_cache_dir(cfg)
    assert warm_start_cache_dir(_cfg(sft={"cache": True, "steps": 4})) != warm_start_cache_dir(cfg)
    rebuilt, summary3 = cached_warm_start(cfg, rebuild=True, progress=False)
    assert rebuilt == model_dir and summary3 is not None
    leftovers = [p.name for p in model_dir.parent.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []  # no temporary folder left behind


def test_copy_init_sets_value_and_output_projections_to_the_identity():
    from stratarl.data.wordlevel import build_word_tokenizer
    from stratarl.models import build_tiny_model

    tok = build_word_tokenizer(["a b c d e f g"])
    copied = build_tiny_model(tok, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32, copy_init=1.0)
    plain = build_tiny_model(tok, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32)
    for layer in copied.model.layers:
        assert torch.equal(layer.self_attn.v_proj.weight, torch.eye(16))
        assert torch.equal(layer.self_attn.o_proj.weight, torch.eye(16))
    assert not torch.equal(plain.model.layers[0].self_attn.v_proj.weight, torch.eye(16))
    # everything else is the same seeded random init
    assert torch.equal(copied.model.layers[0].self_attn.q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight)


def test_reading_curriculum_starts_with_one_sentence_and_ends_with_full_observations():
    from stratarl.trainer.setup import load_policy, load_task
    from stratarl.trainer.warmstart.worlds import reading_batches

    cfg = _cfg()
    _, tokenizer = load_policy(cfg.model, task=load_task(cfg))
    stream = reading_batches(WarmStartSettings.from_config(cfg), tokenizer, batch_size=8, curriculum=3, mix_worlds=1)
    batches = [next(stream) for _ in range(8)]

    def docs(demo):
        return tokenizer.decode(demo.prompt_ids + demo.response_ids).count("Doc ")

    first, late = batches[0], [d for b in batches[5:] for d in b]
    assert all(d.meta["context"] == "sentence" for d in first)  # step 0: probability 1
    assert all(docs(d) == 1 and len(d.meta["questions"]) == 1 for d in first)
    # past the curriculum new worlds render full observations (a few sentence examples rendered
    # earlier may still wait in the shuffled pool)
    assert sum(d.meta["context"] == "observation" for d in late) >= 0.75 * len(late)
    for d in late:
        text = tokenizer.decode(d.response_ids)
        assert text.count("<answer>") == len(d.meta["questions"])
        answered = "".join(tokenizer.decode([t]) for t, m in zip(d.response_ids, d.response_mask) if m)
        assert "</answer>" in answered and "Question" not in answered  # only answers are targets


def test_reading_examples_in_the_agents_layout_are_single_hop_demonstrations():
    from stratarl.rollout.prompt import encode_prompt
    from stratarl.trainer.setup import load_policy, load_task
    from stratarl.trainer.warmstart.render import ANSWER_THOUGHT, SEARCH_THOUGHT
    from stratarl.trainer.warmstart.worlds import reading_batches

    cfg = _cfg(sft={"reading_agent_fraction": 1.0}, rollout={"max_obs_tokens": 240})
    _, tokenizer = load_policy(cfg.model, task=load_task(cfg))
    demos = [
        d
        for _ in range(3)
        for d in next(
            reading_batches(WarmStartSettings.from_config(cfg), tokenizer, batch_size=8, curriculum=0, mix_worlds=1)
        )
    ]
    assert demos and all(d.kind == "reading_agent" for d in demos)
    copied = []
    for d in demos:
        (question,) = d.meta["questions"]
        # the question is in the prompt, exactly as a rollout's prompt encodes it
        assert d.prompt_ids == encode_prompt(tokenizer, question, cfg.rollout.prompt_template, None)
        targets = tokenizer.decode([t for t, m in zip(d.response_ids, d.response_mask) if m])
        context = tokenizer.decode([t for t, m in zip(d.response_ids, d.response_mask) if not m])
        assert targets.startswith(f"{SEARCH_THOUGHT}<search> {question} </search>{ANSWER_THOUGHT}<answer> ")
        assert targets.endswith("</answer>" + tokenizer.eos_token)  # the answer turn ends the rollout
        answer = targets.split("<answer> ")[1].split(" </answer>")[0]
        assert "<information>" in context and "<answer>" not in context
        if "[truncated]" not in context:  # the engine's observation cap may cut a long passage, as in a rollout
            assert answer in context  # copied from the observation, never a target
            copied.append(d)
        # one contiguous observation between the search turn and the answer turn, as the engine lays it out
        assert [m for m, _ in itertools.groupby(d.response_mask)] == [1, 0, 1]
    assert len(copied) >= len(demos) / 2


def test_reading_agent_fraction_mixes_both_layouts_and_zero_keeps_the_old_stream():
    from stratarl.trainer.setup import load_policy, load_task
    from stratarl.trainer.warmstart.worlds import reading_batches

    cfg0 = _cfg()
    _, tokenizer = load_policy(cfg0.model, task=load_task(cfg0))
    half = [
        d
        for _ in range(6)
        for d in next(
            reading_batches(
                WarmStartSettings.from_config(_cfg(sft={"reading_agent_fraction": 0.5})),
                tokenizer,
                batch_size=8,
                curriculum=0,
                mix_worlds=1,
            )
        )
    ]
    share = sum(d.kind == "reading_agent" for d in half) / len(half)
    assert 0.2 < share < 0.8
    plain = [
        next(reading_batches(WarmStartSettings.from_config(cfg0), tokenizer, batch_size=8, curriculum=2, mix_worlds=1))
        for _ in range(1)
    ]
    again = [
        next(
            reading_batches(
                WarmStartSettings.from_config(_cfg(sft={"reading_agent_fraction": 0.0})),
                tokenizer,
                batch_size=8,
                curriculum=2,
                mix_worlds=1,
            )
        )
        for _ in range(1)
    ]
    assert [d.response_ids for d in plain[0]] == [d.response_ids for d in again[0]]
    assert all(d.kind == "reading" for d in plain[0])


def test_reading_mix_adds_fresh_reading_examples_to_every_demonstration_batch(tmp_path):
    from stratarl.trainer.warmstart.stages import warm_start

    summary = warm_start(_cfg(sft={"reading_mix": 3, "steps": 2}), tmp_path, progress=False)
    kinds = summary["demo_kinds"]
    assert kinds.get("reading") == 3 * 2  # 3 per step, 2 steps
    assert sum(v for k, v in kinds.items() if k != "reading") == 4 * 2  # the demonstrations are all still there
    plain = warm_start(_cfg(sft={"steps": 2}), tmp_path / "plain", progress=False)
    assert "reading" not in plain["demo_kinds"]


@pytest.mark.parametrize(
    "key, value", [("reading_agent_fraction", 1.5), ("reading_agent_fraction", -0.1), ("reading_mix", -1)]
)
def test_reading_knobs_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"sft.{key}"):
        _cfg(sft={key: value})


def test_rehearsal_worlds_are_not_the_reading_stages():
    from stratarl.trainer.warmstart.probe import PROBE_WORLD_OFFSET
    from stratarl.trainer.warmstart.worlds import READING_WORLD_OFFSET, REHEARSAL_WORLD_OFFSET, WORLD_SEED_STRIDE

    # the reading stage draws a few hundred worlds; the ranges stay inside one task's stride
    assert READING_WORLD_OFFSET + 10_000 < REHEARSAL_WORLD_OFFSET < WORLD_SEED_STRIDE - 10_000
    assert PROBE_WORLD_OFFSET + 10_000 < READING_WORLD_OFFSET
