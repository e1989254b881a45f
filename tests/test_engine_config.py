"""EngineConfig: one config from LLM's keywords, the CLI's flags and the Serve app's options; its validation; the
kernel choices the engine installs."""

import pytest

from dspark_serve.engine.engine_config import EngineConfig, split_options
from dspark_serve.engine.spec_config import SpeculativeConfig
from dspark_serve.kernels.config import KernelConfig, active, using


def test_options_become_typed_fields():
    cfg = EngineConfig.from_options({"target": "t", "speculative_config": '{"model": "d", "dspark_draft_topk": 8}',
                                     "dtype": "auto", "device": None, "kernel_config": {"pdl": False}})
    assert cfg.speculative_config == SpeculativeConfig(model="d", dspark_draft_topk=8)
    assert (cfg.draft, cfg.dtype, cfg.device, cfg.kv_blocks) == ("d", None, "auto", 2048)  # draft: spec's model
    assert cfg.kernels == KernelConfig.for_device("cpu", pdl=False)
    import torch

    assert EngineConfig.from_options({"target": "t", "dtype": torch.bfloat16}).dtype == "bfloat16"
    engine, rest = split_options({"target": "t", "block_size": 8, "placement": "PACK"})
    assert (engine, rest) == ({"target": "t", "block_size": 8}, {"placement": "PACK"})


@pytest.mark.parametrize("options, message", [
    ({"device": "tpu"}, "device must be auto, cpu or cuda"),
    ({"dtype": "int8"}, "dtype must be bfloat16, float16 or float32"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 0.5, "num_kv_blocks": 64}, "give num_kv_blocks or gpu_memory_utilization, not both"),
    ({"block_size": 0}, "block_size must be an int >= 1"),
    ({"speculative_config": "{bad"}, "speculative_config is not valid JSON"),
    ({"kernel_config": "{bad"}, "kernel config is not valid JSON"),
    ({"kernel_config": {"no_such": 1}}, "unknown kernel config field"),
    ({"max_queue": 4}, "unknown engine options"),
    ({"deterministic": "yes"}, "deterministic must be true or false"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_options({"target": "t", **options})


def test_cli_flags_map_onto_the_config():
    from dspark_serve.cluster.commands.cli import build_parser

    args = build_parser().parse_args(["serve", "--target", "t", "--draft", "d", "--kernel-config", '{"pdl": false}',
                                      "--num-kv-blocks", "64", "--enforce-eager", "--dtype", "float32"])
    cfg = EngineConfig.from_options(split_options(vars(args))[0])
    assert (cfg.target, cfg.draft, cfg.num_kv_blocks, cfg.enforce_eager, cfg.dtype) == ("t", "d", 64, True, "float32")
    assert cfg.kernels.pdl is False
    args = build_parser().parse_args(["generate", "--target", "t", "--prompt-ids", "1"])
    assert EngineConfig.from_options(split_options(vars(args))[0]) == EngineConfig(target="t")
    for flag in ("--deterministic", "--enable-deterministic-inference"):  # SGLang's name too
        args = build_parser().parse_args(["serve", "--target", "t", flag])
        assert EngineConfig.from_options(split_options(vars(args))[0]).deterministic is True
    engine, _ = split_options({"target": "t", "deterministic": True, "placement": "PACK"})  # the Serve app's args
    assert EngineConfig.from_options(engine).deterministic is True


def test_serve_refuses_a_bad_kernel_config_in_one_line(capsys):
    from dspark_serve.cluster.commands import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--target", "t", "--kernel-config", '{"pdl": 2}'])
    assert str(e.value) == "dspark-serve serve: error: kernel config pdl must be true or false, got 2"


def test_the_engine_installs_its_kernel_config():
    from engine_pairs import build_pair

    from dspark_serve.engine.llm import LLM

    target, draft = build_pair(seed=1, agree=0.01, block_size=4)
    with using(active()):  # the install below is undone after the test
        llm = LLM(target, draft, device="cpu", block_size=8, num_kv_blocks=64, kernel_config={"prompt_sdpa": False})
        assert active() == KernelConfig.for_device("cpu", prompt_sdpa=False) == llm.config.kernels
        LLM.from_config(EngineConfig(target=None, device="cpu", num_kv_blocks=64), target_model=target)
        assert active() == KernelConfig.for_device("cpu")  # none given: the device's defaults
    with pytest.raises(ValueError, match="give the target"):
        LLM.from_config(EngineConfig(target=None))
