"""A prompt corpus from files that install with the package registries: code prompts from Python sources
(a function's signature and docstring: "complete this function"), prose prompts from text paragraphs.

usage: python -m dspark_serve.train.corpus --python-src /usr/lib/python3.11 --text wiki.txt --out corpus/
writes train.jsonl and the held-out heldout_code.jsonl / heldout_prose.jsonl (each row: {"prompt", "kind", "source"});
repeated prompts are dropped, and `--exclude old/heldout_code.jsonl` keeps an earlier held-out set out of a new corpus.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path


def code_prompts(root: str | Path, limit: int) -> list[dict]:
    """`def name(args):` + its docstring from every documented function, as a completion prompt."""
    rows: list[dict] = []
    for path in sorted(Path(root).rglob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
                continue
            doc = node.body[0]
            head = "\n".join(lines[node.lineno - 1:doc.end_lineno])
            if 40 <= len(head) <= 1200 and head.lstrip().startswith(("def ", "async def ")):
                rows.append({"prompt": _dedent(head) + "\n", "kind": "code", "source": str(path)})
                if len(rows) >= limit:
                    return rows
    return rows


def prose_prompts(path: str | Path, limit: int) -> list[dict]:
    """The first sentence or two of each paragraph, to be continued."""
    rows = []
    for para in Path(path).read_text(encoding="utf-8").split("\n\n"):
        text = " ".join(para.split())
        if len(text) < 80:
            continue
        cut = text.find(". ", 60)
        rows.append({"prompt": text[:cut + 1] if 0 < cut < 400 else text[:300], "kind": "prose",
                     "source": str(path)})
        if len(rows) >= limit:
            break
    return rows


def _dedent(text: str) -> str:
    lines = text.splitlines()
    pad = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    return "\n".join(ln[pad:] for ln in lines)


def _key(prompt: str) -> str:
    return " ".join(prompt.split())


def dedupe(rows: list[dict], exclude: set[str]) -> list[dict]:
    """rows without repeats and without any prompt in `exclude` (both compared with whitespace collapsed)."""
    seen, out = set(exclude), []
    for r in rows:
        k = _key(r["prompt"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out


def split(rows: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    return rows[heldout:], rows[:heldout]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python-src", action="append", default=[], help="a directory of .py files (repeatable)")
    ap.add_argument("--text", action="append", default=[], help="a plain-text file of paragraphs (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-code", type=int, default=20000)
    ap.add_argument("--max-prose", type=int, default=10000)
    ap.add_argument("--heldout", type=int, default=64, help="held-out prompts per kind")
    ap.add_argument("--exclude", action="append", default=[],
                    help="a .jsonl of prompts (e.g. earlier held-out sets) to leave out everywhere (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    exclude = {_key(r["prompt"]) for f in args.exclude for r in map(json.loads, Path(f).read_text().splitlines())
               if isinstance(r, dict) and isinstance(r.get("prompt"), str)}
    code = dedupe([r for d in args.python_src for r in code_prompts(d, args.max_code)], exclude)[:args.max_code]
    prose = dedupe([r for f in args.text for r in prose_prompts(f, args.max_prose)], exclude)[:args.max_prose]
    if not code and not prose:
        raise SystemExit("corpus: no prompts found (give --python-src and/or --text)")
    code_train, code_held = split(code, args.heldout, args.seed)
    prose_train, prose_held = split(prose, args.heldout, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", code_train + prose_train), ("heldout_code.jsonl", code_held),
                       ("heldout_prose.jsonl", prose_held)):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"corpus: {len(code_train)} + {len(prose_train)} training prompts (code + prose), held out "
          f"{len(code_held)} code and {len(prose_held)} prose, in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
