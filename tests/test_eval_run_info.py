"""eval/run_info and eval/records: the recorded commit ignores the run's own output, run_info keeps a killed
invocation, appends survive a cut line, the recorded command names the launcher."""

import json
import os
import subprocess
import sys

from eval.records import append_jsonl
from eval.run_info import command_line, update_run_info


def test_git_commit_ignores_the_runs_own_output(tmp_path, monkeypatch):
    """run_info's commit: results the run writes into its out dir do not mark it dirty; other changes do."""
    import eval.run_info as run_info

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q"], cwd=repo, check=True)
    subprocess.run(git + ["add", "."], cwd=repo, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "init"], cwd=repo, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(run_info, "REPO_ROOT", str(repo))
    assert run_info.git_commit() == head
    out = repo / "results" / "run1"
    out.mkdir(parents=True)
    (out / "scores.json").write_text("{}")
    assert run_info.git_commit() == head + "+dirty"
    assert run_info.git_commit(exclude=str(out)) == head
    (repo / "eval" / "results").mkdir(parents=True)
    (repo / "eval" / "results" / "other_run.json").write_text("{}")  # another run's output: not code either
    assert run_info.git_commit(exclude=str(out)) == head
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert run_info.git_commit(exclude=str(out)) == head + "+dirty"


def test_run_info_keeps_a_killed_invocation_and_append_survives_a_cut_line(tmp_path):
    """A run records its command and commit when it starts (a run killed later still has them) and its runtime when
    it ends; a record appended after a line cut by a kill starts on its own line and stays readable."""
    from eval.longbench.predictions import read_records

    out = str(tmp_path)
    update_run_info(out, "2026-01-01T00:00:00", {"command": "run A", "commit": "aaa", "status": "running"})
    update_run_info(out, "2026-01-01T01:00:00", {"command": "run B", "commit": "bbb", "status": "running"})
    update_run_info(
        out,
        "2026-01-01T01:00:00",
        {"runtime_s": 12.5, "status": "finished"},
        {"methods": {"fp16": {"kind": "dynamic"}}, "args": {}, "max_new_tokens": {}},
    )
    info = json.load(open(os.path.join(out, "run_info.json")))
    assert [x["command"] for x in info["invocations"]] == ["run A", "run B"]
    assert [x["status"] for x in info["invocations"]] == ["running", "finished"]
    assert info["command"] == "run A" and info["commit"] == "aaa"
    assert info["runtime_s"] == 12.5 and info["unfinished_invocations"] == 1
    assert info["invocations"][1]["commit"] == "bbb" and list(info["config"]["methods"]) == ["fp16"]

    pdir = os.path.join(out, "parts", "qasper", "fp16")
    os.makedirs(pdir)
    path = os.path.join(pdir, "rank0.jsonl")
    append_jsonl(path, {"_id": "a", "score": 1.0})
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"_id": "b", "sco')  # killed mid-write
    append_jsonl(path, {"_id": "c", "score": 0.5})
    assert sorted(read_records(out, "qasper", "fp16")) == ["a", "c"]


def test_run_info_resumed_keeps_the_earlier_invocations_hardware_and_config(tmp_path):
    out = str(tmp_path)
    with open(os.path.join(out, "run_info.json"), "w") as f:
        first = {"command": "eval/needle.py --out-dir x", "commit": "old", "runtime_s": 60.0, "status": "finished"}
        json.dump({"invocations": [first], "hardware": {"cpu_count": 2}, "config": {"args": {"seed": 0}}}, f)
    update_run_info(
        out,
        "2026-01-02T00:00:00",
        {"command": "python -m eval.needle --out-dir x", "commit": "new", "runtime_s": 5.0, "status": "finished"},
    )
    info = json.load(open(os.path.join(out, "run_info.json")))
    assert [x["commit"] for x in info["invocations"]] == ["old", "new"]
    assert info["command"] == "eval/needle.py --out-dir x" and info["runtime_s"] == 65.0
    assert info["hardware"] == {"cpu_count": 2} and info["config"] == {"args": {"seed": 0}}


def test_command_line_names_the_launcher(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/somewhere/eval/longbench/__main__.py", "--out-dir", "x"])
    for k in [k for k in os.environ if k.startswith("ACCELERATE_")] + ["WORLD_SIZE"]:
        monkeypatch.delenv(k, raising=False)
    assert command_line("eval.longbench") == "python -m eval.longbench --out-dir x"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert command_line("eval.longbench") == "torchrun --nproc_per_node 2 -m eval.longbench --out-dir x"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert command_line("eval.longbench") == "accelerate launch --num_processes 2 -m eval.longbench --out-dir x"
