"""`dspark-serve train-draft`: regenerate responses with the target, then train a DSpark draft (DeepSpec recipe)."""

from __future__ import annotations

import argparse
import copy
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dspark_serve.models.config import ModelConfig
from dspark_serve.models.draft_saver import save_draft
from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.target_loader import load_target
from dspark_serve.models.tokenizer import eos_token_ids, load_tokenizer

from .data import FORMATS, load_prompts
from .draft_init import default_mask_token_id, new_draft, resume_draft, used_vocab_size
from .target_pass import read_prompts, regenerate, write_prompts
from .trainer import TrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark-serve train-draft", description=__doc__)
    p.add_argument("--target", required=True, help="target checkpoint directory (HF format, with tokenizer)")
    p.add_argument("--data", action="append", help="prompt file (repeatable)")
    p.add_argument("--responses", action="append", help="a prompts.jsonl from an earlier run (repeatable): train on "
                                                         "its prompts and responses without regenerating")
    p.add_argument("--regenerate-only", action="store_true", help="write prompts.jsonl and stop (no training)")
    p.add_argument("--out", required=True, help="output draft directory (DeepSpec format)")
    p.add_argument("--data-format", default="auto", choices=FORMATS, help="ids: one prompt of token ids a line")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the Qwen chat template")
    p.add_argument("--max-prompts", type=int, help="use at most this many prompts")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=256, help="tokens the target regenerates per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="regeneration temperature (0: greedy)")
    p.add_argument("--max-regen-minutes", type=float,
                   help="stop regenerating after this many minutes (keeps the prompts done so far)")
    p.add_argument("--gen-batch", type=int, default=64, help="sequences decoded at once while regenerating")
    p.add_argument("--enforce-eager", action="store_true", help="regenerate without CUDA graphs")
    p.add_argument("--init-draft", help="continue training this draft checkpoint (its architecture wins over the "
                                         "--draft-layers / --block-size / --markov-rank / layer-id flags)")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=7)
    p.add_argument("--markov-rank", type=int, default=64)
    p.add_argument("--draft-intermediate-size", type=int, help="the draft's MLP width (default: the target's)")
    p.add_argument("--target-layer-ids", help="comma-separated (default: DFlash's spread, final layer excluded)")
    p.add_argument("--mask-token-id", type=int, help="default: the first id the tokenizer does not use")
    p.add_argument("--no-confidence", action="store_true", help="train without the confidence head")
    p.add_argument("--no-shared-copies", action="store_true",
                   help="omit embed_tokens/lm_head from the checkpoint (shared with the target at load time)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.04)
    p.add_argument("--schedule", choices=("cosine", "linear"), default="cosine")
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=4, help="sequences packed per step")
    p.add_argument("--num-anchors", type=int, default=256, help="anchor blocks per sequence")
    p.add_argument("--max-minutes", type=float, help="stop training after this many minutes")
    p.add_argument("--stop-after-minutes", type=float,
                   help="pause this run after this many minutes of training, keeping --max-minutes' schedule: writes "
                        "the draft and OUT/resume.pt (fp32 weights, optimizer, step, data order) for --resume")
    p.add_argument("--stop-after-steps", type=int, help="the same at this optimizer step")
    p.add_argument("--resume", help="an --out directory paused by --stop-after-minutes: continue its run where it "
                                    "stopped (same data, same options)")
    p.add_argument("--save-every-minutes", type=float,
                   help="also write the draft to --out this often while training (a killed run keeps the last one)")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="recompute target features every step instead of keeping them in memory")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--val-sequences", type=int, default=0,
                   help="hold this many sequences out of training and report their loss (train_log.jsonl: val_*)")
    p.add_argument("--val-every", type=int, default=0, help="... every this many steps (default: at the end only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.data and not args.responses:
        parser.error("give --data (prompt files) or --responses (a prompts.jsonl from an earlier run)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_dir, out = Path(args.target), Path(args.out)
    target = load_target(target_dir, dtype=None if device == "cuda" else torch.float32, device=device)
    tok = load_tokenizer(target_dir) if args.data_format != "ids" else None
    vocab = target.config.vocab_size
    out.mkdir(parents=True, exist_ok=True)
    if args.responses:
        prompts, responses = [], []
        for path in args.responses:
            p, r = read_prompts(Path(path), vocab)
            prompts, responses = prompts + p, responses + r
        prompts, responses = (prompts[:args.max_prompts], responses[:args.max_prompts]) if args.max_prompts \
            else (prompts, responses)
        print(f"train-draft: {len(prompts)} prompts with responses from {', '.join(args.responses)}", file=sys.stderr)
    else:
        prompts = load_prompts(args.data, tok, args.data_format, args.chat, args.max_prompt_len, vocab)
        prompts = prompts[:args.max_prompts] if args.max_prompts else prompts
        print(f"train-draft: {len(prompts)} prompts; regenerating up to {args.response_len} tokens each",
              file=sys.stderr)
        eos = tuple(eos_token_ids(target_dir))
        t0 = time.perf_counter()
        responses = regenerate(target, prompts, args.response_len, args.temperature, eos, args.seed,
                               args.gen_batch, args.max_regen_minutes, enforce_eager=args.enforce_eager)
        prompts = prompts[:len(responses)]
        n = sum(len(r) for r in responses)
        print(f"train-draft: regenerated {n} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        write_prompts(out / "prompts.jsonl", prompts, responses)
    if args.regenerate_only:
        print(f"train-draft: wrote {out / 'prompts.jsonl'} (--regenerate-only)", file=sys.stderr)
        return 0
    seqs = [(torch.tensor(p + r), torch.tensor([False] * len(p) + [True] * len(r))) for p, r in zip(prompts, responses)]
    mask_id = args.mask_token_id if args.mask_token_id is not None else \
        default_mask_token_id(vocab, used_vocab_size(tok) if tok else None)
    layer_ids = tuple(int(i) for i in args.target_layer_ids.split(",")) if args.target_layer_ids else None
    resume = None
    if args.resume:
        path = Path(args.resume) / "resume.pt"
        if not path.is_file():
            parser.error(f"--resume {args.resume}: no resume.pt there (written by --stop-after-minutes)")
        resume = torch.load(path, map_location=device, weights_only=False)
        draft = resume_draft(args.resume, target)
        with torch.no_grad():
            for name, p in draft.named_parameters():
                if p.requires_grad:
                    p.copy_(resume["weights"][name])
    elif args.init_draft:
        draft = resume_draft(args.init_draft, target)
    else:
        draft = new_draft(target, args.draft_layers, args.block_size, args.markov_rank, layer_ids, mask_id,
                          confidence=not args.no_confidence, seed=args.seed,
                          intermediate_size=args.draft_intermediate_size)
    cfg = TrainConfig(lr=args.lr, warmup_ratio=args.warmup_ratio, schedule=args.schedule, steps=args.steps,
                      epochs=args.epochs, batch_size=args.batch_size, num_anchors=args.num_anchors,
                      max_minutes=args.max_minutes, stop_minutes=args.stop_after_minutes,
                      stop_step=args.stop_after_steps,
                      save_every_minutes=args.save_every_minutes,
                      cache_features=not args.no_feature_cache, log_every=args.log_every, seed=args.seed,
                      val_sequences=args.val_sequences, val_every=args.val_every)
    dc = draft.config
    print(f"train-draft: draft {dc.layers.num_layers} layers, block {dc.block_size}, target layers "
          f"{list(dc.target_layer_ids)}, mask id {dc.mask_token_id}"
          + (f", continuing {args.init_draft}" if args.init_draft else ""), file=sys.stderr)
    if resume is None:
        (out / "train_log.jsonl").unlink(missing_ok=True)
    save_dtype = ModelConfig.from_dir(target_dir).dtype  # the target checkpoint's dtype (bf16 for Qwen)

    def save(model: DSparkDraft) -> None:
        model.config = replace(model.config, layers=replace(model.config.layers, dtype=save_dtype))
        save_draft(model.to(save_dtype), out, "deepspec", with_shared=not args.no_shared_copies)

    def checkpoint(step: int) -> None:
        save(copy.deepcopy(draft))
        print(f"train-draft: step {step}: wrote {out}", file=sys.stderr)
    paused = []

    def save_state(state: dict) -> None:
        weights = {n: p.detach().clone() for n, p in draft.named_parameters() if p.requires_grad}
        torch.save({"trainer": state, "weights": weights}, out / "resume.pt")
        paused.append(True)
        print(f"train-draft: wrote {out / 'resume.pt'}; continue with --resume {out}", file=sys.stderr)
    log = train(draft, target, seqs, cfg, out / "train_log.jsonl", checkpoint,
                resume["trainer"] if resume is not None else None, save_state)
    if not paused:  # a finished run leaves nothing to resume
        (out / "resume.pt").unlink(missing_ok=True)
    save(draft)
    if log:
        print(f"train-draft: loss {log[0]['loss']:.4f} -> {log[-1]['loss']:.4f}; wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
