"""Can the draft GPU draft step t+1 while the target verifies step t? Only without step t's target features.

Replays a greedy speculative run of a pair and, at every step, re-drafts it three ways (greedy, teacher-forced,
so an accepted prefix is the one the engine's Markov walk would draw):
- normal: context features up to the anchor (what the engine does; reproduces its accepted counts exactly);
- pre-draft: what a draft started before verify t could see: features only before step t's anchor p0, and the
  tokens p0 .. p0+k of step t (the k accepted, then the new anchor) inside a longer non-causal block;
- gap: the same context, and a plain block at the new anchor (the missing positions left out).
Prints mean accepted drafts per step, by how many drafts step t accepted, and writes JSON.

usage: python bench/bench_predraft.py [--prompts 6] [--max-tokens 96] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
from dspark_serve.train.anchors import Packed
from dspark_serve.train.block_forward import block_logits
from dspark_serve.train.block_forward_ref import block_forward_dense
from dspark_serve.train.data import CHAT_TEMPLATE, read_prompt_texts
from dspark_serve.train.target_pass import target_features

HELDOUT = Path(__file__).resolve().parent / "prompts" / "heldout_code.jsonl"
LAYOUTS = ("normal", "predraft", "gap")


def accepted(draft, hidden, prev: int, truth: list[int]) -> int:
    """hidden [N, H]: slot i drafts truth[i]; leading slots whose greedy draft equals the truth."""
    n = hidden.shape[0]
    logits, _ = block_logits(draft, hidden[None], torch.tensor([[prev] + truth[:n - 1]], device=hidden.device))
    a = 0
    for d, t in zip(logits[0].argmax(-1).tolist(), truth):
        if d != t:
            break
        a += 1
    return a


def block_hidden(draft, feats, ctx_end: int, start: int, block: list[int]):
    """One block at positions start.. seeing context features [0, ctx_end) -> hidden [len(block), H]."""
    dev = feats.device
    zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
    return block_forward_dense(draft, feats[:ctx_end], zeros(ctx_end), torch.arange(ctx_end, device=dev),
                               torch.tensor([block], device=dev), zeros(1), torch.tensor([start], device=dev))[0]


@torch.no_grad()
def replay(llm: LLM, out) -> list[tuple[int, int, dict[str, int]]]:
    """Per step t >= 1 of one output: (drafts step t-1 accepted, drafts step t accepted, {layout: accepted})."""
    draft, n, mask = llm.draft.model, llm.draft.num_speculative_tokens, llm.draft.model.config.mask_token_id
    seq, first = out.prompt_ids + out.token_ids, len(out.prompt_ids)
    zeros = torch.zeros(len(seq), dtype=torch.int64)
    packed = Packed(torch.tensor(seq), zeros.bool(), zeros, torch.arange(len(seq)), [0], [len(seq)])
    feats, _ = target_features(llm.target.model, packed, tuple(draft.config.target_layer_ids))
    acc = out.stats["accepted_per_step"]
    anchors = [first]  # step 0's anchor is the prefill's token
    for a in acc:
        anchors.append(anchors[-1] + a + 1)
    rows = []
    for t in range(1, len(acc)):
        p0, k, p = anchors[t - 1], acc[t - 1], anchors[t]
        truth = seq[p + 1:p + 1 + n]
        if len(truth) < n:
            break
        masks = [mask] * (n - 1)
        hidden = {"normal": block_hidden(draft, feats, p, p, [seq[p]] + masks),
                  "predraft": block_hidden(draft, feats, p0, p0, seq[p0:p + 1] + masks)[k + 1:],
                  "gap": block_hidden(draft, feats, p0, p, [seq[p]] + masks)}
        rows.append((k, acc[t], {name: accepted(draft, h, seq[p], truth) for name, h in hidden.items()}))
    return rows


def summarize(rows: list[tuple[int, int, dict[str, int]]], n: int) -> dict:
    steps = max(len(rows), 1)
    out = {"steps": len(rows), "engine": sum(r[1] for r in rows) / steps,
           **{name: sum(r[2][name] for r in rows) / steps for name in LAYOUTS}, "by_previous": {}}
    for k in range(n + 1):
        sel = [r for r in rows if r[0] == k]
        if sel:
            out["by_previous"][k] = {"steps": len(sel), **{name: sum(r[2][name] for r in sel) / len(sel)
                                                           for name in LAYOUTS}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--prompts", type=int, default=6, help="held-out code prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    prompts = [CHAT_TEMPLATE.format(p) for p in read_prompt_texts(HELDOUT)[:args.prompts]]
    llm = LLM(args.target, args.draft, device=args.device, dtype=torch.float32, num_kv_blocks=1024,  # exact replay
              max_num_seqs=len(prompts), enforce_eager=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    res = summarize([row for o in outs for row in replay(llm, o)], llm.draft.num_speculative_tokens)
    res.update(prompts=len(prompts), max_tokens=args.max_tokens, device=args.device)
    print(f"{res['steps']} steps; mean accepted drafts per step: engine {res['engine']:.2f}, "
          + ", ".join(f"{name} {res[name]:.2f}" for name in LAYOUTS))
    print("| step t-1 accepted | steps | " + " | ".join(LAYOUTS) + " |")
    print("|---|---|" + "---|" * len(LAYOUTS))
    for k, row in res["by_previous"].items():
        print(f"| {k} | {row['steps']} | " + " | ".join(f"{row[name]:.2f}" for name in LAYOUTS) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
