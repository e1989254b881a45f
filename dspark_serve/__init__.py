"""dspark-serve: a DSpark draft and a Qwen3/Qwen2 target for lossless speculative decoding."""

__version__ = "0.1.0"
