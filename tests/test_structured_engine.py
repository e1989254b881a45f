"""Structured outputs in the engine: the grammar state's look-ahead and rollback, speculative sampling of the masked
target (chi-square against the exact masked distribution), greedy speculative equal to plain greedy with a grammar,
and every output valid for its schema at T = 0 and T = 0.8."""

import itertools
import json
import re

import jsonschema
import pytest
import torch
from byte_tokenizer import byte_tokenizer
from engine_pairs import build_pair
from penalized import next_logits
from test_engine_sampling import _chi2_sf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dspark_serve.engine.grammar import Grammars
from dspark_serve.engine.grammar_state import unpack_bitmask
from dspark_serve.engine.llm import LLM
from dspark_serve.engine.sampling import processed_probs
from dspark_serve.engine.sampling_params import SamplingParams
from dspark_serve.engine.structured_outputs import StructuredOutputsParams as SO

LETTERS = "abcdefgh"  # token i is LETTERS[i]; "h" (7) is the EOS
EOS = 7
# The second letter's allowed set depends on the first: a -> b|c, b -> d|e, c..f -> a..f; then one of a..g.
REGEX = "(a[bc]|b[de]|[c-f][a-f])[a-g]"


def letters_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def allowed(output: list[int]) -> set[int]:
    """The regex's next tokens after `output` (by hand)."""
    k = len(output)
    if k == 0:
        return set(range(6))
    if k == 1:
        return {0: {1, 2}, 1: {3, 4}}.get(output[0], set(range(6)))
    if k == 2:
        return set(range(7))
    return {EOS}


def test_bitmask_unpacks_bit_b_of_word_w_to_token_32w_plus_b():
    bits = torch.tensor([[1 - (1 << 31), 0], [0, -1]], dtype=torch.int32)  # bits 0 and 31  # -1: every bit
    got = unpack_bitmask(bits, 40)
    assert got[0].nonzero().flatten().tolist() == [0, 31]
    assert got[1].nonzero().flatten().tolist() == list(range(32, 40))


class _RefuseFirstRow:
    """Draft masks under which row 0's grammar allows no token at any step and row 1's allows every token."""

    def __init__(self, rows: int, vocab: int) -> None:
        self.rows, self.vocab = rows, vocab

    def allowed(self, k, prev):
        ok = torch.ones(self.rows, self.vocab, dtype=torch.bool)
        ok[0] = False
        return ok

    def close(self) -> None:
        pass


@pytest.mark.parametrize("spec", [{}, {"dspark_draft_topk": 4}], ids=["full", "topk"])
def test_a_row_whose_grammar_allows_nothing_the_draft_can_say_walks_unmasked(spec):
    target, draft = build_pair(seed=3, vocab=64, block_size=3, markov_rank=4)
    side = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=64).draft
    w = side.model.fc.weight
    hidden = torch.randn(2, side.num_speculative_tokens, w.shape[0], generator=torch.Generator().manual_seed(0),
                         dtype=w.dtype)
    args = (hidden, side.model.head_logits(hidden), torch.tensor([1, 2]), torch.tensor([0.8, 0.8]),
            torch.tensor([5, 6]), torch.tensor([10, 10]), True)
    free, refused = side.markov_walk(*args), side.markov_walk(*args, masks=_RefuseFirstRow(2, 64))
    assert torch.equal(refused.tokens, free.tokens)
    q_free, q_refused = free.dense_probs(64), refused.dense_probs(64)
    assert q_refused.isfinite().all() and torch.allclose(q_refused, q_free)


class _ForceEvenSteps:
    """Step k even: row 0 may say token 5 only (forced); row 1 may say 5 or 6; odd steps allow everything."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def allowed(self, k, prev):
        ok = torch.ones(2, self.vocab, dtype=torch.bool)
        if k % 2 == 0:
            ok[:] = False
            ok[0, 5] = ok[1, 5] = ok[1, 6] = True
        return ok

    def close(self) -> None:
        pass


@pytest.mark.parametrize("spec, temperature", [({}, 0.0), ({"dspark_draft_topk": 64}, 0.8)],
                         ids=["full-greedy", "topk-sampled"])
def test_a_step_the_grammar_forces_is_drafted_with_certainty(spec, temperature):
    """Where the grammar allows one token the draft drafts it and its confidence is 1; elsewhere the confidence is
    the head's own."""
    target, draft = build_pair(seed=3, vocab=64, block_size=3, markov_rank=4)
    side = LLM(target, draft, spec, device="cpu", block_size=8, num_kv_blocks=64).draft
    w = side.model.fc.weight
    hidden = torch.randn(2, side.num_speculative_tokens, w.shape[0], generator=torch.Generator().manual_seed(0),
                         dtype=w.dtype)
    temps = torch.tensor([temperature] * 2)
    args = (hidden, side.model.head_logits(hidden), torch.tensor([1, 2]), temps, torch.tensor([5, 6]),
            torch.tensor([10, 10]), temperature > 0)
    free, forced = side.markov_walk(*args), side.markov_walk(*args, masks=_ForceEvenSteps(64))
    conf, base = torch.sigmoid(forced.confidence_logits), torch.sigmoid(free.confidence_logits)
    even = torch.arange(side.num_speculative_tokens) % 2 == 0
    assert (forced.tokens[0, even] == 5).all() and (conf[0, even] == 1.0).all()
    assert torch.isin(forced.tokens[1, even], torch.tensor([5, 6])).all() and (conf[1, even] < 1.0).all()
    assert torch.equal(conf[1, 0], base[1, 0])  # step 0 follows the same anchor: the head's own confidence
    m, prev = side.model, torch.cat([torch.tensor([[1], [2]]), forced.tokens[:, :-1]], 1)  # each step's previous
    for k in range(1, side.num_speculative_tokens, 2):  # steps the grammar leaves free: the head's confidence
        head = torch.sigmoid(m.confidence_logit(hidden[:, k], m.markov_embed(prev[:, k])))
        assert torch.allclose(conf[:, k], head, atol=1e-6), k


def _mask(state, drafts):
    return [set(r.nonzero().flatten().tolist()) for r in unpack_bitmask(state.masks_for(drafts), len(LETTERS))]


def test_masks_look_ahead_over_drafts_and_roll_back():
    grammars = Grammars(letters_tokenizer(), len(LETTERS), (EOS,))
    state = grammars.state(SO(regex=REGEX))
    assert _mask(state, [0, 1, 6]) == [allowed([]), allowed([0]), allowed([0, 1]), allowed([0, 1, 6])]
    assert _mask(state, []) == [allowed([])]  # the look-ahead left the state where it was
    # a draft the grammar refuses (a -> d): its row and every later one repeat the mask it was refused under
    assert _mask(state, [0, 3, 2]) == [allowed([]), allowed([0]), allowed([0]), allowed([0])]
    assert state.advance([1, 4])  # accepted b, correction e
    assert _mask(state, [5]) == [allowed([1, 4]), allowed([1, 4, 5])]
    state.rollback(1)  # back to after b
    assert _mask(state, []) == [allowed([1])]
    assert not state.advance([0]) and state.failed  # b -> a is refused: the mask is off from there
    assert _mask(state, [])[0] == set(range(len(LETTERS)))
    assert grammars.compiled == 1 and grammars.state(SO(regex=REGEX)) is not None and grammars.compiled == 1


@pytest.mark.parametrize("so, field", [
    (SO(json='{"type": "nonsense"}'), "structured_outputs.json does not compile: Unsupported type"),
    (SO(regex="(ab"), "structured_outputs.regex does not compile"),
    (SO(grammar="root ::= foo"), "structured_outputs.grammar does not compile"),
    (SO(structural_tag='{"type": "structural_tag", "format": {"type": "bogus"}}'), "structural_tag does not compile"),
])
def test_specs_that_do_not_compile_name_their_field(so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        Grammars(letters_tokenizer(), len(LETTERS), (EOS,)).compile(so)


@pytest.mark.parametrize("body, error", [
    ({}, "exactly one of"), ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"jsn": {}}, "structured_outputs.jsn is not a structured output kind"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1]"}, "structured_outputs.json must be a JSON object"), ({"regex": 3}, "regex must be a non-empty"),
])
def test_bad_shapes_name_their_field(body, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        SO.from_dict(body)


def test_the_cache_is_bounded_and_least_recently_used():
    g = Grammars(letters_tokenizer(), len(LETTERS), (EOS,), max_cached=2)
    for r in ("a", "b", "a", "c", "a"):
        g.compile(SO(regex=r))
    assert g.compiled == 3 and g.num_cached == 2  # "b" went out when "c" came; "a" stayed (used last)


def test_json_schemas_are_strict_as_vllm_s():
    """A schema's listed properties only (xgrammar's strict mode, which vLLM compiles with): a model cannot ramble
    on in keys of its own; a free-form object and an explicit additionalProperties still take any key."""
    tok = byte_tokenizer(257, specials=1)  # ids 0-255 the bytes, 256 the EOS
    g = Grammars(tok, 257, (256,))

    def accepts(so: SO, text: str) -> bool:
        state = g.state(so)
        return all(state.matcher.accept_token(t) for t in tok.encode(text).ids)

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert accepts(SO(json=json.dumps(schema)), '{"name": "x"}')
    assert not accepts(SO(json=json.dumps(schema)), '{"name": "x", "extra": 1}')
    assert accepts(SO(json=json.dumps({**schema, "additionalProperties": True})), '{"name": "x", "extra": 1}')
    assert accepts(SO(json_object=True), '{"a": [1, {"b": 2}], "c": null}')


VOCAB, PROMPT, SAMPLES = 8, [1, 5, 2], 3000


def _exact_joint(target, params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(t2, t3) of the masked target alone (t1 summed out)."""
    def p_next(seq):
        logits = next_logits(target, seq)
        ok = torch.zeros(VOCAB, dtype=torch.bool)
        ok[list(allowed(seq[len(PROMPT):]))] = True
        logits = logits.masked_fill(~ok, float("-inf"))[None, None]
        t = lambda x, d: torch.tensor([x], dtype=d)  # noqa: E731
        return processed_probs(logits, t(params.temperature, torch.float32), t(params.top_k, torch.int64),
                               t(params.top_p, torch.float32), t(params.min_p, torch.float32))[0, 0].double()
    joint = {k: 0.0 for k in itertools.product(range(VOCAB), repeat=2)}
    p1 = p_next(PROMPT)
    for a in range(VOCAB):
        if p1[a] > 0:
            p2 = p_next(PROMPT + [a])
            for b in range(VOCAB):
                if p2[b] > 0:
                    p3 = p_next(PROMPT + [a, b])
                    for c in range(VOCAB):
                        joint[(b, c)] += float(p1[a] * p2[b] * p3[c])
    return joint


@pytest.mark.parametrize("params, spec", [
    (SamplingParams(temperature=1.0, max_tokens=3), {}),
    (SamplingParams(temperature=0.8, top_k=5, max_tokens=3), {"dspark_draft_topk": 3}),
], ids=["t1", "t0.8-topk"])
def test_speculative_sampling_matches_the_masked_target(params, spec):
    target, draft = build_pair(seed=11, vocab=VOCAB, block_size=3, markov_rank=4, agree=0.05)
    # every capped draft verified (at 512 requests a step the policy would verify none of these drafts)
    llm = LLM(target, draft, {"enable_adaptive_verification": False, **spec}, device="cpu", block_size=8,
              num_kv_blocks=4096, max_num_seqs=512, tokenizer=letters_tokenizer(), eos_token_ids=(EOS,))
    so = SO(regex=REGEX)
    outs = llm.generate([PROMPT] * SAMPLES, [SamplingParams(**{**params.__dict__, "seed": s, "structured_outputs": so})
                                             for s in range(SAMPLES)])
    assert sum(o.stats["drafted"] for o in outs) == SAMPLES  # tokens 2 and 3 went through verification
    assert sum(o.stats["accepted"] for o in outs) > SAMPLES / 40  # some outputs are accepted drafts
    counts: dict[tuple[int, int], int] = {}
    for o in outs:
        counts[tuple(o.token_ids[1:])] = counts.get(tuple(o.token_ids[1:]), 0) + 1
        assert re.fullmatch(REGEX, o.text), o.text
    exact = _exact_joint(target, params)
    assert all(exact[k] > 0 for k in counts), "a token outside the masked target's support was emitted"
    cells = [k for k in exact if exact[k] * SAMPLES >= 5]
    rest = 1.0 - sum(exact[k] for k in cells)
    stat = sum((counts.get(k, 0) - SAMPLES * exact[k]) ** 2 / (SAMPLES * exact[k]) for k in cells)
    observed_rest = SAMPLES - sum(counts.get(k, 0) for k in cells)
    if rest * SAMPLES >= 1:
        stat += (observed_rest - SAMPLES * rest) ** 2 / (SAMPLES * rest)
    p_value = _chi2_sf(stat, len(cells) - (0 if rest * SAMPLES >= 1 else 1))
    assert p_value > 1e-3, (stat, len(cells), p_value)
    unmasked = {k: v for k, v in _exact_joint_unmasked(target, params).items()}
    stat_u = sum((counts.get(k, 0) - SAMPLES * unmasked[k]) ** 2 / (SAMPLES * unmasked[k])
                 for k in unmasked if unmasked[k] * SAMPLES >= 5)
    assert _chi2_sf(stat_u, len(cells)) < 1e-3  # the check has power: the unmasked target is far off


def _exact_joint_unmasked(target, params):
    global allowed
    saved = allowed
    allowed = lambda out: set(range(VOCAB))  # noqa: E731
    try:
        return _exact_joint(target, params)
    finally:
        allowed = saved


FIXED = {"enable_adaptive_verification": False}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 2,
                                                                          "items": {"type": "string", "maxLength": 3}}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -5, "maximum": 5}},
]


@pytest.fixture(scope="module")
def byte_llm():
    target, draft = build_pair(seed=5, agree=0.005)  # every capped slot verified: no step timings in the outputs
    return LLM(target, draft, FIXED, device="cpu", block_size=8, num_kv_blocks=512, max_num_seqs=16,
               tokenizer=byte_tokenizer(256), eos_token_ids=(0,))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_greedy_speculative_with_a_grammar_equals_plain_greedy(byte_llm, static):
    """Batched with unconstrained requests; the drafts are often refused by the grammar and rejected, so the state
    rolls back over them; plain decoding (no drafts) gives the same tokens."""
    llm = byte_llm
    if static:
        target, draft = build_pair(seed=5, agree=0.005)
        llm = LLM(target, draft, FIXED, device="cpu", block_size=8, num_kv_blocks=512, max_num_seqs=16,
                  enforce_eager=False, tokenizer=byte_tokenizer(256), eos_token_ids=(0,))
    specs = [SO(json=json.dumps(s), disable_any_whitespace=True) for s in SCHEMAS] + [
        SO(regex="[a-c]{2,5}-[0-9]{2}"), SO(choice=("cat", "dog", "horse")),
        SO(grammar='root ::= "(" [0-9] [0-9]? ("+" [0-9] [0-9]?)? ")"')]
    prompts = [[3, 4, 5], [9, 9, 1], [7], [200, 17, 30]]
    cases = [(p, s) for p in prompts for s in specs]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=s) for _, s in cases]
    plain = SamplingParams(temperature=0.0, max_tokens=20)
    outs = llm.generate([p for p, _ in cases] + prompts, params + [plain] * len(prompts))
    for (prompt, so), out, p in zip(cases, outs, params):
        ref = llm.generate_one(prompt, p, num_speculative_tokens=0)
        assert out.token_ids == ref.token_ids, (prompt, so.kind)
        _check_valid(out, so)
    for prompt, out in zip(prompts, outs[len(cases):]):
        assert out.token_ids == llm.generate([prompt], plain)[0].token_ids
    s = [o.stats for o in outs[:len(cases)]]
    assert sum(x["accepted"] for x in s) > 150 and sum(x["drafted"] - x["accepted"] for x in s) > 30


@pytest.mark.parametrize("topk", [0, 8], ids=["full", "topk"])
def test_masking_the_drafts_raises_acceptance(byte_llm, topk, monkeypatch):
    """The same greedy requests with the draft's walk unmasked: the same tokens, far fewer accepted drafts. With
    top-k drafting too (the unmasked top 8 of 256 seldom hold what the grammar allows)."""
    from dspark_serve.engine import draft_side

    if topk:
        byte_llm = LLM(*build_pair(seed=5, agree=0.005), {**FIXED, "dspark_draft_topk": topk}, device="cpu",
                       block_size=8, num_kv_blocks=512, max_num_seqs=16, tokenizer=byte_tokenizer(256),
                       eos_token_ids=(0,))
    specs = [SO(json=json.dumps(s), disable_any_whitespace=True) for s in SCHEMAS] + [SO(regex="[a-c]{2,5}-[0-9]{2}")]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=s) for s in specs]
    masked = byte_llm.generate([[3, 4, 5]] * len(params), params)
    monkeypatch.setattr(draft_side, "DraftMasks", lambda *args: None)
    unmasked = byte_llm.generate([[3, 4, 5]] * len(params), params)
    assert [o.token_ids for o in masked] == [o.token_ids for o in unmasked]
    acc = [sum(o.stats["accepted"] for o in outs) for outs in (masked, unmasked)]
    steps = [sum(o.stats["steps"] for o in outs) for outs in (masked, unmasked)]
    print("accepted masked, unmasked:", acc, "steps:", steps)
    assert acc[0] > 3 * acc[1] + 20 and steps[0] < steps[1], (acc, steps)


def _check_valid(out, so: SO) -> None:
    assert out.finish_reason == "stop" and out.token_ids[-1] == 0, out.text
    text = out.text[:-1]
    if so.json is not None:
        # xgrammar's JSON strings admit raw control characters other than CR and LF (strict=False reads them)
        jsonschema.validate(json.loads(text, strict=False), json.loads(so.json))
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", text), text


def test_sampled_outputs_are_valid_for_their_schemas(byte_llm):
    specs = [SO(json=json.dumps(s), disable_any_whitespace=True) for s in SCHEMAS] + [SO(choice=("cat", "dog"))]
    cases = [(s, seed) for s in specs for seed in range(6)]
    outs = byte_llm.generate([[5, 6, 7]] * len(cases), [SamplingParams(temperature=0.8, max_tokens=60, seed=seed,
                                                                       structured_outputs=s) for s, seed in cases])
    for (so, _), out in zip(cases, outs):
        _check_valid(out, so)
    assert len({o.text for o in outs}) > len(specs) + 3  # sampled, not all alike
