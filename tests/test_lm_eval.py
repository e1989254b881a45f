"""lm-evaluation-harness against a live server, as evaluation users run it: `lm_eval --model local-completions`
with --batch_size 8 and num_concurrent 4 runs a multiple_choice and a generate_until task (tests/lm_eval_tasks, a
local dataset, no network) to the end, and every per-choice log-likelihood it reports equals transformers' fp32
log-softmax of the same tokens: on the tiny pair here, on the demo target (fp32) in the slow test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from byte_tokenizer import byte_tokenizer
from service import ServerProcess

from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
from dspark_serve.models.random_init import random_pair

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
KEY = "lm-eval-key-0123456789abcdef"
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")


def run_harness(server: ServerProcess, tokenizer: Path, out: Path, max_length: int) -> dict[str, list[dict]]:
    """lm_eval on both tasks -> task -> its logged samples."""
    args = ",".join([f"model={server.model}", f"base_url=http://{server.http_address}/v1/completions",
                     "num_concurrent=4", "max_retries=1", "tokenizer_backend=huggingface", f"tokenizer={tokenizer}",
                     f"max_length={max_length}", "timeout=600"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out / "datasets"), "OPENAI_API_KEY": KEY}
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
           "--tasks", "dspark_tiny_mc,dspark_tiny_gen", "--include_path", str(TASKS), "--batch_size", "8",
           "--output_path", str(out), "--log_samples"]
    proc = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    samples = {}
    for task in ("dspark_tiny_mc", "dspark_tiny_gen"):
        [path] = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    [results] = out.rglob("results_*.json")
    assert set(json.loads(results.read_text())["results"]) == {"dspark_tiny_mc", "dspark_tiny_gen"}
    return samples


def reference_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's split of a (context, continuation) pair into tokens, scored by `model` in fp32: the sum of the
    continuation's log-softmax and whether each of its tokens is the argmax."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n = len(tok(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        lp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)  # [T, V]
    rows, targets = lp[n - 1:len(whole) - 1], torch.tensor(whole[n:])
    return float(rows.gather(1, targets[:, None]).sum()), bool((rows.argmax(-1) == targets).all())


def check(samples: dict[str, list[dict]], model, tok, tol: float) -> float:
    """Every choice's log-likelihood as transformers computes it; -> the largest difference."""
    docs = [json.loads(line) for line in (TASKS / "tiny_mc.jsonl").read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples["dspark_tiny_mc"]) == list(range(len(docs)))
    worst = 0.0
    for s in samples["dspark_tiny_mc"]:
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["arguments"]))]
        assert len(args) == len(docs[s["doc_id"]]["choices"]) == len(s["resps"])
        for a, [[ll, greedy]] in zip(args, s["resps"]):
            want, want_greedy = reference_loglikelihood(model, tok, a["arg_0"], a["arg_1"])
            worst = max(worst, abs(float(ll) - want))
            assert abs(float(ll) - want) <= tol, (s["doc_id"], a, ll, want)
            assert (greedy == "True") == want_greedy
    gens = samples["dspark_tiny_gen"]
    assert len(gens) == 6 and all(isinstance(s["resps"][0][0], str) and "\n" not in s["resps"][0][0] for s in gens)
    return worst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target, draft = random_pair(tmp_path_factory.mktemp("pair"), agree=0.005, block_size=6)
    byte_tokenizer(512).save(str(target / "tokenizer.json"))
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    srv = ServerProcess(target, draft, "--http-port", "0", "--served-model-name", "tiny", "--max-model-len", "2048",
                        "--api-key", KEY)
    srv.model = "tiny"
    yield srv, target
    srv.kill()


def test_lm_eval_runs_both_task_types_with_the_targets_loglikelihoods(tiny, tmp_path):
    server, target = tiny
    samples = run_harness(server, target, tmp_path, 2048)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(target)
    print(f"largest difference from transformers: {check(samples, model, tok, 1e-4):.2e}")


TARGET = demo_target_dir()


@pytest.mark.slow
@pytest.mark.skipif(not (TARGET / ".dspark-converted").is_file(), reason=f"demo target not cached at {TARGET}")
def test_lm_eval_loglikelihoods_on_the_demo_target_equal_transformers_fp32(tmp_path):
    server = ServerProcess(TARGET, DEMO_DRAFTER, "--http-port", "0", "--served-model-name", "qwen", "--dtype",
                           "float32", "--max-model-len", "2048", "--api-key", KEY, timeout_s=900)
    server.model = "qwen"
    try:
        samples = run_harness(server, TARGET, tmp_path, 2048)
    finally:
        server.kill()
    model = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(TARGET)
    print(f"largest difference from transformers: {check(samples, model, tok, 1e-3):.2e}")
