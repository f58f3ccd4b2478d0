"""Which prompt the policy sees: a data file's own prompt, or the run's template around the question."""

from __future__ import annotations

from stratarl.rollout.prompt import encode_prompt
from stratarl.trainer.rollouts import encode_prompts
from stratarl.trainer.synthetic import load_synthetic_task


def test_synthetic_task_uses_the_runs_template_not_its_files_prompt(tmp_path, smollm2_tokenizer):
    # The synthetic task's parquet files hold a Search-R1 prompt column; rollout.prompt_template (the lab's
    # `short`) must still decide what the policy sees.
    task = load_synthetic_task(tmp_path / "kb", seed=0, options={"size": 120, "num_train": 4, "num_test": 2})
    examples = [*task.train, *task.test]
    assert all(e.prompt is None for e in examples)
    assert encode_prompts(smollm2_tokenizer, examples, template="short") == [
        encode_prompt(smollm2_tokenizer, e.question, "short") for e in examples]
