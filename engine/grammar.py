"""Grammars: structured-output specs compiled with xgrammar against the target's tokenizer, cached by spec (LRU,
bounded), and the per-request GrammarState made from them. xgrammar is an optional extra (`.[structured]`); without
it a request asking for structured output is refused naming the field."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from .grammar_state import GrammarState
from .structured_outputs import StructuredOutputsParams

MAX_CACHED = 64  # compiled grammars kept (least recently used dropped first)
MAX_WHITESPACE = 20  # JSON: consecutive whitespace characters at most (a model cannot pad forever)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
INSTALL_HINT = "structured outputs need xgrammar on the server: pip install 'dspark-serve[structured]'"


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's error without its source location."""
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(e).strip().splitlines()]
    return " ".join(line for line in lines if line)[:500]


class Grammars:
    """The compiler for one tokenizer and vocab (built on first use) and its cache. Thread-safe: the step loop's
    worker threads compile while the loop runs."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = MAX_CACHED) -> None:
        """tokenizer: a `tokenizers.Tokenizer` (or None: every request asking is refused); vocab_size: the target's
        logits width; stop_token_ids: what may end the output once the grammar is complete (the EOS ids)."""
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, tuple(stop_token_ids)
        self.max_cached = max_cached
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # compilations done (cache misses)

    def _compiler_for(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the target's tokenizer")
                if not self.stop_token_ids:
                    raise ValueError("structured outputs need an EOS token id (the target's generation_config has "
                                     "none)")
                vocab = self.tokenizer.get_vocab(with_added_tokens=True)
                encoded = [""] * self.vocab_size
                for token, i in vocab.items():
                    if i < self.vocab_size:
                        encoded[i] = token
                meta = xgr.TokenizerInfo._detect_metadata_from_hf(self.tokenizer.to_str())
                info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.stop_token_ids),
                                         add_prefix_space=meta["add_prefix_space"])
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams, prefix: str = "structured_outputs") -> Any:
        """The compiled grammar of `params` (cached); ValueError naming `prefix`.kind when it does not compile."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiler = self._compiler_for()
        try:
            compiled = _compile(compiler, params)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and more) for a bad spec
            raise ValueError(f"{prefix}.{params.kind} does not compile: {_message(e)}") from None
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def state(self, params: StructuredOutputsParams | None) -> GrammarState | None:
        """A fresh matcher for one request (None when it has no structured output)."""
        if params is None:
            return None
        xgr = _xgrammar()
        return GrammarState(xgr.GrammarMatcher(self.compile(params)), self.vocab_size)

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def _compile(compiler: Any, p: StructuredOutputsParams) -> Any:
    any_ws = not p.disable_any_whitespace
    kind = p.kind
    # strict: only the properties and items a schema lists, unless it allows more (xgrammar's default, vLLM's too)
    ws = {"any_whitespace": any_ws, "max_whitespace_cnt": MAX_WHITESPACE if any_ws else None, "strict_mode": True}
    if kind == "json":
        return compiler.compile_json_schema(p.json, **ws)
    if kind == "json_object":
        return compiler.compile_json_schema(json.dumps({"type": "object"}), **ws)
    if kind == "regex":
        return compiler.compile_regex(p.regex)
    if kind == "grammar":
        return compiler.compile_grammar(p.grammar)
    if kind == "choice":  # one of the strings, escaped by xgrammar itself
        tag = {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "const_string", "value": c} for c in p.choice]}}
        return compiler.compile_structural_tag(json.dumps(tag))
    return compiler.compile_structural_tag(p.structural_tag)
