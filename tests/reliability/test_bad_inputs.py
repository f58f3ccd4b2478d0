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
    table = bad_input_cases(tmp_path_factory.mktemp("bad"), TINY, tiny_cfg.data.synthetic.cache_dir,
                            run_without_checkpoint, straight_run)
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
        "import pathlib\npathlib.Path(__file__).with_name('RAN').touch()\ndef reward(t, g):\n    return 1.0\n")
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

    disk_full = OSError(errno.ENOSPC, "disk full while writing a checkpoint under runs/x; the previous checkpoint is "
                                      "intact. Fix: free space, then `stratarl train --resume RUN_DIR`")
    assert describe_os_error(disk_full).count("Fix:") == 1
    plain = OSError(errno.ENOSPC, "No space left on device", "runs/x/metrics.jsonl")
    assert describe_os_error(plain) == "No space left on device: runs/x/metrics.jsonl. Fix: free disk space"
