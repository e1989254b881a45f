"""NVFP4 (ModelOpt W4A16) draft checkpoints: `quantize_checkpoint` output loads as NVFP4Linear layers whose outputs
equal a dense draft holding the dequantized weights, the engine's gathered top-k path agrees, and bad configs fail
with a message naming the problem (CPU)."""

import copy
import json

import pytest
import torch
from drafts import VOCAB, draft_config, random_draft, tiny_target
from test_draft_model import _draft_outputs, _inputs

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.reference import greedy_generate
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.config import CheckpointError
from dspark_serve.models.draft_loader import canonical_layer_names, load_draft
from dspark_serve.models.draft_saver import save_draft
from dspark_serve.models.nvfp4_linear import NVFP4Linear
from dspark_serve.models.quantize import quantize_checkpoint

pytest.importorskip("transformers")
RANK = 16   # markov_w1 / markov_w2 are [V, 16]: K % 16 == 0, so they are quantized too


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"))


def _quantized(target, tmp_path, fmt="deepspec", seed=0):
    cfg = draft_config(markov_rank=RANK)
    draft = random_draft(cfg, target, seed=seed)
    src = save_draft(draft, tmp_path / f"{fmt}-bf16", fmt)
    names = quantize_checkpoint(src, tmp_path / f"{fmt}-nvfp4", device="cpu")
    return cfg, draft, tmp_path / f"{fmt}-nvfp4", names


def _dense_twin(draft, loaded, names):
    """`draft` with each quantized linear's weight replaced by the loaded NVFP4 layer's dequantized weight (and
    markov_w1 by the loaded one, dequantized at load)."""
    with torch.no_grad():
        for name in names - {"markov_head.markov_w1"}:
            draft.get_submodule(name).weight.copy_(loaded.get_submodule(name).dequantized_weight(torch.float32))
        draft.markov_head.markov_w1.weight.copy_(loaded.markov_head.markov_w1.weight)
    return draft


def _assert_close(ours, theirs):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["deepspec", "vllm"])
def test_nvfp4_draft_equals_dense_dequantized_twin(target, tmp_path, fmt):
    cfg, draft, path, names = _quantized(target, tmp_path, fmt)
    canon = {"fc", "lm_head", "markov_head.markov_w2"} | {
        f"layers.{i}.{m}.{p}_proj" for i in range(2)
        for m, parts in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for p in parts}
    if fmt == "vllm":   # DEFAULT_INCLUDE patterns have no `model.` prefix: only lm_head matches vLLM names
        assert names == {"lm_head"}
        canon = canonical_layer_names(names)
    loaded = load_draft(path, target=target)
    assert {n for n, m in loaded.named_modules() if isinstance(m, NVFP4Linear)} == canon
    assert not isinstance(loaded.confidence_head.proj, NVFP4Linear)
    assert loaded.lm_head is not target.lm_head   # the quantized lm_head is the draft's own, not swapped out
    assert loaded.embed_tokens is target.model.embed_tokens
    w1 = loaded.markov_head.markov_w1
    assert isinstance(w1, torch.nn.Embedding)   # a table read by row: stored NVFP4, loaded dense
    if fmt == "deepspec":
        assert names == canon | {"markov_head.markov_w1"}
        from safetensors.torch import load_file

        from dspark_serve.kernels import nvfp4
        stored = load_file(path / "model.safetensors")
        assert stored["markov_head.markov_w1.weight"].dtype == torch.uint8
        want = nvfp4.dequantize(*(stored[f"markov_head.markov_w1.{s}"] for s in ("weight", "weight_scale",
                                                                                   "weight_scale_2")))
        assert torch.equal(w1.weight, want.to(w1.weight.dtype))
    dense = _dense_twin(draft, loaded, canon)
    inputs = _inputs(cfg, seed=1)
    _assert_close(_draft_outputs(loaded, *inputs), _draft_outputs(dense, *inputs))


def test_stacked_nvfp4_projections_split_by_rows(target, tmp_path):
    """vLLM names with qkv_proj / gate_up_proj stacked in NVFP4: rows split, one weight_scale_2 per part."""
    from safetensors.torch import load_file, save_file

    from dspark_serve.kernels import nvfp4
    cfg, draft, path, _ = _quantized(target, tmp_path, "deepspec", seed=2)
    state = load_file(path / "model.safetensors")
    stacked = {}
    for key, t in state.items():
        stacked["lm_head." + key[8:] if key.startswith("lm_head.") else "model." + key] = t
    for i in range(2):
        for stem, parts, fused in ((f"layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                   (f"layers.{i}.mlp.", ("gate_proj", "up_proj"), "gate_up_proj")):
            w = torch.cat([nvfp4.dequantize(*(state[f"{stem}{p}.{s}"] for s in
                                              ("weight", "weight_scale", "weight_scale_2"))) for p in parts])
            packed, scale, scale_2 = nvfp4.quantize(w)
            for p in parts:
                for s in ("weight", "weight_scale", "weight_scale_2"):
                    del stacked[f"model.{stem}{p}.{s}"]
            stacked.update({f"model.{stem}{fused}.weight": packed, f"model.{stem}{fused}.weight_scale": scale,
                            f"model.{stem}{fused}.weight_scale_2": scale_2,
                            f"model.{stem}{fused}.input_scale": torch.tensor(1.0)})
    save_file(stacked, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    layers = config["quantization_config"]["quantized_layers"]
    entry = layers["fc"]
    for name in [n for n in layers if n.startswith("layers.")]:
        del layers[name]
    for i in range(2):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            layers[f"model.layers.{i}.{name}"] = entry
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_draft(path, target=target)
    for i in range(2):
        for p in ("q", "k", "v"):
            assert isinstance(loaded.layers[i].self_attn.get_submodule(f"{p}_proj"), NVFP4Linear)
    names = {n for n, m in loaded.named_modules() if isinstance(m, NVFP4Linear)}
    dense = _dense_twin(draft, loaded, names)
    inputs = _inputs(cfg, seed=3)
    _assert_close(_draft_outputs(loaded, *inputs), _draft_outputs(dense, *inputs))


def test_engine_topk_gathered_path_with_nvfp4_draft(target, tmp_path):
    cfg, draft, path, names = _quantized(target, tmp_path, seed=4)
    loaded = load_draft(path, target=target)
    dense = _dense_twin(draft, loaded, names)
    assert isinstance(loaded.markov_head.markov_w2, NVFP4Linear)
    llms = [LLM(target, m, {"dspark_draft_topk": 8}, device="cpu", block_size=8, num_kv_blocks=128)
            for m in (loaded, dense)]
    # The walk over NVFP4 candidate rows equals the walk of the dequantized twin (greedy and sampled rows).
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, cfg.layers.hidden_size, generator=g)
    base = torch.randn(3, 4, VOCAB, generator=g)
    args = (hidden, base, torch.tensor([1, 2, 3]), torch.tensor([0.0, 0.7, 1.3]), torch.tensor([5, 6, 7]),
            torch.tensor([10, 20, 30]), True)
    a, b = (llm.draft.markov_walk(*args) for llm in llms)
    assert a.tokens.tolist() == b.tokens.tolist() and a.cand_ids.tolist() == b.cand_ids.tolist()
    torch.testing.assert_close(a.cand_probs, b.cand_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.confidence_logits, b.confidence_logits, rtol=1e-5, atol=1e-5)
    assert a.cand_probs[0].max(-1).values.tolist() == [1.0] * 4  # the greedy row: one-hot q
    prompts = [[1, 2, 3, 4], [10, 20, 30, 40, 50], [7] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = [llm.generate(prompts, params) for llm in llms]
    for prompt, a, b in zip(prompts, *outs):
        assert a.token_ids == greedy_generate(target, prompt, 12), prompt
        assert a.token_ids == b.token_ids and a.stats["accepted"] == b.stats["accepted"], prompt


def test_quantization_config_naming_a_missing_layer(target, tmp_path):
    _, _, path, _ = _quantized(target, tmp_path, seed=6)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["quantized_layers"]["layers.0.mlp.nope_proj"] = {"quant_algo": "W4A16_NVFP4",
                                                                                   "group_size": 16}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.nope_proj"):
        load_draft(path, target=target)


def test_nvfp4_errors_name_the_problem(target, tmp_path):
    _, _, path, _ = _quantized(target, tmp_path, seed=7)
    config = json.loads((path / "config.json").read_text())
    bad = json.loads(json.dumps(config))
    bad["quantization_config"]["quantized_layers"]["fc"]["group_size"] = 32
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="group_size must be 16, got 32"):
        load_draft(path, target=target)
    bad = json.loads(json.dumps(config))
    bad["quantization_config"]["quantized_layers"]["norm"] = {"quant_algo": "W4A16_NVFP4"}
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="'norm'.*RMSNorm"):
        load_draft(path, target=target)
    bad = json.loads(json.dumps(config))   # a Linear that is listed but has no NVFP4 tensors in the file
    del bad["quantization_config"]["quantized_layers"]["fc"]
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="fc"):
        load_draft(path, target=target)


def test_quantized_lm_head_drafts_from_a_4bit_copy(target):
    """dspark_quantize_lm_head: the draft's bf16 lm_head gets an NVFP4 copy for drafting (the target's own head is
    untouched), verification stays lossless; off by default; a non-boolean is refused."""
    from dspark_serve.engine.spec_config import SpeculativeConfig
    from dspark_serve.kernels import nvfp4
    cfg = draft_config(markov_rank=RANK)
    draft = random_draft(cfg, target, seed=6)
    target_head = target.lm_head.weight.clone()
    off = LLM(target, copy.deepcopy(draft), {}, device="cpu", block_size=8, num_kv_blocks=128)
    assert type(off.draft.model.lm_head) is torch.nn.Linear
    llm = LLM(target, draft, {"dspark_quantize_lm_head": True}, device="cpu", block_size=8, num_kv_blocks=128)
    head = llm.draft.model.lm_head
    assert isinstance(head, NVFP4Linear) and type(target.lm_head) is torch.nn.Linear
    assert torch.equal(target.lm_head.weight, target_head)
    want = nvfp4.dequantize(*nvfp4.quantize(target_head))
    h = torch.randn(5, cfg.layers.hidden_size)
    torch.testing.assert_close(llm.draft.model.base_logits(h), h @ want.T, rtol=1e-5, atol=1e-5)
    assert not torch.equal(llm.draft.model.base_logits(h), off.draft.model.base_logits(h))  # it is another head
    prompts = [[1, 2, 3, 4], [10, 20, 30, 40, 50]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_generate(target, prompt, 10), prompt
    with pytest.raises(ValueError, match="dspark_quantize_lm_head"):
        SpeculativeConfig.from_json({"dspark_quantize_lm_head": "yes"})
    with pytest.raises(ValueError, match="source weight"):
        head.use_source_from(target_head[:, :16])
