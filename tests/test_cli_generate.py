"""`dspark-serve generate` offline: JSON output equal to plain greedy, and one-line errors for bad arguments."""

import json
import subprocess
import sys

import pytest
import torch

from dspark_serve.engine.reference import greedy_generate
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.draft_saver import save_draft
from dspark_serve.models.random_init import random_pair
from dspark_serve.models.target_loader import load_target


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_serve.cluster.commands", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return random_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize("fmt", ["deepspec", "vllm-names"])
def test_generate_json_equals_plain_greedy(pair, tmp_path, fmt):
    target_dir, draft_dir = pair
    if fmt != "deepspec":  # the same draft re-saved in another format works as given
        draft_dir = save_draft(load_draft(draft_dir, target=load_target(target_dir)), tmp_path / "d", "vllm")
    proc = _cli("generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt-ids", "1,2,3",
                "--max-tokens", "10", "--json", "--device", "cpu", "--speculative-config", '{"num_speculative_tokens": 3}')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == greedy_generate(load_target(target_dir, dtype=torch.float32), [1, 2, 3], 10)
    s = out["stats"]
    assert out["finish_reason"] == "length" and len(s["accepted_per_step"]) == s["steps"]
    assert s["accepted"] == sum(s["accepted_per_step"]) and len(s["per_position_accepted"]) == 3
    assert abs(s["tau"] - (s["accepted"] + s["steps"]) / s["steps"]) < 1e-9


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--prompt-ids", "1", "--speculative-config", "{bad"], "speculative_config is not valid JSON"),
    (["--prompt-ids", "1", "--speculative-config", '{"num_speculative_tokens": 9}'], "num_speculative_tokens must be in [1, 4]"),
    (["--prompt-ids", "99999"], "prompt token ids must be in [0, 512)"),
    (["--prompt", "hello"], "a text prompt needs a tokenizer"),
    ([], "give exactly one of --prompt or --prompt-ids"),
])
def test_bad_arguments_exit_nonzero_with_one_line(pair, args, message):
    target_dir, draft_dir = pair
    proc = _cli("generate", "--target", str(target_dir), "--draft", str(draft_dir), "--device", "cpu", *args)
    assert proc.returncode != 0
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_missing_checkpoint_is_named(tmp_path):
    proc = _cli("generate", "--target", str(tmp_path / "nope"), "--prompt-ids", "1", "--device", "cpu")
    assert proc.returncode != 0 and "config file not found" in proc.stderr


@pytest.mark.parametrize("cmd", [["serve", "--target", "x"], ["generate", "--server", "127.0.0.1:1", "--prompt-ids", "1"]])
def test_bad_speculative_config_json_is_rejected_before_any_work(cmd):
    proc = _cli(*cmd, "--speculative-config", "{bad json")
    assert proc.returncode != 0 and "speculative_config is not valid JSON" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_demo_runs_and_speculation_is_lossless():
    proc = _cli("demo", "--tiny", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "identical to plain greedy" in ln]
    assert len(lines) == 3 and all(ln.endswith("True") for ln in lines)
    assert "speculative" in proc.stdout and "speedup" in proc.stdout


def test_demo_bad_arguments_are_one_line_errors(tmp_path):
    proc = _cli("demo", "--num-prompts", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == "dspark-serve demo: error: --num-prompts must be in [1, 4]"
    proc = _cli("demo", "--target", str(tmp_path), "--draft", str(tmp_path / "none"))
    assert proc.returncode == 1 and f"no draft checkpoint at {tmp_path / 'none'}" in proc.stderr
