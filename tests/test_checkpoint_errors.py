"""Every bad checkpoint gets a CheckpointError that names the problem; nothing loads half-random."""

import json

import pytest
import torch
from drafts import draft_config, random_draft, tiny_target
from safetensors.torch import load_file, save_file

from dspark_serve.models.config import CheckpointError, ModelConfig
from dspark_serve.models.draft_loader import load_draft
from dspark_serve.models.draft_saver import save_draft
from dspark_serve.models.target_loader import load_target

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("target"), num_layers=3)


def _edit(path, config=None, tensors=None):
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(str(path / "model.safetensors"))
        tensors(state)
        save_file(state, str(path / "model.safetensors"))
    return path


def _saved(target, tmp_path, **kw):
    return save_draft(random_draft(draft_config(**kw), target), tmp_path / "d", "deepspec")


def test_reduced_vocab_without_lm_head(target, tmp_path):
    path = _edit(_saved(target, tmp_path, draft_vocab=64), tensors=lambda s: s.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"reduced draft vocab \(64 < target 160\) needs lm_head.weight"):
        load_draft(path, target=target)


def test_reduced_vocab_without_d2t(target, tmp_path):
    path = _edit(_saved(target, tmp_path, draft_vocab=64), tensors=lambda s: s.pop("d2t"))
    with pytest.raises(CheckpointError, match=r"needs d2t \(draft_id_to_target_id\)"):
        load_draft(path, target=target)


def test_larger_input_vocab_without_embedding(target, tmp_path):
    def grow(s):
        s.pop("embed_tokens.weight")
        s["markov_head.markov_w1.weight"] = torch.zeros(200, 8)
    path = _edit(_saved(target, tmp_path), tensors=grow)
    with pytest.raises(CheckpointError, match="input vocab 200 is larger than the target's 160 .* no embed_tokens"):
        load_draft(path, target=target)


def test_unknown_tensors_are_listed(target, tmp_path):
    def add(s):
        s["layers.0.self_attn.rogue.weight"] = torch.zeros(2)
        s["extra_head.weight"] = torch.zeros(2)
    path = _edit(_saved(target, tmp_path), tensors=add)
    with pytest.raises(CheckpointError, match=r"unknown tensors \['extra_head.weight', 'layers.0.self_attn.rogue"):
        load_draft(path, target=target)


def test_missing_tensors_are_listed(target, tmp_path):
    def drop(s):
        s.pop("fc.weight")
        s.pop("layers.1.mlp.up_proj.weight")
    path = _edit(_saved(target, tmp_path), tensors=drop)
    with pytest.raises(CheckpointError, match=r"missing tensors \['fc.weight', 'layers.1.mlp.up_proj.weight'\]"):
        load_draft(path, target=target)


def test_missing_shared_weights_without_target(target, tmp_path):
    path = save_draft(random_draft(draft_config(), target), tmp_path / "z", "dflash")
    with pytest.raises(CheckpointError, match=r"missing tensors \['embed_tokens.weight', 'lm_head.weight'\]"):
        load_draft(path)
    assert load_draft(path, target=target).lm_head is target.lm_head


def test_shape_mismatch_names_tensor_and_shapes(target, tmp_path):
    path = _edit(_saved(target, tmp_path), tensors=lambda s: s.update({"fc.weight": torch.zeros(64, 100)}))
    with pytest.raises(CheckpointError, match=r"tensor fc.weight has shape \(64, 100\), expected \(64, 128\)"):
        load_draft(path, target=target)


def test_unsupported_markov_head_type(target, tmp_path):
    path = _edit(_saved(target, tmp_path), config=lambda c: c.update(markov_head_type="rnn"))
    with pytest.raises(CheckpointError, match="unsupported markov_head_type 'rnn'"):
        load_draft(path, target=target)


def test_unsupported_rope_type(target, tmp_path):
    def yarn(c):
        c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    path = _edit(_saved(target, tmp_path), config=yarn)
    with pytest.raises(CheckpointError, match="unsupported rope type 'yarn'"):
        load_draft(path, target=target)


def test_not_a_draft_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CheckpointError, match="not a DFlash/DSpark draft config"):
        load_draft(tmp_path)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(architectures=["LlamaForCausalLM"], model_type="llama"), "unsupported architecture"),
    (lambda c: c.pop("hidden_size"), r"missing required fields \['hidden_size'\]"),
    (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "unsupported rope type 'linear'"),
])
def test_target_config_errors(tmp_path, edit, message):
    cfg = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 1e6}
    edit(cfg)
    with pytest.raises(CheckpointError, match=message):
        ModelConfig.from_hf(cfg)


def test_target_config_4x_and_5x_spellings_agree():
    common = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    v4 = ModelConfig.from_hf({**common, "rope_theta": 5e5, "torch_dtype": "float16"})
    v5 = ModelConfig.from_hf({**common, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                              "dtype": "float16"})
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.dtype == torch.float16 and v4.has_qkv_bias


def test_target_missing_weight_and_no_files(tmp_path, target):
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        (tmp_path / "config.json").write_text(json.dumps(target.config.to_hf()))
        load_target(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(160, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head.weight', 'model.layers.0"):
        load_target(tmp_path)
