"""A user's own estimator, defined in the user's file and loaded from the command line, trains with
`stratarl train` and no stratarl file touched (README: a new algorithm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stratarl.extensions import ExtensionError, env_imports, load_extension, split_import_args

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"

RLOO = '''
"""RLOO (Ahmadian et al. 2024, arXiv 2402.14740): each rollout's baseline is the mean reward of the
other rollouts of its prompt."""
import json
import os

import torch

from stratarl.algos import AdvantageBatch, broadcast_to_tokens, register_advantage


@register_advantage("rloo", group_relative=True)
def rloo(batch: AdvantageBatch, *, scale: float = 1.0):
    rewards = batch.rewards.float()
    groups = torch.unique(batch.group_ids, return_inverse=True)[1]
    sums = torch.zeros(int(groups.max()) + 1).index_add(0, groups, rewards)
    counts = torch.zeros(int(groups.max()) + 1).index_add(0, groups, torch.ones_like(rewards))
    others = (counts[groups] - 1).clamp(min=1)
    advantage = torch.where(counts[groups] > 1, rewards - (sums[groups] - rewards) / others, 0.0) * scale
    with open(os.environ["RLOO_RECORD"], "a") as f:
        f.write(json.dumps({"rewards": rewards.tolist(), "groups": batch.group_ids.tolist(),
                            "advantages": advantage.tolist(), "scale": scale}) + "\\n")
    tokens = broadcast_to_tokens(advantage, batch.response_mask)
    return tokens, tokens
'''


def _rloo_by_loop(rewards: list[float], groups: list[int], scale: float) -> list[float]:
    """Slow reference: for each rollout, its reward minus the mean of the others in its group."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        out.append(scale * (r - sum(others) / len(others)) if others else 0.0)
    return out


def _run(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "stratarl.cli", *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_a_users_rloo_trains_from_the_command_line(tmp_path, tiny_overrides, reward_path):
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(RLOO)
    record = tmp_path / "rloo.jsonl"
    env = {
        **os.environ,
        "RLOO_RECORD": str(record),
        "PYTHONPATH": os.pathsep.join([str(reward_path), os.environ.get("PYTHONPATH", "")]),
    }
    where = subprocess.run(
        [sys.executable, "-c", "import stratarl; print(stratarl.__file__)"], capture_output=True, text=True, env=env
    )
    assert Path(where.stdout.strip()).resolve().is_relative_to(Path(__file__).resolve().parents[2])

    run_dir = tmp_path / "run"
    out = _run(
        "train",
        TINY,
        *tiny_overrides,
        "--import",
        plugin,
        "algo.advantage=rloo",
        "algo.advantage_params.scale=2.0",
        "trainer.steps=1",
        "--run-dir",
        run_dir,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(calls) == 1 and calls[0]["scale"] == 2.0
    call = calls[0]
    assert len(set(call["rewards"])) > 1  # the reward varies, so RLOO's advantages are not all 0
    torch.testing.assert_close(
        torch.tensor(call["advantages"]), torch.tensor(_rloo_by_loop(call["rewards"], call["groups"], 2.0))
    )
    saved = (run_dir / "config.yaml").read_text()
    assert "advantage: rloo" in saved
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The update used RLOO's advantages: their range is the one the plugin computed.
    assert metrics[0]["advantage/max"] == pytest.approx(max(call["advantages"]), abs=1e-6)
    assert metrics[0]["advantage/min"] == pytest.approx(min(call["advantages"]), abs=1e-6)

    # The same with the environment variable instead of the flag.
    record.unlink()
    out = _run(
        "train",
        TINY,
        *tiny_overrides,
        "algo.advantage=rloo",
        "trainer.steps=1",
        "--run-dir",
        tmp_path / "env",
        env={**env, "STRATARL_IMPORT": str(plugin)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(record.read_text().splitlines()[0])["scale"] == 1.0


def test_without_the_module_the_name_is_refused_in_one_line(tmp_path, reward_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(reward_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("STRATARL_IMPORT", None)
    out = _run("train", TINY, "algo.advantage=rloo", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "`algo.advantage` = 'rloo': no advantage estimator of that name is registered" in out.stderr
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(RLOO)
    out = _run("train", TINY, f"--import={plugin}", "algo.advantage=rloo", "algo.advantage_params.sclae=2", env=env)
    assert out.returncode == 2 and "did you mean 'scale'? valid parameters: scale" in out.stderr
    out = _run("train", TINY, "--import", tmp_path / "missing.py", env=env)
    assert out.returncode == 2 and "missing.py: file not found" in out.stderr


def test_split_import_args_takes_the_flag_anywhere():
    assert split_import_args(["train", "c.yaml", "--import", "a.py", "x=1", "--import=b.mod", "y=2"]) == (
        ["a.py", "b.mod"],
        ["train", "c.yaml", "x=1", "y=2"],
    )
    with pytest.raises(ExtensionError, match="--import needs a value"):
        split_import_args(["train", "--import"])
    assert env_imports({"STRATARL_IMPORT": f"a.py{os.pathsep}{os.pathsep} pkg.mod "}) == ["a.py", "pkg.mod"]


def test_a_file_is_loaded_once(tmp_path):
    plugin = tmp_path / "stratarl_test_once.py"
    plugin.write_text("LOADS = []\nLOADS.append(1)\n")
    try:
        first = load_extension(str(plugin))
        assert load_extension(str(plugin)) is first and first.LOADS == [1]
    finally:
        sys.modules.pop(first.__name__, None)
    with pytest.raises(ExtensionError, match="no module named 'stratarl_no_such_module'"):
        load_extension("stratarl_no_such_module")


def test_the_readme_rloo_is_right_and_registers_by_name(monkeypatch):
    """README's "A new algorithm" snippet, run as written: it registers `rloo` and computes RLOO."""
    import re

    import stratarl.algos.registry as registry
    from stratarl.algos import AdvantageBatch

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "my_parts.py" in block]
    monkeypatch.setattr(registry, "_ADVANTAGES", registry._ADVANTAGES.copy())
    monkeypatch.setattr(registry, "_ADVANTAGE_INFO", dict(registry._ADVANTAGE_INFO))
    exec(compile(code, "README.md", "exec"), {})
    rewards, groups = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0], [7, 7, 7, 2, 2, 9]
    mask = torch.ones(6, 3, dtype=torch.long)
    batch = AdvantageBatch(rewards=torch.tensor(rewards), group_ids=torch.tensor(groups), response_mask=mask)
    advantages, _ = registry.get_advantage("rloo")(batch, scale=2.0)
    torch.testing.assert_close(advantages[:, 0], torch.tensor(_rloo_by_loop(rewards, groups, 2.0)))
    assert registry.advantage_info("rloo").group_relative


def test_train_help_lists_every_preset():
    from stratarl.algos.presets import PRESETS

    out = subprocess.run([sys.executable, "-m", "stratarl.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    flat = " ".join(out.stdout.split())
    for name in PRESETS:
        assert name in flat, name
    assert "--import MODULE" in out.stdout


MY_DATA = '''
"""A dataset format and a retriever of the user's own, in one file."""
import json
import os

from stratarl.data import Example, register_dataset_format
from stratarl.retrieval import Passage, register_retriever


@register_dataset_format("trivia", matches=lambda row: "Q" in row and "A" in row)
def trivia(row, *, row_index, id_=None):
    return Example(id=id_ or f"trivia-{row_index}", question=row["Q"], golden_answers=(row["A"],), data_source="trivia")


@register_retriever("notes")
class Notes:
    def __init__(self, *, path: str):
        self.notes = [line.strip() for line in open(path) if line.strip()]
        with open(os.environ["NOTES_RECORD"], "a") as f:
            f.write(json.dumps({"built": path}) + "\\n")

    def search(self, queries, k):
        with open(os.environ["NOTES_RECORD"], "a") as f:
            f.write(json.dumps(queries) + "\\n")
        return [[Passage(str(i), f'"note"\\n{note}') for i, note in enumerate(self.notes)][:k] for _ in queries]
'''


@pytest.mark.slow
def test_a_users_dataset_format_and_retriever_train_from_the_command_line(tmp_path, tiny_overrides, reward_path):
    plugin = tmp_path / "my_data.py"
    plugin.write_text(MY_DATA)
    questions = tmp_path / "trivia.jsonl"
    questions.write_text("".join(json.dumps({"Q": f"What is item {i}?", "A": f"thing{i}"}) + "\n" for i in range(6)))
    notes = tmp_path / "notes.txt"
    notes.write_text("item 0 is thing0\nitem 1 is thing1\n")
    record = tmp_path / "searches.jsonl"
    record.touch()
    env = {
        **os.environ,
        "NOTES_RECORD": str(record),
        "PYTHONPATH": os.pathsep.join([str(reward_path), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("STRATARL_IMPORT", None)
    run_dir = tmp_path / "run"
    out = _run(
        "train",
        TINY,
        *tiny_overrides,
        "--import",
        plugin,
        "data.source=files",
        f"data.train_files=[{questions}]",
        f"data.test_files=[{questions}]",
        f"retrieval.spec={{kind: notes, path: {notes}}}",
        "trainer.steps=1",
        "rollout.max_turns=1",
        "--run-dir",
        run_dir,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    transcripts = [
        json.loads(line)
        for p in sorted((run_dir / "transcripts").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert transcripts and all("What is item" in json.dumps(t) for t in transcripts)  # the user's format's questions
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert calls[0] == {"built": str(notes)}  # the user's retriever, built from retrieval.spec
    assert all(isinstance(call, list) for call in calls[1:])  # any search went to it (a random policy may not search)
    assert "kind: notes" in (run_dir / "config.yaml").read_text()
