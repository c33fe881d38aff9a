"""``specenv abtest``: bad arguments end with one line and exit code 2 before any engine starts; the table."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specenv.cli import app


def _invoke(args: list[str]):  # noqa: ANN202
    return CliRunner().invoke(app, ["abtest", *args])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch", "1,x"], "--batch"),
        (["--batch", "0"], "--batch"),
        (["--arms", "plain,nope"], "--arms: unknown arm group 'nope'"),
        (["--arms", "fixedctl,nope"], "--arms: unknown arm group 'nope'"),  # (fixedctl: a group, opt-in)
        (["--fit", "guess"], "--fit: unknown mode 'guess'"),
        (["--prompts", "100000"], "--prompts"),
        (["--prompts", "11", "--traces", "live-vllm-wide", "--models", "wide-moe-v1"], "--cycle-prompts"),
        (["--train-prompts", "100000"], "--train-prompts"),
        (["--kmax", "99"], "--kmax"),
        (["--cost-model", "nowhere.json"], "--cost-model"),
        (["--models", "no-such-models"], "--models"),
        (["--traces", "no-such-set"], "no-such-set"),
        (["--repeats", "0"], "--repeats"),
        (["--fit-repeats", "0"], "--fit-repeats"),
        (["--fit-repeats", "many"], "--fit-repeats"),
        (["--fit-kmax", "0"], "--fit-kmax"),
        (["--fit-kmax", "5", "--kmax", "4"], "--fit-kmax: 5 exceeds the run's kmax 4"),
        (["--policy-dir", "/no/such/dir"], "--policy-dir"),
        (["--fit-from", "/no/such/abtest.json"], "--fit-from"),
        (["--step-model", "/no/such/dir"], "--step-model: /no/such/dir: cannot read batch cost model: no such file"),
        (["--step-model", "no-such-recording"], "--step-model: no-such-recording: no such file or folder"),
        # the small models' forward-time fit has no plain engine step: not a step-time model
        (["--step-model", "live-vllm-batch-v1"], "--step-model: live-vllm-batch-v1: not a step-time model"),
        # a wide recording for the small models (the same shape, another target)
        (["--step-model", "live-vllm-wide-batch-v5"], "recorded on 'wide-moe-v1', not 'small-moe-v1'"),
        (
            [
                "--step-model",
                "live-vllm-wide-batch-v5",
                "--models",
                "wide-moe-v1",
                "--traces",
                "live-vllm-wide",
                "--batch",
                "1,32",
            ],
            "recorded up to batch 16, not 32",
        ),
        (["--learned", "no-such-set/ppo"], "--learned: unknown policy 'no-such-set/ppo'"),
        (["--learned", "live-vllm-v1/ppo,,"], "--learned: unknown policy ''"),
        (["--interleave", "request"], "--interleave: unknown unit 'request'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    res = _invoke(args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_all_runs_every_group_but_the_opt_in_ones() -> None:
    from specenv.abtest import ALL_GROUPS, ARM_GROUPS, AbtestOptions

    assert "fixedctl" in ARM_GROUPS and "fixedctl" not in ALL_GROUPS
    assert set(ARM_GROUPS) - set(ALL_GROUPS) == {"fixedctl"}
    assert AbtestOptions().arms == list(ALL_GROUPS)


def test_markdown_table_rows_and_refusals() -> None:
    from specenv.abtest import ADAPTIVE_WHY, markdown

    ovh = {"value": 0.004, "ci95": [0.003, 0.005], "cpu_ms_per_step": 0.05, "step_ms": 12.0}
    doc = {
        "test_prompts": [1, 2],
        "options": {"max_tokens": 16, "repeats": 3, "models": "small-moe-v1"},
        "kmax": 2,
        "duration_s": 12.0,
        "rows": [
            {
                "arm": "plain (no speculation)",
                "batch": 1,
                "group": "plain",
                "tok_per_s": 100.0,
                "live_speedup": 1.0,
                "predicted": 1.0,
                "live_over_pred": 1.0,
                "identical": True,
            },
            {
                "arm": "delta rule (oracle lambda)",
                "batch": 1,
                "group": "delta",
                "tok_per_s": 120.0,
                "live_speedup": 1.2,
                "predicted": 1.25,
                "live_over_pred": 0.96,
                "decode_speedup": 1.1,
                "predicted_decode": 1.15,
                "identical": False,
                "ctl_cpu_frac": ovh,
            },
        ],
        "adaptive_verification": ADAPTIVE_WHY,
        "refused": [{"policy": "ppo", "folder": "x", "reason": "trained for 128 experts"}],
        "overhead": {},
        "fit": {"mode": "replay", "replay_best_k": 2, "best_k": {"1": 2}},
        "notes": ["n"],
        "load": {"passes": 6, "min": 0.5, "median": 1.25, "max": 2.0},
    }
    text = markdown(doc)
    assert "Machine load (1-minute average after each of 6 passes): median 1.25, range 0.50-2.00." in text
    assert "Machine load: not recorded." in markdown({k: v for k, v in doc.items() if k != "load"})
    assert (
        "| delta rule (oracle lambda) | 1 | 120.0 | 1.200 | 1.250 | 0.960 | 1.100 / 1.150 | NO | 0.40% [0.30%, 0.50%] |"
        in text
    )
    assert "| plain (no speculation) | 1 | 100.0 | 1.000 | 1.000 | 1.000 | - / - | yes | - |" in text
    assert "refused: trained for 128 experts" in text
    assert "GPU (V2) model runner" in text


def test_a_cost_model_file_that_is_not_one_is_refused_with_one_line(tmp_path) -> None:
    bad = tmp_path / "cm.json"
    bad.write_text("not json")
    res = _invoke(["--cost-model", str(bad)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specenv: error: --cost-model:") and "cm.json" in lines[0], (
        res.stderr
    )


def test_learned_names_are_the_shipped_folders_by_set() -> None:
    """``--learned`` picks among the shipped policies of the trace set and of live-vllm, named set/policy."""
    from pathlib import Path

    from specenv.abtest import learned_policies

    shipped = Path(__file__).resolve().parents[1] / "policies" / "shipped"
    names = learned_policies("live-vllm-wide")
    # every policy folder (a policy.json) of the two sets, and nothing else
    want = {
        f"{d.name}/{p.parent.name}"
        for d in (shipped / "live-vllm-wide-v1", shipped / "live-vllm-v1")
        for p in d.glob("*/policy.json")
    }
    assert set(names) == want and "live-vllm-wide-v1/ppo" in names
    assert all(Path(f, "policy.json").is_file() for f in names.values())


def test_step_model_folder_made_here(tmp_path) -> None:
    """A recording folder (``batchcost.json`` + manifest) is taken by path, checked against --models."""
    import json
    import shutil

    from specenv.abtest import step_model_for
    from specenv.cost.batch import load_batch_cost_model
    from specenv.io import package_data

    src = package_data("live-vllm-wide-batch-v5")
    folder = tmp_path / "rec"
    folder.mkdir()
    shutil.copy(src / "batchcost.json", folder / "batchcost.json")
    manifest = json.loads((src / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    name, model = step_model_for("wide-moe-v1", str(folder), 8, [1, 4, 8])
    assert name == str(folder)
    shipped = load_batch_cost_model("live-vllm-wide-batch-v5")
    assert model.ar_step == shipped.ar_step and model.max_batch == 16
    # the JSON file alone (no manifest beside it in another folder) is taken too
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(src / "batchcost.json", lone / "model.json")
    assert step_model_for("wide-moe-v1", str(lone / "model.json"), 8, [16])[1].ar_step == shipped.ar_step
    # a manifest naming other models is refused, naming both
    manifest["extra"]["models"] = "small-moe-v1"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="recorded on 'small-moe-v1', not 'wide-moe-v1'"):
        step_model_for("wide-moe-v1", str(folder), 8, [1])
    # an unreadable manifest beside the model: one line naming it
    (folder / "manifest.json").write_text("not json")
    with pytest.raises(ValueError, match="manifest.json"):
        step_model_for("wide-moe-v1", str(folder), 8, [1])
    # a kmax above the model's
    with pytest.raises(ValueError, match="kmax 8 < the served kmax 12"):
        step_model_for("small-moe-v1", str(folder), 12, [1])


def test_a_timed_run_after_another_engine_is_warmed_up_first() -> None:
    """An engine switched to decodes its first prompt untimed before the timed pass; not otherwise."""
    from specenv.abtest import timed_run

    class Stub:
        def __init__(self, cfg: dict) -> None:
            self.cfg, self.calls = cfg, []

        def call(self, **cmd):  # noqa: ANN003, ANN202
            self.calls.append(cmd)
            return {"wall_s": 1.0}

    a, b, rec = Stub({"k": 0}), Stub({"k": 4}), Stub({"k": 4, "settings": {"record": "/tmp/r"}})
    timed = {"op": "run", "prompt_ids": [5, 8], "max_tokens": 128, "batch": 2, "ignore_eos": False}
    warm = {"op": "run", "prompt_ids": [5], "max_tokens": 16, "batch": 1, "ignore_eos": True}
    assert timed_run(a, None, [5, 8], 2, 128, False, 16) == {"wall_s": 1.0}  # the first run: nothing before it
    assert a.calls == [timed]
    timed_run(a, a, [5, 8], 2, 128, False, 16)  # the same engine again: no warm-up
    assert a.calls == [timed, timed]
    timed_run(b, a, [5, 8], 2, 128, False, 16)  # switched: the warm-up, then the timed pass
    assert b.calls == [warm, timed]
    timed_run(a, b, [5, 8], 2, 128, False, 0)  # --warmup-tokens 0: off
    assert a.calls == [timed, timed, timed]
    timed_run(rec, a, [5, 8], 2, 128, False, 16)  # a recording engine records the timed requests only
    assert rec.calls == [timed]
