"""The runners' Triton fast path (fused norms/RoPE/SwiGLU, one-GEMM q/k/v and gate/up, Triton paged attention)
against the models' plain modules, under the CPU interpreter in fp32: the same hidden states, features and tokens.

Reruns itself in a child process with TRITON_INTERPRET=1 (see tests/interpreter.py); KernelConfig(triton=True) turns
the fast path on for CPU tensors there.
"""

from dataclasses import replace

import pytest
import torch

from interpreter import INTERPRETED, rerun_under_interpreter

if not INTERPRETED:
    def test_fused_model_under_interpreter():
        rerun_under_interpreter(__file__)
else:
    import dspark_serve.engine.runner.fused_layers as fused_layers
    import dspark_serve.kernels.paged_attention_triton as pat
    from dspark_serve.engine.kv_cache import batch_metadata
    from dspark_serve.engine.llm import LLM
    from dspark_serve.engine.runner.draft_runner import DraftRunner
    from dspark_serve.engine.runner.target_runner import TargetRunner
    from dspark_serve.kernels.config import KernelConfig
    from dspark_serve.engine.sampling_params import SamplingParams
    from dspark_serve.models.qwen import QwenForCausalLM
    from dspark_serve.models.random_init import _randomize, tiny_pair, tiny_target_config

    TABLES = [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]  # block size 8: 56 slots per request
    # prefill (prompt SDPA), decode, verify, the rest of two prompts after their cached starts (paged attention)
    STEPS = [([0, 0], [20, 5]), ([20, 5], [1, 1]), ([21, 6], [8, 3]), ([29, 9], [18, 17])]

    def _steps(model, forward) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = model.allocate_kv_cache(14, 8)
        g, out = torch.Generator().manual_seed(0), []
        with torch.inference_mode():
            for starts, lens in STEPS:
                ids = torch.randint(0, model.config.vocab_size, (sum(lens),), generator=g)
                pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
                meta = batch_metadata(TABLES, starts, lens, 8, torch.device("cpu"))
                out.append(forward(ids, pos, meta, cache, capture_layers=(-1, 0, 2)))
        return out

    @pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
    def test_target_fast_path_equals_reference(arch, monkeypatch):
        torch.manual_seed(0)
        model = QwenForCausalLM(replace(tiny_target_config(256, num_layers=3), arch=arch, num_heads=6,
                                        num_kv_heads=2, head_dim=16))
        _randomize(model, 0.2)
        model.eval()
        want = _steps(model, model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        runner = TargetRunner(model, KernelConfig(triton=True))
        assert runner.layers[0].attn.qkv is not None and runner.layers[0].mlp.gate_up is not None
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # views keep every parameter
        calls, prompts = [], []
        real, real_prompt = pat.paged_attention_triton, fused_layers.prompt_attention
        monkeypatch.setattr(pat, "paged_attention_triton", lambda *a: calls.append(1) or real(*a))
        monkeypatch.setattr(fused_layers, "prompt_attention", lambda *a: prompts.append(1) or real_prompt(*a))
        reference = TargetRunner(model, KernelConfig(triton=False))  # the model's own forward
        for runs in (reference, runner):
            for (h, f), (h_ref, f_ref) in zip(_steps(model, runs.forward), want):
                torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(f, f_ref, rtol=1e-4, atol=1e-4)
        assert len(calls) == 3 * 3  # decode, verify and the prompts' rests on every layer
        assert len(prompts) == 3  # the 20-token prefill of fresh prompts on every layer

    def test_draft_context_write_fast_path_equals_reference():
        _, draft = tiny_pair(seed=2, block_size=6, dtype=torch.float32)
        g = torch.Generator().manual_seed(3)
        feats = torch.randn(5, draft.config.context_dim, generator=g)
        pos, slots = torch.arange(3, 8), torch.tensor([3, 4, 5, 12, 13])
        caches = []
        for write in (draft.write_context, DraftRunner(draft, KernelConfig(triton=True)).write_context):
            cache = draft.allocate_kv_cache(2, 8)
            with torch.inference_mode():
                write(feats, pos, slots, cache, all_slots_valid=True)
            caches.append(cache)
        assert caches[0][:, :, 0, 3:6].abs().min() > 0 and caches[0][:, :, 0, :3].abs().max() == 0
        torch.testing.assert_close(caches[1], caches[0], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("static", [False, True])
    def test_engine_tokens_on_the_fast_path(static):
        target, draft = tiny_pair(seed=4, agree=0.01, block_size=6, dtype=torch.float32)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (3, 19)]
        params = [SamplingParams(temperature=t, max_tokens=12, seed=i, ignore_eos=True)
                  for i, t in enumerate((0.0, 0.9))]
        outs = []
        for fused in (False, True):
            llm = LLM(target, draft, device="cpu", block_size=8, num_kv_blocks=64, max_model_len=128,
                      enforce_eager=not static, kernel_config=KernelConfig(triton=fused))
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert outs[0] == outs[1]
        assert all(len(t) == 12 for t in outs[0])
