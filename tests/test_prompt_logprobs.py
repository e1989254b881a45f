"""Prompt logprobs: each prompt token's logprob under the target alone equals transformers' log-softmax of the same
tokens in fp32, prompt by prompt chunk or whole, batched with requests that ask none; asking changes no output."""

import pytest
import torch
from engine_pairs import build_pair

from dspark_serve.engine import prompt_logprobs as pl
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.prompt_logprobs import chunk_prompt_logprobs
from dspark_serve.engine.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, rope_theta=10000.0)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    return path, model


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T - 1, V]: row j is log_softmax of the logits after ids[:j + 1] (fp32)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple[list, list[int]]]:
    """Every request to its end through the scheduler: id -> (its prompt logprobs or None, its tokens)."""
    ids = []
    for prompt, p in zip(prompts, params):
        req = llm.new_request(prompt, p)
        llm.core.add(req)
        ids.append(req.request_id)
    got = {rid: [None, []] for rid in ids}
    while llm.has_unfinished():
        for out in llm.core.step():
            if out.prompt_logprobs is not None:
                assert got[out.request_id][0] is None  # once
                got[out.request_id][0] = out.prompt_logprobs
            got[out.request_id][1] += out.new_token_ids
    return {rid: tuple(got[rid]) for rid in ids}


def _check(entries: list[tuple], prompt: list[int], ref: torch.Tensor, num_top: int, tol: float) -> None:
    assert len(entries) == len(prompt) and entries[0] == (prompt[0], None, [], None)
    for j, (tok, lp, top, rank) in enumerate(entries[1:]):
        want = ref[j]
        assert tok == prompt[j + 1] and abs(lp - float(want[tok])) <= tol, (j, lp, float(want[tok]))
        assert rank == int((want > want[tok]).sum()) + 1
        assert [i for i, _ in top] == want.topk(num_top).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), want.topk(num_top).values, rtol=0, atol=tol)


@pytest.mark.parametrize("chunk", [512, 7], ids=["one-chunk", "chunks-of-7"])
def test_prompt_logprobs_equal_transformers_in_fp32(hf_dir, monkeypatch, chunk):
    monkeypatch.setattr(pl, "PROMPT_CHUNK_TOKENS", chunk)
    path, model = hf_dir
    llm = LLM(path, device="cpu", block_size=8, num_kv_blocks=128, dtype="float32")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 1, 15, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5),
              SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=4),  # asks none: batched beside the others
              SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0, logit_bias=((5, 50.0),))]
    outs = list(_run(llm, prompts, params).values())
    for prompt, p, (entries, tokens) in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert entries is None
            continue
        _check(entries, prompt, _hf_logprobs(model, prompt), p.prompt_logprobs, 1e-5)
        # the first token comes from the same last position (greedy: its argmax), and raw: logit_bias is not in it
        with torch.no_grad():
            last = model(torch.tensor([prompt])).logits[0, -1]
        assert tokens[0] == (5 if p.logit_bias else int(last.argmax()))
    alone = _run(llm, prompts[2:3], [params[2]])
    assert list(alone.values())[0][1] == outs[2][1]


def test_chunks_add_up_to_the_whole_prompt():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 50, (11,), generator=g).tolist()
    logits = torch.randn(11, 50, generator=g)
    whole = chunk_prompt_logprobs(logits, tokens, None, 3, first=True)
    parts = (chunk_prompt_logprobs(logits[:4], tokens[:4], tokens[4], 3, first=True)
             + chunk_prompt_logprobs(logits[4:9], tokens[4:9], tokens[9], 3, first=False)
             + chunk_prompt_logprobs(logits[9:], tokens[9:], None, 3, first=False))
    assert len(whole) == 11 and parts == whole
    assert chunk_prompt_logprobs(logits[:1], tokens[:1], None, 3, first=True) == [(tokens[0], None, [], None)]


def test_asking_for_prompt_logprobs_changes_no_speculative_output(monkeypatch):
    """The draft takes the chunked prefill's features: greedy speculative output, tau and all, is the same."""
    monkeypatch.setattr(pl, "PROMPT_CHUNK_TOKENS", 5)
    target, draft = build_pair(seed=5, agree=0.005)
    llm = LLM(target, draft, device="cpu", block_size=8, num_kv_blocks=256)
    prompts = [[3, 4, 5, 3, 4, 9, 9, 1, 2, 3, 50, 60], [7, 8]]
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    asking = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)] * 2
    want = [t for _, t in _run(llm, prompts, plain).values()]
    got = list(_run(llm, prompts, asking).values())
    assert [t for _, t in got] == want and all(len(e) == len(p) for (e, _), p in zip(got, prompts))


@pytest.mark.slow
def test_prompt_logprobs_on_the_demo_target_equal_transformers_fp32():
    from dspark_serve.models.demo import demo_target_dir

    target = demo_target_dir()
    if not (target / ".dspark-converted").is_file():
        pytest.skip(f"demo target not cached at {target}")
    llm = LLM(target, device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = llm.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n")
    [(entries, _)] = _run(llm, [prompt], [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)]).values()
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    _check(entries, prompt, _hf_logprobs(model, prompt), 5, 1e-3)
