"""The training loop: packed sequences -> target features -> anchor blocks -> DSpark loss; AdamW with warmup."""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch

from dspark_serve.models.dspark import DSparkDraft
from dspark_serve.models.qwen import QwenForCausalLM

from .anchors import build_blocks, pack, sample_anchors
from .block_forward import block_forward, block_logits
from .draft_init import freeze_shared
from .loss import LossParts, dspark_loss
from .target_pass import target_features


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    schedule: str = "cosine"  # or "linear" decay after warmup
    grad_clip: float = 1.0
    steps: int | None = None  # None: epochs over the sequences
    epochs: float = 1.0
    batch_size: int = 4  # sequences packed per step
    num_anchors: int = 256  # per sequence
    max_minutes: float | None = None  # the schedule's length in time (the learning rate reaches 0 there)
    stop_minutes: float | None = None  # stop this run sooner, schedule unchanged, and save a resume state
    stop_step: int | None = None  # the same at this step
    save_every_minutes: float | None = None  # call `checkpoint` this often (a killed run keeps its last save)
    cache_features: bool = True  # run the target once per sequence (else once per step: no memory, more compute)
    gamma: float = 4.0
    log_every: int = 10
    val_sequences: int = 0  # hold this many sequences out of training and report their loss ...
    val_every: int = 0  # ... every this many steps (0: at the end only)
    seed: int = 0


def lr_at(step: int, total: int, cfg: TrainConfig, elapsed_s: float = 0.0) -> float:
    """Linear warmup over warmup_ratio of the run, then cosine or linear decay to 0. The run's progress is
    step / total, or the elapsed share of max_minutes when that is further along (a time-boxed run decays fully)."""
    progress = step / total
    if cfg.max_minutes is not None:
        progress = max(progress, elapsed_s / (60 * cfg.max_minutes))
    warm = max(progress, (step + 1) / total)
    if warm < cfg.warmup_ratio:
        return cfg.lr * warm / cfg.warmup_ratio
    frac = min(1.0, max(0.0, (progress - cfg.warmup_ratio) / (1 - cfg.warmup_ratio)))
    return cfg.lr * (0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac)


Features = tuple[torch.Tensor, torch.Tensor]  # (raw layer outputs [T, m * H], final-normed hidden [T, H])


def cache_target_features(target: QwenForCausalLM, seqs: list[tuple[torch.Tensor, torch.Tensor]],
                          layer_ids: tuple[int, ...], batch_size: int) -> list[Features]:
    """Per-sequence target features, computed once in packed batches."""
    out: list[Features] = []
    for i in range(0, len(seqs), batch_size):
        packed = pack(seqs[i:i + batch_size])
        feats, last = target_features(target, packed, layer_ids)
        out += list(zip(feats.split(packed.lengths), last.split(packed.lengths)))
    return out


def train_step(draft: DSparkDraft, target: QwenForCausalLM, seqs: list[tuple[torch.Tensor, torch.Tensor]],
               num_anchors: int, gamma: float = 4.0, generator: torch.Generator | None = None,
               cached: list[Features] | None = None) -> LossParts | None:
    """Forward + loss for one packed batch of (ids [T], loss_mask [T]) (with their cached target features, if
    given); None when no sequence has an anchor."""
    cfg = draft.config
    packed = pack(seqs)
    anchors = [sample_anchors(m, num_anchors, generator) for _, m in seqs]
    if sum(a.numel() for a in anchors) == 0:
        return None
    blocks = build_blocks(packed, anchors, cfg.block_size, cfg.mask_token_id)
    dev = draft.hidden_norm.weight.device
    if cached is None:
        feats, last = target_features(target, packed, cfg.target_layer_ids)
    else:
        feats, last = torch.cat([f for f, _ in cached]), torch.cat([h for _, h in cached])
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else nullcontext()
    with autocast:
        hidden = block_forward(draft, feats, packed.seq.to(dev), packed.pos.to(dev), blocks.ids.to(dev),
                               blocks.seq.to(dev), blocks.anchors.to(dev))  # [N, B, hidden]
        logits, conf = block_logits(draft, hidden, blocks.prev_ids.to(dev))
    with torch.no_grad():  # each target position once: [U, V] in the target's dtype
        rows, index = torch.unique(blocks.target_index.to(dev), return_inverse=True)
        target_logits = target.lm_head(last[rows])
    return dspark_loss(logits, target_logits, blocks.labels.to(dev), blocks.eval_mask.to(dev), conf, gamma,
                       target_index=index)


def split_validation(n: int, val_sequences: int, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of n sequences: a seeded choice, the same on every run and resume."""
    if not 0 <= val_sequences < n:
        raise ValueError(f"--val-sequences must be in [0, {n - 1}] for {n} sequences, got {val_sequences}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return sorted(perm[val_sequences:]), sorted(perm[:val_sequences])


@torch.no_grad()
def evaluate(draft: DSparkDraft, target: QwenForCausalLM, seqs: list[tuple[torch.Tensor, torch.Tensor]],
             cached: list[Features] | None, cfg: TrainConfig) -> dict[str, float]:
    """The loss parts over held-out sequences, anchors drawn the same way every time (weighted by position
    weights, like training)."""
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    sums, weight = {"val_loss": 0.0, "val_ce": 0.0, "val_tv": 0.0, "val_acc": 0.0}, 0.0
    was_training = draft.training
    draft.eval()
    for i in range(0, len(seqs), cfg.batch_size):
        parts = train_step(draft, target, seqs[i:i + cfg.batch_size], cfg.num_anchors, cfg.gamma, gen,
                           cached[i:i + cfg.batch_size] if cached is not None else None)
        if parts is None:
            continue
        w = float(parts.weight)
        for key, t in (("val_loss", parts.total), ("val_ce", parts.ce), ("val_tv", parts.tv),
                       ("val_acc", parts.accuracy)):
            sums[key] += w * float(t)
        weight += w
    draft.train(was_training)
    return {k: v / weight for k, v in sums.items()} if weight else {}


def train(draft: DSparkDraft, target: QwenForCausalLM, seqs: list[tuple[torch.Tensor, torch.Tensor]],
          cfg: TrainConfig, log_path: Path | None = None,
          checkpoint: Callable[[int], None] | None = None, resume: dict | None = None,
          save_state: Callable[[dict], None] | None = None) -> list[dict]:
    """Train in place; returns the per-step log (also appended to `log_path` as JSON lines). `checkpoint(step)`
    is called every `save_every_minutes`. A run cut short by `stop_minutes` hands `save_state` a resume state
    (optimizer, step, time trained, data order, generator); `resume` continues one on the same schedule."""
    params = freeze_shared(draft)
    target.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    first, trained_s = 0, 0.0
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        gen.set_state(resume["generator"].cpu())  # torch.load may have mapped it to the GPU
        first, trained_s, order = resume["step"], resume["trained_s"], list(resume["order"])
        print(f"train: resuming at step {first} after {trained_s / 60:.2f} minutes", file=sys.stderr)
    keep, held = split_validation(len(seqs), cfg.val_sequences, cfg.seed)  # checked before the target pass
    cache = cache_target_features(target, seqs, draft.config.target_layer_ids, cfg.batch_size) \
        if cfg.cache_features else None
    val_seqs, val_cache = [], None
    if held:
        val_seqs, seqs = [seqs[i] for i in held], [seqs[i] for i in keep]
        if cache is not None:
            val_cache, cache = [cache[i] for i in held], [cache[i] for i in keep]
    per_epoch = max(1, math.ceil(len(seqs) / cfg.batch_size))
    total = cfg.steps or max(1, int(round(cfg.epochs * per_epoch)))
    log, t0 = [], time.perf_counter() - trained_s  # t0: when the schedule's clock started
    tokens = resume["tokens"] if resume is not None else 0
    last_save = run_start = time.perf_counter()
    logf = open(log_path, "a") if log_path else None
    draft.train()
    for step in range(first, total):
        if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
            print(f"train: stopping at step {step}: --max-minutes {cfg.max_minutes} reached", file=sys.stderr)
            break
        if (cfg.stop_minutes is not None and time.perf_counter() - run_start > 60 * cfg.stop_minutes) \
                or (cfg.stop_step is not None and step >= cfg.stop_step):
            state = {"optimizer": opt.state_dict(), "generator": gen.get_state(), "step": step, "order": order,
                     "trained_s": time.perf_counter() - t0, "tokens": tokens}
            print(f"train: pausing at step {step} after {state['trained_s'] / 60:.2f} minutes of training",
                  file=sys.stderr)
            if save_state is not None:
                save_state(state)
            break
        while len(order) < cfg.batch_size:
            order += torch.randperm(len(seqs), generator=gen).tolist()
        lr = lr_at(step, total, cfg, time.perf_counter() - t0)
        for g in opt.param_groups:
            g["lr"] = lr
        picked, order = order[:cfg.batch_size], order[cfg.batch_size:]
        parts = train_step(draft, target, [seqs[i] for i in picked], cfg.num_anchors, cfg.gamma, gen,
                           [cache[i] for i in picked] if cache is not None else None)
        if parts is None:
            continue
        opt.zero_grad(set_to_none=True)
        parts.total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        tokens += sum(int(seqs[i][0].shape[0]) for i in picked)
        rec = {"step": step, "lr": lr, "loss": parts.total.item(), "ce": parts.ce.item(), "tv": parts.tv.item(),
               "conf": parts.conf.item(), "acc": parts.accuracy.item(), "grad_norm": float(gnorm),
               "tokens_per_s": tokens / (time.perf_counter() - t0)}
        log.append(rec)
        if logf:
            logf.write(json.dumps(rec) + "\n")
        if checkpoint is not None and cfg.save_every_minutes is not None \
                and time.perf_counter() - last_save > 60 * cfg.save_every_minutes:
            if logf:
                logf.flush()
            checkpoint(step)
            last_save = time.perf_counter()
        if step % cfg.log_every == 0 or step == total - 1:
            print(f"step {step}/{total} lr {lr:.2e} loss {rec['loss']:.4f} ce {rec['ce']:.4f} tv {rec['tv']:.4f} "
                  f"conf {rec['conf']:.4f} acc {rec['acc']:.3f} tok/s {rec['tokens_per_s']:.0f}", file=sys.stderr)
        if val_seqs and cfg.val_every and (step + 1) % cfg.val_every == 0:
            _report_validation(draft, target, val_seqs, val_cache, cfg, step, logf)
    if val_seqs and log:
        _report_validation(draft, target, val_seqs, val_cache, cfg, log[-1]["step"], logf)
    if logf:
        logf.close()
    draft.eval()
    return log


def _report_validation(draft: DSparkDraft, target: QwenForCausalLM, seqs: list, cached: list | None,
                       cfg: TrainConfig, step: int, logf) -> None:
    rec = {"step": step, **evaluate(draft, target, seqs, cached, cfg)}
    if logf:
        logf.write(json.dumps(rec) + "\n")
    print(f"step {step} held-out ({len(seqs)} sequences): loss {rec.get('val_loss', float('nan')):.4f} "
          f"tv {rec.get('val_tv', float('nan')):.4f} acc {rec.get('val_acc', float('nan')):.3f}", file=sys.stderr)
