"""Which prompt the policy sees: a data file's own prompt, or the run's template around the question."""

from __future__ import annotations

from stratarl.rollout.collect import encode_prompts
from stratarl.rollout.prompt import encode_prompt
from stratarl.trainer.synthetic import load_synthetic_task


def test_synthetic_task_uses_the_runs_template_not_its_files_prompt(tmp_path, smollm2_tokenizer):
    # The synthetic task's parquet files hold a Search-R1 prompt column; rollout.prompt_template (the lab's
    # `short`) must still decide what the policy sees.
    task = load_synthetic_task(tmp_path / "kb", seed=0, options={"size": 120, "num_train": 4, "num_test": 2})
    examples = [*task.train, *task.test]
    assert all(e.prompt is None for e in examples)
    assert encode_prompts(smollm2_tokenizer, examples, template="short") == [
        encode_prompt(smollm2_tokenizer, e.question, "short") for e in examples
    ]


def test_multiple_choice_task_prompts_and_demonstrations_show_the_options(tmp_path, smollm2_tokenizer):
    from stratarl.data.synth import generate_knowledge_base
    from stratarl.trainer.warmstart.demos import render_demonstrations

    tok = smollm2_tokenizer
    kb = generate_knowledge_base(seed=0, size=120, num_train=6, num_test=2, multiple_choice=3)
    passages = {p.id: p for p in kb.passages}
    by_query = {h["query"]: passages[h["passage_id"]] for e in kb.train for h in e.metadata["hops"]}

    class GoldRetriever:
        def search(self, queries, k):
            return [[by_query[q]] for q in queries]

    demos = render_demonstrations(
        kb.train,
        tok,
        GoldRetriever(),
        num_demos=6,
        topk=1,
        max_obs_tokens=200,
        no_search_fraction=0.0,
        wrong_hop_fraction=0.0,
        seed=0,
    )
    example = {e.id: e for e in kb.train}[demos[0].example_id]
    prompt = tok.decode(demos[0].prompt_ids)
    assert all(f"{letter}. {text}\n" in prompt for letter, text in example.metadata["options"].items())
    assert tok.decode(demos[0].response_ids).endswith(f"<answer> {example.golden_answers[0]} </answer>{tok.eos_token}")
    assert encode_prompts(tok, [example]) == [demos[0].prompt_ids]  # RL rollouts see the same prompt
