"""The gateway's prompt tokenization on multi-turn chat prompts (bench_chat.py's conversations: a shared system
prompt, every earlier turn resent): ms per prompt of the tokenizer encoding each whole text against
cluster/prompt_tokens.py, which encodes the pieces between added tokens and keeps the long ones; the ids must be
equal.

usage: python bench/bench_prompt_tokens.py [--target DIR] [--conversations 64] [--turns 4] [--system-tokens 1500]
                                           [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_chat import chat_template, conversations, system_prompt
from chat_client import render


def prompts(target: str, n: int, turns: int, system_tokens: int) -> list[str]:
    """Every turn's prompt in the order a server meets them: turn t of every conversation, then turn t + 1 (each
    reply stood in for by the next question)."""
    from dspark_serve.models.tokenizer import load_tokenizer

    system = system_prompt(load_tokenizer(target), system_tokens)
    template, _ = chat_template(target)
    convs = conversations(n, turns)
    history = {i: [{"role": "system", "content": system}] for i, _ in convs}
    out = []
    for t in range(turns):
        for i, questions in convs:
            history[i].append({"role": "user", "content": questions[t]})
            out.append(render(template, history[i]))
            history[i].append({"role": "assistant", "content": questions[(t + 1) % turns]})
    return out


def main(argv: list[str] | None = None) -> dict:
    from dspark_serve.cluster.prompt_tokens import PromptTokenizer
    from dspark_serve.models.demo import demo_target_dir
    from dspark_serve.models.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    texts = prompts(args.target, args.conversations, args.turns, args.system_tokens)
    tok = load_tokenizer(args.target)
    pieces = PromptTokenizer(tok)
    tok.encode_batch(texts[:1], add_special_tokens=False)  # warm
    t0 = time.perf_counter()
    whole = [tok.encode_batch([t], add_special_tokens=False)[0].ids for t in texts]
    t1 = time.perf_counter()
    cached = [pieces.encode(t, add_special_tokens=False) for t in texts]
    t2 = time.perf_counter()
    result = {"target": args.target, "prompts": len(texts), "exact": pieces.exact,
              "mean_prompt_tokens": sum(map(len, whole)) / len(whole),
              "whole_ms_per_prompt": 1e3 * (t1 - t0) / len(texts),
              "pieces_ms_per_prompt": 1e3 * (t2 - t1) / len(texts),
              "equal": sum(a == b for a, b in zip(whole, cached)), "piece_hits": pieces.hits,
              "piece_misses": pieces.misses}
    print(f"{len(texts)} prompts of {result['mean_prompt_tokens']:.0f} tokens on average: the whole text "
          f"{result['whole_ms_per_prompt']:.3f} ms, by pieces {result['pieces_ms_per_prompt']:.3f} ms per prompt; "
          f"ids equal for {result['equal']} of {len(texts)}; long pieces {pieces.hits} found, {pieces.misses} encoded")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
