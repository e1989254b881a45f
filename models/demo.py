"""The demo pair: Qwen2.5-Coder-0.5B-Instruct (fetched into the user cache) and the DSpark drafter shipped here."""

from __future__ import annotations

from pathlib import Path

from .fetch import GGUFSource, default_cache_dir

DEMO_DRAFTER = Path(__file__).resolve().parent / "checkpoints" / "qwen2.5-coder-0.5b-dspark"
# FR-Spec token map of the target's vocabulary: the 32768 tokens most frequent in the drafter's training prompts
# (dspark-serve token-map); kept beside the drafter, not in it
DEMO_TOKEN_MAP = Path(__file__).resolve().parent / "token_maps" / "qwen2.5-coder-0.5b-instruct-32768.pt"


def demo_target_dir(cache_dir: str | Path | None = None) -> Path:
    """Where `dspark-serve fetch` puts the converted target (it may not exist yet)."""
    return (Path(cache_dir) if cache_dir else default_cache_dir()) / GGUFSource().out_name
