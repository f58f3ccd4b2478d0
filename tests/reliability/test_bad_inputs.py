"""Every bad input gets one clear error line naming the file, field or value (no traceback); a failed
resume leaves config.yaml as it was; a module planted in the current directory is never imported."""

from __future__ import annotations

import pytest
from fault_injection import TINY, bad_input_cases, clear_error, run_cli


@pytest.fixture(scope="module")
def run_without_checkpoint(tmp_path_factory, tiny_cfg):
    from stratarl.trainer.config import save_config

    run_dir = tmp_path_factory.mktemp("no_ckpt") / "run"
    run_dir.mkdir()
    save_config(tiny_cfg, run_dir / "config.yaml")
    return run_dir


@pytest.fixture(scope="module")
def cases(tmp_path_factory, run_without_checkpoint, tiny_cfg, straight_run):
    table = bad_input_cases(
        tmp_path_factory.mktemp("bad"), TINY, tiny_cfg.data.synthetic.cache_dir, run_without_checkpoint, straight_run
    )
    return {name: (argv, expected) for name, argv, expected in table}


def test_every_bad_input_gets_one_clear_error_line(cases):
    unclear = {}
    for name, (argv, expected) in cases.items():
        code, stderr = run_cli(argv)
        if not clear_error(code, stderr, expected):
            unclear[name] = (code, stderr[-600:])
    assert unclear == {}
    assert len(cases) >= 28


def test_a_failed_resume_leaves_config_yaml_unchanged(straight_run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(straight_run, run_dir)
    before = (run_dir / "config.yaml").read_bytes()
    code, stderr = run_cli(["train", "--resume", str(run_dir), "data.max_train_examples=3"])
    assert clear_error(code, stderr, "same data config")
    assert (run_dir / "config.yaml").read_bytes() == before
    code, stderr = run_cli(["train", "--resume", str(run_dir), "trainer.steps=4"])
    assert code == 0, stderr
    assert "steps: 4" in (run_dir / "config.yaml").read_text()


def test_a_module_planted_in_the_current_directory_is_not_imported(tmp_path, monkeypatch):
    from stratarl.infra.callables import resolve_callable

    (tmp_path / "planted_reward_mod.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\ndef reward(t, g):\n    return 1.0\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")  # what `python -m` puts first
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(ValueError, match="current directory is not searched"):
        resolve_callable("planted_reward_mod:reward", "algo.reward", num_args=2)
    assert not (tmp_path / "RAN").exists()
    fn = resolve_callable("./planted_reward_mod.py:reward", "algo.reward", num_args=2)  # an explicit path loads
    assert fn("x", ["y"]) == 1.0 and (tmp_path / "RAN").exists()


def test_an_os_error_that_carries_its_fix_gets_no_second_one():
    import errno

    from stratarl.commands import describe_os_error

    disk_full = OSError(
        errno.ENOSPC,
        "disk full while writing a checkpoint under runs/x; the previous checkpoint is "
        "intact. Fix: free space, then `stratarl train --resume RUN_DIR`",
    )
    assert describe_os_error(disk_full).count("Fix:") == 1
    plain = OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl")
    assert describe_os_error(plain) == "No space left on device: runs/x/metrics.jsonl. Fix: free disk space"


@pytest.fixture(scope="module")
def more_cases(tmp_path_factory, tiny_cfg):
    """Bad inputs that need no trained run: (name, argv, the whole error line or a part of it)."""
    root = tmp_path_factory.mktemp("more_bad")
    a_file = root / "a_file"
    a_file.write_text("not a folder\n")
    pickled = root / "pickled_model"  # never read: the refusal comes from the file names
    pickled.mkdir()
    (pickled / "config.json").write_text('{"model_type": "llama"}\n')
    (pickled / "pytorch_model.bin").write_bytes(b"a pickle is never loaded")
    (root / "syntax.yaml").write_text("trainer:\n  steps: [1\n")
    (root / "int.jsonl").write_text('{"question": "how many?", "golden_answers": 42}\n')
    (root / "int_list.jsonl").write_text(
        '{"question": "a?", "golden_answers": ["a"]}\n{"question": "how many?", "golden_answers": ["x", 42]}\n'
    )
    (root / "empty.jsonl").write_text("")
    corpus = root / "corpus.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"T\\"\\nsome text"}\n')
    tiny = [
        str(TINY),
        f"data.synthetic.cache_dir={tiny_cfg.data.synthetic.cache_dir}",
        f"trainer.output_dir={root / 'runs'}",
    ]
    return [
        (
            "a model folder with only pickle weights",
            ["train", *tiny, f"model.name={pickled}"],
            (
                f"error: model folder {pickled}: holds only pickle weights (pytorch_model.bin) and stratarl loads only "
                "safetensors (a pickle can run code when read). Fix: if you trust the file, convert it once with "
                "transformers: `AutoModelForCausalLM.from_pretrained(FOLDER, use_safetensors=False)"
                ".save_pretrained(FOLDER, safe_serialization=True)`"
            ),
        ),
        (
            "a YAML syntax error",
            ["train", str(root / "syntax.yaml")],
            (
                f"error: config file {root / 'syntax.yaml'} is not valid YAML at line 3, column 1: expected ',' or ']', "
                "but got '<stream end>' (while parsing a flow sequence that starts at line 2, column 10). Fix: correct "
                "the YAML syntax there"
            ),
        ),
        (
            "a YAML syntax error in a population spec",
            ["population", str(root / "syntax.yaml")],
            f"error: population spec {root / 'syntax.yaml'} is not valid YAML at line 3, column 1",
        ),
        (
            "an integer gold answer",
            ["data", "inspect", str(root / "int.jsonl")],
            (
                f"error: {root / 'int.jsonl'}: row 0: field 'golden_answers': the gold answer 42 is a number, not text. "
                'Fix: write gold answers as strings, e.g. ["42"]'
            ),
        ),
        (
            "an integer in a list of gold answers",
            ["data", "convert", str(root / "int_list.jsonl"), str(root / "out.jsonl")],
            f"error: {root / 'int_list.jsonl'}: row 1: field 'golden_answers': the gold answer 42 is a number",
        ),
        (
            "data inspect a 0-row file",
            ["data", "inspect", str(root / "empty.jsonl")],
            f"error: {root / 'empty.jsonl'}: contains no rows. Fix: pass a question file with at least one row",
        ),
        (
            "data convert a 0-row file",
            ["data", "convert", str(root / "empty.jsonl"), str(root / "out.jsonl")],
            f"error: {root / 'empty.jsonl'}: contains no rows. Fix: pass a question file with at least one row",
        ),
        (
            "index build --out is a file",
            ["index", "build", "--corpus", str(corpus), "--out", str(a_file)],
            (
                f"stratarl index: error: {a_file}: already exists and is in the way of a folder or file to be created "
                "here. Fix: choose another path, or move it away"
            ),
        ),
        (
            "index build --out under a file",
            ["index", "build", "--corpus", str(corpus), "--out", str(a_file / "x")],
            (
                f"stratarl index: error: {a_file / 'x'}: a part of this path is a file, not a folder. Fix: choose "
                "another path"
            ),
        ),
        (
            "serve --max-topk 0",
            ["serve", "--corpus", str(corpus), "--max-topk", "0"],
            "stratarl serve: error: --max-topk 0: must be a positive integer. Fix: pass e.g. --max-topk 100",
        ),
        (
            "serve --topk above --max-topk",
            ["serve", "--corpus", str(corpus), "--topk", "5", "--max-topk", "3"],
            "stratarl serve: error: --topk 5 is more than --max-topk 3. Fix: lower --topk or raise --max-topk",
        ),
    ]


def test_bad_inputs_that_need_no_run_get_one_line_that_says_the_fix(more_cases):
    unclear = {}
    for name, argv, expected in more_cases:
        code, stderr = run_cli(argv)
        line = [line for line in stderr.splitlines() if "error:" in line][-1:]
        exact = expected.startswith(("error:", "stratarl ")) and expected.count("Fix:") == 1
        if not clear_error(code, stderr, expected) or (exact and line != [expected]):
            unclear[name] = (code, stderr[-600:])
    assert unclear == {}


def test_os_errors_say_what_happened_and_the_fix():
    import errno

    from stratarl.commands import describe_os_error

    assert describe_os_error(FileExistsError(errno.EEXIST, "File exists", "runs/x")) == (
        "runs/x: already exists and is in the way of a folder or file to be created here. Fix: choose another "
        "path, or move it away"
    )
    assert describe_os_error(NotADirectoryError(errno.ENOTDIR, "Not a directory", "a_file/x")) == (
        "a_file/x: a part of this path is a file, not a folder. Fix: choose another path"
    )
    assert describe_os_error(FileNotFoundError(errno.ENOENT, "No such file or directory", "data/q.jsonl")) == (
        "data/q.jsonl: no such file or folder. Fix: check the path"
    )
