"""Faults are not rewards: rollouts whose searches failed in the retriever are kept out of the update;
a step where their share passes retrieval.max_failed_fraction takes no optimizer step, says so in its
metrics, and the checkpoint after a faulty stretch holds the last healthy update. A remote retriever is
probed before any work, and a hanging one costs at most the step budget per step, then stops the run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from fault_injection import TINY, SearchThenAnswerGenerator, remote_spec, run_cli, scripted_parts, scripted_policy

from stratarl.rollout.collect import CollectedBatch, faulty_rollouts, without_rollouts
from stratarl.rollout.engine import Rollout
from stratarl.trainer.step import fault_metrics


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _snapshot(run) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": copy.deepcopy(run.learner.optimizer.state_dict()),
        "scheduler": copy.deepcopy(run.learner.scheduler.state_dict()),
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key], rtol=0, atol=0)
    torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0, atol=0)
    assert a["scheduler"] == b["scheduler"]


def _train_with_outage(tmp_path, monkeypatch, base_overrides, server, failing_steps, extra=()):
    """Train against ``server``, failing during ``failing_steps``; returns (summary, state before each step)."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train
    from stratarl.trainer.step import rl_step

    before: dict[int, dict] = {}

    def spy(run):
        server.failing = run.step + 1 in failing_steps
        before[run.step + 1] = _snapshot(run)
        return rl_step(run)

    cfg = load_config(TINY, [*base_overrides, remote_spec(server.url, max_retries=0), *extra])
    summary = train(cfg, tmp_path / "run", parts=scripted_parts(), step=spy)
    return summary, before


def test_an_outage_of_two_steps_leaves_weights_and_optimizer_untouched(
    flaky_server, tmp_path, monkeypatch, base_overrides, capsys
):
    summary, before = _train_with_outage(
        tmp_path, monkeypatch, base_overrides, flaky_server, {2, 3}, ["trainer.steps=4", "trainer.save_every=0"]
    )
    assert summary["exit_code"] == 0 and summary["steps"] == 4
    _assert_same(before[2], before[4])  # steps 2 and 3 (the outage) changed nothing
    with pytest.raises(AssertionError):  # while healthy steps do move the weights and the optimizer
        _assert_same(before[1], before[2])
    rows = [r for r in _rows(tmp_path / "run") if "update/skipped" in r]
    assert [r["update/skipped"] for r in rows] == [0.0, 1.0, 1.0, 0.0]
    assert [r["retrieval/faulty_rollout_frac"] for r in rows] == [0.0, 1.0, 1.0, 0.0]
    assert "loss/policy" not in rows[1] and "loss/policy" in rows[3]
    out = capsys.readouterr()
    assert "step 2/4" in out.out and "no update (retrieval faults)" in out.out
    assert "warning: step 2: 4 of 4 searches failed" in out.err and "the step took no update" in out.err


def test_a_stop_in_an_outage_checkpoints_the_last_healthy_update(flaky_server, tmp_path, monkeypatch, base_overrides):
    from stratarl.trainer.stops import RETRIEVAL_STOP_CODE

    summary, before = _train_with_outage(
        tmp_path,
        monkeypatch,
        base_overrides,
        flaky_server,
        {2, 3, 4, 5},
        ["trainer.steps=5", "trainer.save_every=1", "retrieval.max_failed_steps=2"],
    )
    assert summary["exit_code"] == RETRIEVAL_STOP_CODE and summary["steps"] == 3
    ckpts = tmp_path / "run" / "checkpoints"
    assert summary["checkpoint"] == str(ckpts / "step_000001") and summary["checkpoint_step"] == 1
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000001"]  # none for the skipped steps
    assert "2 consecutive steps" in summary["retrieval_failure"] and flaky_server.url in summary["retrieval_failure"]
    # The checkpoint is the state after step 1, the sampler included: a resume redoes steps 2 and 3.
    state = torch.load(ckpts / "step_000001" / "state.pt", weights_only=True)
    assert state["step"] == 1 and state["scheduler"] == before[2]["scheduler"]
    from stratarl.infra.checkpoint import DataSampler

    sampler = DataSampler(8, 0)
    sampler.next(2)  # step 1's prompts
    assert state["sampler"] == sampler.state_dict()


def test_a_resume_after_the_outage_ends_where_a_run_without_it_ends(
    flaky_server, tmp_path, monkeypatch, base_overrides
):
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train

    overrides = [*base_overrides, remote_spec(flaky_server.url, max_retries=0), "trainer.steps=3"]
    parts = scripted_parts()
    straight = train(load_config(TINY, overrides), tmp_path / "straight", parts=parts)
    flaky_server.failing = True  # an outage from step 1 on: the run stops at once with step 0 checkpointed
    stopped = train(load_config(TINY, [*overrides, "retrieval.max_failed_steps=1"]), tmp_path / "resumed", parts=parts)
    assert stopped["exit_code"] == 3 and stopped["checkpoint_step"] == 0
    flaky_server.failing = False
    resumed = train(load_config(TINY, overrides), tmp_path / "resumed", resume=True, parts=parts)
    assert resumed["start_step"] == 0 and resumed["steps"] == 3
    from fault_injection import compare_runs

    assert compare_runs(tmp_path / "straight", tmp_path / "resumed", 3) == []
    assert straight["final"]["reward/mean"] == resumed["final"]["reward/mean"]


def test_faulty_rollouts_are_kept_out_of_the_batch():
    rollouts = [
        Rollout([1], tool_errors=0, num_searches=0),
        Rollout([2], tool_errors=1, num_searches=1),
        Rollout([3], tool_errors=0, num_searches=2),
    ]
    assert faulty_rollouts(rollouts) == [False, True, False]  # asking nothing is not a fault
    batch = CollectedBatch(
        rollouts, ["e0", "e1", "e2"], [0, 0, 1], [1.0, 0.0, 0.5], [1.0, 0.0, 0.0], [0, 1, 2], 1.0, 2.0
    )
    kept = without_rollouts(batch, faulty_rollouts(rollouts))
    assert (kept.rollouts, kept.examples, kept.group_ids, kept.rewards, kept.em, kept.strata) == (
        [rollouts[0], rollouts[2]],
        ["e0", "e2"],
        [0, 1],
        [1.0, 0.5],
        [1.0, 0.0],
        [0, 2],
    )
    assert len(batch.rollouts) == 3  # the argument is not changed


@pytest.mark.parametrize(
    "faulty, fraction, mini_batches, skipped",
    [
        ([False] * 4, 0.5, 2, 0.0),
        ([True, True, False, False], 0.5, 2, 0.0),  # exactly the fraction: still updates, on the 2 clean ones
        ([True, True, True, False], 0.5, 2, 1.0),  # passes it
        ([True, False, False, False], 0.0, 1, 1.0),  # max_failed_fraction=0: any fault skips
        ([True, False, False, False], 0.5, 4, 1.0),  # 3 clean rollouts cannot fill 4 mini-batches
    ],
)
def test_fault_metrics(faulty, fraction, mini_batches, skipped):
    metrics = fault_metrics(faulty, fraction, mini_batches)
    assert metrics == {"retrieval/faulty_rollout_frac": sum(faulty) / 4, "update/skipped": skipped}


def test_the_scripted_policy_searches_then_answers():
    class Tok:
        def decode(self, ids):
            return "".join(ids)

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text)}

    generator = SearchThenAnswerGenerator(Tok())
    (first,) = generator.generate([list("question")], None, [100])
    (second,) = generator.generate([list("question</information>\n\n")], None, [100])
    assert "".join(first.token_ids).startswith("<search>") and "".join(second.token_ids).startswith("<answer>")


BUDGET_S = 0.5
MARGIN_S = 1.0
"""What a step may spend in searches beyond retrieval.step_budget_s: the last attempt's connect and the
scheduling of a loaded machine (the unbudgeted cost here would be 5 s timeout x 2 attempts per search)."""


def test_a_hanging_server_costs_the_budget_per_step_then_stops_the_cli_with_exit_3(
    hanging_server, tmp_path, monkeypatch, base_overrides, capsys
):
    scripted_policy(monkeypatch)
    run_dir = tmp_path / "run"
    code, err = run_cli(
        [
            "train",
            str(TINY),
            *base_overrides,
            remote_spec(hanging_server.url),
            "trainer.steps=5",
            "trainer.save_every=0",
            "retrieval.max_failed_steps=2",
            f"retrieval.step_budget_s={BUDGET_S}",
            "--run-dir",
            str(run_dir),
            "--no-retriever-check",
        ]
    )
    assert code == 3
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["update/skipped"] == 1.0 for r in rows)
    assert all(r["time/retrieval"] <= BUDGET_S + MARGIN_S for r in rows)
    assert (run_dir / "checkpoints" / "step_000000" / "manifest.json").is_file()
    error = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and hanging_server.url in error[0] and "timed out" in error[0]
    spent = float(error[0].split(" s spent in searches")[0].rsplit("(", 1)[1])
    assert 0 < spent <= 2 * (BUDGET_S + MARGIN_S)
    assert error[0].count("Fix:") == 1


def test_the_cli_probes_a_remote_retriever_before_any_work(hanging_server, dead_url, tmp_path, base_overrides):
    # Exit code 3, as when retrieval failures stop a run during training.
    for url, why in ((dead_url, "ConnectError"), (hanging_server.url, "no answer within 0.5 s")):
        run_dir = tmp_path / why.split()[0]
        code, err = run_cli(
            ["train", str(TINY), *base_overrides, remote_spec(url, timeout_s=0.5), "--run-dir", str(run_dir)]
        )
        error = [line for line in err.splitlines() if "error:" in line]
        assert code == 3 and len(error) == 1 and url in error[0] and why in error[0], err
        assert "--no-retriever-check" in error[0] and error[0].count("Fix:") == 1
        assert "Fix: start the server" in error[0]
        assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "sft").exists()
    code, err = run_cli(["eval", str(TINY), *base_overrides, remote_spec(dead_url, timeout_s=0.5)])
    assert code == 3 and dead_url in err and "probe search" in err


def test_the_probe_says_what_a_failing_or_wrong_server_answered(flaky_server, tmp_path, base_overrides):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    flaky_server.failing = True
    code, err = run_cli(
        ["train", str(TINY), *base_overrides, remote_spec(flaky_server.url), "--run-dir", str(tmp_path / "a")]
    )
    assert code == 3 and err.splitlines()[-1] == (
        f"error: retrieval.spec: the probe search to {flaky_server.url} failed (the server answered HTTP 500: "
        '{"error": "outage"}). Fix: the server is running but failing: see its log; --no-retriever-check skips '
        "this check"
    )

    class Html(BaseHTTPRequestHandler):
        def do_POST(self):
            payload = b"<html>not a retriever</html>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    try:
        code, err = run_cli(["train", str(TINY), *base_overrides, remote_spec(url), "--run-dir", str(tmp_path / "b")])
    finally:
        server.shutdown()
        server.server_close()
    assert code == 3 and err.splitlines()[-1] == (
        f"error: retrieval.spec: the probe search to {url} failed (the reply is not JSON: '<html>not a retriever"
        "</html>'). Fix: correct retrieval.spec (the URL of a stratarl or Search-R1 /retrieve server); "
        "--no-retriever-check skips this check"
    )
