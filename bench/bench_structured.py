"""Structured outputs on the demo pair: how many outputs are valid for their JSON schema (64 prompts, T = 0 and 0.8,
speculative), and batch-1 tokens/s of plain and speculative decoding with and without a schema, with tau, ms per
step, the host ms per step in the grammar's hooks and the Triton kernels compiled during each, and tau with the
draft's walk unmasked (the grammar still masks the target).

usage: python bench/bench_structured.py [--target DIR] [--draft DIR] [--prompts 64] [--speed-prompts 8]
                                        [--max-tokens 160] [--device cpu] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema
import torch

from dspark_serve.engine import draft_side, grammar_draft, grammar_state, logits_processing
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.structured_outputs import StructuredOutputsParams
from dspark_serve.models.demo import DEMO_DRAFTER, demo_target_dir
from dspark_serve.train.data import CHAT_TEMPLATE

_S, _I = {"type": "string", "maxLength": 60}, {"type": "integer", "minimum": 0, "maximum": 100000}
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": _S, "age": _I, "skills": {
        "type": "array", "maxItems": 5, "items": _S}}, "required": ["name", "age", "skills"]}),
    ("a book", {"type": "object", "properties": {"title": _S, "author": _S, "year": _I, "genre": {
        "enum": ["fiction", "science", "history", "poetry"]}}, "required": ["title", "author", "year", "genre"]}),
    ("a Python function", {"type": "object", "properties": {"name": _S, "args": {"type": "array", "maxItems": 4,
                                                                                  "items": _S},
                                                         "returns": _S, "pure": {"type": "boolean"}},
                           "required": ["name", "args", "returns", "pure"]}),
    ("a city", {"type": "object", "properties": {"city": _S, "country": _S, "population": _I,
                                                 "coastal": {"type": "boolean"}},
                "required": ["city", "country", "population", "coastal"]}),
    ("a bug report", {"type": "object", "properties": {"title": _S, "severity": {"enum": ["low", "medium", "high"]},
                                                       "steps": {"type": "array", "maxItems": 4, "items": _S}},
                      "required": ["title", "severity", "steps"]}),
    ("a recipe", {"type": "object", "properties": {"dish": _S, "minutes": _I, "ingredients": {
        "type": "array", "maxItems": 6, "items": _S}}, "required": ["dish", "minutes", "ingredients"]}),
    ("an HTTP request", {"type": "object", "properties": {"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                                                          "path": _S, "status": _I},
                         "required": ["method", "path", "status"]}),
    ("a git commit", {"type": "object", "properties": {"message": _S, "files": {"type": "array", "maxItems": 4,
                                                                                "items": _S}, "insertions": _I},
                      "required": ["message", "files", "insertions"]}),
]
TOPICS = ["for a web app", "about space travel", "from the 1990s", "in a small town", "for a data pipeline",
          "about cooking", "for a game", "in Japan"]


def cases(count: int) -> list[tuple[str, dict]]:
    """`count` (prompt, schema) pairs: each schema with each topic in turn."""
    out = []
    for k in range(count):
        what, schema = SCHEMAS[k % len(SCHEMAS)]
        topic = TOPICS[(k // len(SCHEMAS)) % len(TOPICS)]
        out.append((CHAT_TEMPLATE.format(f"Describe {what} {topic} as JSON with the fields "
                                         f"{', '.join(schema['properties'])}."), schema))
    return out


def params(schema: dict | None, temperature: float, max_tokens: int, seed: int = 0) -> SamplingParams:
    so = StructuredOutputsParams(json=json.dumps(schema)) if schema is not None else None
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, structured_outputs=so)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


class GrammarClock:
    """Host ms in the grammar's hooks while a run lasts: the target's masks (logits_processing.apply_grammar, which
    waits for the drafts on the device), the draft walk's masks (DraftMasks.allowed, which waits for each drafted
    token) and the state's advance over committed tokens."""

    HOOKS = ((logits_processing, "apply_grammar"), (grammar_draft.DraftMasks, "allowed"),
             (grammar_state.GrammarState, "advance"))

    def __init__(self) -> None:
        self.ms = {name: 0.0 for _, name in self.HOOKS}

    def __enter__(self) -> GrammarClock:
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in self.HOOKS]
        for owner, name, fn in self._saved:
            setattr(owner, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def _timed(self, name: str, fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.ms[name] += 1e3 * (time.perf_counter() - t)
        return run


def batch1(llm: LLM, work: list[tuple[str, dict]], schema: bool, max_tokens: int, spec: int | None) -> dict:
    """Tokens/s one request after another, tau, ms per step (and of it, host ms per step in the grammar's hooks),
    and the Triton kernels compiled meanwhile (each stalls the run for its compile: their names and ms)."""
    from dspark_serve.kernels.jit_watch import WATCH

    sync = torch.cuda.synchronize if llm.target.device.type == "cuda" else (lambda: None)
    compiled = WATCH.count
    outs, t0 = [], time.perf_counter()
    sync()
    with GrammarClock() as clock:
        for prompt, s in work:
            outs.append(llm.generate_one(prompt, params(s if schema else None, 0.0, max_tokens),
                                         num_speculative_tokens=spec))
    sync()
    seconds = time.perf_counter() - t0
    steps = sum(o.stats["steps"] for o in outs)
    accepted = sum(o.stats["accepted"] for o in outs)
    new = WATCH.compiles[compiled:]
    return {"tok_s": sum(len(o.token_ids) for o in outs) / seconds, "tau": (accepted + steps) / max(steps, 1),
            "tokens": sum(len(o.token_ids) for o in outs), "ms_per_step": 1e3 * seconds / max(steps, 1),
            "kernels_compiled": len(new), "compile_ms": sum(c.ms for c in new),
            "compiled": sorted({c.kernel for c in new}),
            **{f"{name}_ms_per_step": ms / max(steps, 1) for name, ms in clock.ms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(demo_target_dir()))
    ap.add_argument("--draft", default=str(DEMO_DRAFTER))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--json")
    args = ap.parse_args()
    llm = LLM(args.target, args.draft, device=args.device, dtype=args.dtype, max_num_seqs=max(args.prompts, 8))
    work = cases(args.prompts)
    result: dict = {"device": str(llm.target.device), "prompts": args.prompts, "max_tokens": args.max_tokens}
    for t in (0.0, 0.8):
        t0 = time.perf_counter()
        outs = llm.generate([p for p, _ in work], [params(s, t, args.max_tokens, seed=i)
                                                   for i, (_, s) in enumerate(work)])
        ok = sum(valid(o.text, s) for o, (_, s) in zip(outs, work))
        result[f"valid_T{t}"] = ok / len(work)
        result[f"finished_T{t}"] = sum(o.finish_reason == "stop" for o in outs) / len(work)
        print(f"T = {t}: {ok}/{len(work)} valid ({time.perf_counter() - t0:.0f} s)", flush=True)
    speed = work[:args.speed_prompts]
    llm.generate_one(speed[0][0], params(speed[0][1], 0.0, 16))  # warm: the grammar cache, first calls
    for name, schema, spec in (("plain_schema", True, 0), ("spec_schema", True, None),
                               ("plain", False, 0), ("spec", False, None)):
        result[name] = batch1(llm, speed, schema, args.max_tokens, spec)
        print(name, {k: round(v, 2) if isinstance(v, float) else v for k, v in result[name].items()}, flush=True)
    masks = draft_side.DraftMasks
    draft_side.DraftMasks = lambda *a: None
    try:
        result["spec_schema_unmasked_draft"] = batch1(llm, speed, True, args.max_tokens, None)
    finally:
        draft_side.DraftMasks = masks
    print("spec_schema_unmasked_draft", {k: round(v, 2) if isinstance(v, float) else v
                                         for k, v in result["spec_schema_unmasked_draft"].items()})
    result["speedup_schema"] = result["spec_schema"]["tok_s"] / result["plain_schema"]["tok_s"]
    result["speedup"] = result["spec"]["tok_s"] / result["plain"]["tok_s"]
    print(f"speculative / plain: {result['speedup_schema']:.2f}x with a schema, {result['speedup']:.2f}x without")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
