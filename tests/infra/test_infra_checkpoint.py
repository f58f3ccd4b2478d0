"""Atomic checkpoints, pruning, exact data-order resume, weights_only loading."""

from __future__ import annotations

import random

import pytest
import torch

from stratarl.infra import checkpoint as ckpt


def test_sampler_resume_gives_the_same_indices():
    straight = ckpt.DataSampler(7, seed=3)
    expected = [straight.next(3) for _ in range(6)]  # crosses several epochs
    first = ckpt.DataSampler(7, seed=3)
    got = [first.next(3) for _ in range(2)]
    state = first.state_dict()
    second = ckpt.DataSampler(7, seed=3)
    second.load_state_dict(state)
    got += [second.next(3) for _ in range(4)]
    assert got == expected


def test_sampler_epochs_are_permutations():
    s = ckpt.DataSampler(5, seed=0)
    first, second = s.next(5), s.next(5)
    assert sorted(first) == sorted(second) == list(range(5))
    assert first != second  # reshuffled per epoch (seeded; fixed for seed 0)


def test_sampler_rejects_other_dataset():
    s = ckpt.DataSampler(5, seed=0)
    with pytest.raises(ValueError, match="same data config"):
        s.load_state_dict(ckpt.DataSampler(6, seed=0).state_dict())


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_save_load_round_trip_with_weights_only(tmp_path):
    model = _model()
    gen = torch.Generator().manual_seed(5)
    gen_state = gen.get_state()
    state = {"rng": ckpt.rng_state(gen), "sampler": {"epoch": 1, "position": 2, "num_items": 3, "seed": 0}}
    path = ckpt.save_checkpoint(tmp_path, 4, model=model, state=state)
    assert ckpt.latest_checkpoint(tmp_path) == path
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    loaded = ckpt.load_checkpoint(path, model=other)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert loaded["step"] == 4 and loaded["sampler"]["position"] == 2
    gen.manual_seed(99)
    ckpt.set_rng_state(loaded["rng"], gen)
    assert torch.equal(gen.get_state(), gen_state)


def test_rng_state_restores_python_and_torch():
    state = ckpt.rng_state()
    a = (random.random(), torch.rand(2))
    ckpt.set_rng_state(state)
    b = (random.random(), torch.rand(2))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_keep_last_prunes_old_checkpoints(tmp_path):
    model = _model()
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model=model, state={}, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000004"


def test_crash_mid_write_leaves_latest_intact(tmp_path, monkeypatch):
    model = _model()
    good = ckpt.save_checkpoint(tmp_path, 1, model=model, state={"x": 1})

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", explode)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, state={"x": 2})
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert not (tmp_path / "step_000002").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".step_")]  # temp folder cleaned up
    assert ckpt.load_checkpoint(good, model=_model())["x"] == 1


def test_load_rejects_a_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a stratarl checkpoint"):
        ckpt.load_checkpoint(tmp_path, model=_model())


def test_load_rejects_a_different_model(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model=_model(), state={})
    with pytest.raises(
        ValueError, match="saved from a different model: it holds 2 tensor.s. the model lacks .e.g. 1.bias, 1.weight."
    ) as error:
        ckpt.load_checkpoint(path, model=torch.nn.Sequential(torch.nn.Linear(3, 4)))
    assert str(error.value).count("Fix:") == 1 and "\n" not in str(error.value)


def test_a_checkpoint_of_another_model_size_is_one_line_naming_a_tensor_and_its_shapes(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, model=_model(), state={})
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(ValueError) as error:
        ckpt.load_checkpoint(path, model=wider)
    message = str(error.value)
    assert "\n" not in message and len(message) < 400 and message.count("Fix:") == 1
    # torch would say "size mismatch for 0.weight: copying a param with shape ..." once per tensor, on 4 lines
    assert (
        f"checkpoint {path} was saved from a different model: 0.weight is [4, 3] there but [5, 3] in this one and 2 more"
        in message
    )
    assert "model.* in the run's config.yaml" in message


@pytest.mark.parametrize(
    "change, cause",
    [
        (lambda b: b[:-7], "cut short: a torn write"),
        (lambda b: b + b"extra", "it grew after the checkpoint was written"),
    ],
)
def test_a_size_mismatch_says_which_way_the_file_changed(tmp_path, change, cause):
    path = ckpt.save_checkpoint(tmp_path, 1, model=_model(), state={})
    model_file = path / "model.safetensors"
    model_file.write_bytes(change(model_file.read_bytes()))
    with pytest.raises(ckpt.CheckpointError, match=cause) as error:
        ckpt.verify_checkpoint(path)
    assert str(model_file) in str(error.value)


def test_a_full_disk_says_whether_an_earlier_checkpoint_exists(tmp_path, monkeypatch):
    """Before: "the previous checkpoint is intact" even when the run had written none yet."""
    import errno

    from stratarl.infra import checkpoint as ckpt

    model = torch.nn.Linear(2, 2)
    real_save = ckpt.save_model
    full = {"on": True}

    def save_model(module, path):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(module, path)

    monkeypatch.setattr(ckpt, "save_model", save_model)
    with pytest.raises(OSError) as first:
        ckpt.save_checkpoint(tmp_path, 1, model=model, state={})
    assert "no earlier checkpoint exists yet" in str(first.value) and "intact" not in str(first.value)
    full["on"] = False
    ckpt.save_checkpoint(tmp_path, 1, model=model, state={})
    full["on"] = True
    with pytest.raises(OSError) as second:
        ckpt.save_checkpoint(tmp_path, 2, model=model, state={})
    assert "the previous checkpoint (step_000001) is intact" in str(second.value)
