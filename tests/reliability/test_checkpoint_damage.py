"""Torn, bit-flipped and missing checkpoint files, a damaged `latest`, stale temp folders and a full
disk: the loader names what it skips and falls back to the newest intact checkpoint."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from stratarl.infra import checkpoint as ckpt


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


@pytest.fixture
def two_steps(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, model=_model(step), state={"x": step})
    return tmp_path


def _flip_one_bit(path, offset=None):
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_file_has_a_checksum_in_the_manifest(two_steps):
    import json

    manifest = json.loads((two_steps / "step_000002" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model.safetensors", "state.pt"]
    assert all(len(entry["sha256"]) == 64 for entry in manifest["files"].values())


@pytest.mark.parametrize(
    "damage", ["bit flip in model", "bit flip in state", "torn model", "missing state", "damaged manifest"]
)
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(two_steps, damage):
    newest = two_steps / "step_000002"
    if damage == "bit flip in model":
        _flip_one_bit(newest / "model.safetensors")
    elif damage == "bit flip in state":
        _flip_one_bit(newest / "state.pt")
    elif damage == "torn model":
        with open(newest / "model.safetensors", "r+b") as f:
            f.truncate(40)
    elif damage == "missing state":
        (newest / "state.pt").unlink()
    else:
        (newest / "manifest.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(ckpt.CheckpointError, match="step_000002"):
        ckpt.load_checkpoint(newest, model=_model())
    found, skipped = ckpt.find_checkpoint(two_steps)
    assert found == two_steps / "step_000001"
    assert len(skipped) == 1 and "step_000002" in skipped[0]
    model = _model(5)
    assert ckpt.load_checkpoint(found, model=model)["x"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), _model(1).parameters()))


@pytest.mark.parametrize("pointer", [b"", b"step_999999\n", b"\xff\xfe\x00binary"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_step(two_steps, pointer):
    (two_steps / "latest").write_bytes(pointer)
    found, skipped = ckpt.find_checkpoint(two_steps)
    assert found == two_steps / "step_000002"
    assert skipped == [f"{two_steps / 'latest'} does not name a checkpoint folder"]


def test_no_intact_checkpoint_is_none_with_reasons(two_steps):
    for step in (1, 2):
        _flip_one_bit(two_steps / f"step_00000{step}" / "state.pt")
    found, skipped = ckpt.find_checkpoint(two_steps)
    assert found is None and len(skipped) == 2 and all("sha256" in line for line in skipped)


def test_resave_keeps_a_complete_copy_when_the_switch_fails(two_steps, monkeypatch):
    real = os.replace
    calls = []

    def fail_second(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the old folder is moved aside; the new one does not arrive
            raise OSError(errno.EIO, "simulated I/O error")
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", fail_second)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(two_steps, 2, model=_model(7), state={"x": 7})
    monkeypatch.setattr(ckpt.os, "replace", real)
    found, _ = ckpt.find_checkpoint(two_steps)
    assert found is not None and found.name == "step_000002" and found.parent != two_steps
    assert ckpt.load_checkpoint(found, model=_model())["x"] == 2  # the old copy, intact
    back = ckpt.reinstate(found)
    assert back == two_steps / "step_000002" and ckpt.latest_checkpoint(two_steps) == back
    assert not [p for p in two_steps.iterdir() if p.name.startswith(".replaced")]


def test_stale_temp_folders_are_removed_by_the_next_save(two_steps):
    stale = two_steps / ".step_000003-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    ckpt.save_checkpoint(two_steps, 3, model=_model(), state={})
    assert not stale.exists()
    assert sorted(p.name for p in two_steps.iterdir()) == ["latest", "step_000002", "step_000003"]


def test_disk_full_is_named_and_leaves_the_previous_checkpoint(two_steps, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "save_model", full)
    with pytest.raises(OSError, match="disk full while writing a checkpoint"):
        ckpt.save_checkpoint(two_steps, 3, model=_model(), state={})
    assert ckpt.find_checkpoint(two_steps) == (two_steps / "step_000002", [])
    assert not [p for p in two_steps.iterdir() if p.name.startswith(".")]


def test_torch_save_enforce_failure_on_a_full_disk_reads_disk_full(two_steps, monkeypatch):
    def enforce_fail(*args, **kwargs):  # what torch.save raises when the disk fills mid-write
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt.torch, "save", enforce_fail)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: _Usage(0))
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(two_steps, 3, model=_model(), state={})


def test_safetensors_storage_full_reads_disk_full(two_steps, monkeypatch):
    from safetensors import SafetensorError

    def storage_full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(ckpt, "save_model", storage_full)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(two_steps, 3, model=_model(), state={})
    assert ckpt.find_checkpoint(two_steps) == (two_steps / "step_000002", [])


def test_a_legacy_folder_without_manifest_with_a_torn_model_is_skipped(two_steps):
    legacy = two_steps / "step_000002"
    (legacy / "manifest.json").unlink()
    with open(legacy / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckpt.CheckpointError, match="cannot be read"):
        ckpt.load_checkpoint(legacy, model=_model())


class _Usage:
    def __init__(self, free):
        self.free = free


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only folders")
def test_unwritable_checkpoint_folder_is_named(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError, match="cannot write a checkpoint"):
            ckpt.save_checkpoint(tmp_path / "checkpoints", 1, model=_model(), state={})
    finally:
        tmp_path.chmod(0o700)
