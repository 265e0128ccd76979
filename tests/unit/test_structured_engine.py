"""Grammar-constrained decoding in the engine, with the default model (one engine per module).

50 JSON-schema prompts through the offline API; a constrained request batched with 31 others
leaves their greedy tokens unchanged; preemption (a tiny KV pool) and abort with grammars in
flight leak no matcher and recompute to the same tokens; n > 1 gets one matcher per completion;
EOS only where the grammar may end. The engine's door refuses what the grammar engine would fail
on; a failure mid-decode ends that request alone. The token budget closes every kind of
constraint: steered to its shortest completion before max_tokens or the context ends it.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.scheduler import RequestRejected
from engine_service.sampling.grammar import GrammarManager, apply_token_bitmask
from sluice.structured import JSON_OBJECT_LIMITS, StructuredOutputsParams
from sluice_bench.structured import UNBOUNDED_SCHEMAS, unbounded_cases, validates
from tests.structured_cases import MAX_TOKENS, cases

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=1024, num_blocks=512)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_fifty_json_schemas_offline_parse_and_validate(llm):
    pairs = cases(50)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs={"json": schema})
              for _, schema in pairs]
    outs = llm.chat([_chat(p) for p, _ in pairs], params)
    valid = 0
    for out, (_, schema) in zip(outs, pairs, strict=True):
        completion = out.outputs[0]
        doc = json.loads(completion.text)
        jsonschema.validate(doc, schema)
        assert completion.finish_reason == "stop"
        valid += 1
    assert valid == 50
    assert llm.engine.grammars.num_active == 0


def test_json_object_offline_is_the_bounded_grammar(llm):
    # SamplingParams(structured_outputs={"json_object": True}) gets JSON mode's bounded grammar, as
    # the HTTP API does: after max_items items of the loop the greedy default model falls into on
    # "Describe a city as a JSON object." ("Las Vegas", "Las Vegas", ...), only "]" is left.
    engine = llm.engine
    manager = GrammarManager(engine.tokenizer.backend.to_str(), engine.vocab_size, engine.eos_token_ids)
    seq = _Seq("j", SamplingParams(structured_outputs={"json_object": True}))
    manager.add(seq)
    text = '{"Cities": [' + ", ".join(['"Las Vegas"'] * JSON_OBJECT_LIMITS.max_items)
    for token in engine.tokenizer.encode(text, add_special_tokens=False):
        manager.accept(seq, token)
        seq.output_token_ids.append(token)
        assert seq.structured_error is None
    logits = torch.zeros(1, engine.vocab_size)
    manager.apply_bitmask(logits, [seq])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(engine.tokenizer.decode([t]).startswith("]") for t in allowed)
    manager.free("j")


def test_grammar_in_a_batch_of_32_leaves_the_others_token_identical(llm):
    prompts = [f"Write a short sentence about the number {i}." for i in range(32)]
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = llm.generate(prompts, plain)
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": r"[0-9]{2,5}"})
    mixed = llm.generate(prompts, [constrained] + [plain] * 31)
    for a, b in zip(alone[1:], mixed[1:], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert re.fullmatch(r"[0-9]{2,5}", mixed[0].outputs[0].text)
    assert alone[0].outputs[0].token_ids != mixed[0].outputs[0].token_ids
    assert llm.engine.grammars.num_active == 0


def test_n_completions_each_get_their_own_matcher(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16,
                            structured_outputs={"regex": r"(cat|dog|bird)-[0-9]{3}"})
    out = llm.generate(["Name an animal and a number:"], params)[0]
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(r"(cat|dog|bird)-[0-9]{3}", t) for t in texts), texts
    assert len(set(texts)) > 1  # independent sequences, not one matcher shared
    choice = llm.generate(["Is water wet? Answer:"], SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs={"choice": ["yes", "no", "maybe"]}))[0]
    assert choice.outputs[0].text in {"yes", "no", "maybe"}


def test_preemption_and_abort_with_grammars_in_flight(llm, model_dir):
    # long constrained outputs (20-30 words) in a pool of 14 blocks: the growth preempts
    params = [SamplingParams(temperature=0.0, max_tokens=48,
                             structured_outputs={"regex": r"[a-z]{1,8}( [a-z]{1,8}){20,30}"})] * 3
    params += [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs={"json": schema})
               for _, schema in cases(3)]
    convs = [_chat(f"Tell me a story about {topic}.") for topic in ("a cat", "the sea", "a robot")]
    convs += [_chat(p) for p, _ in cases(3)]
    roomy = llm.chat(convs, params)
    tiny = LLM(model_dir, max_model_len=256, num_blocks=14, block_size=16, enable_prefix_caching=False,
               watermark_blocks=0)
    squeezed = tiny.chat(convs, params)
    assert tiny.engine.scheduler.stats.preemptions > 0  # the pool forced recomputes
    for a, b in zip(roomy, squeezed, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    engine = tiny.engine
    assert engine.grammars.num_active == 0

    # abort with grammars running, waiting and preempted
    tok = engine.tokenizer
    for i, (conv, p) in enumerate(zip(convs, params, strict=True)):
        engine.add_request(f"a{i}", tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True)), p)
    assert engine.grammars.num_active == 6
    for _ in range(6):
        engine.step()
    outs = engine.abort_request([f"a{i}" for i in range(6)])
    assert outs and all(o.finished for o in outs)
    assert engine.grammars.num_active == 0
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_pool.num_free_blocks == engine.scheduler.block_pool.num_total_blocks
    engine.scheduler.check_invariants()


def test_invalid_constraint_is_refused_at_the_engine_door(llm):
    engine = llm.engine
    bad = SamplingParams(max_tokens=4, structured_outputs={"json": {"type": "object", "properties": {
        "x": {"type": "no-such-type"}}}})
    with pytest.raises(RequestRejected, match="structured_outputs.json"):
        engine.add_request("bad", [1, 2, 3], bad)
    with pytest.raises(RequestRejected, match="structured_outputs.regex"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs={"regex": "[a-"}))
    assert not engine.has_unfinished_requests() and engine.grammars.num_active == 0


class _Seq:
    def __init__(self, rid: str, params: SamplingParams, prompt_len: int = 8) -> None:
        self.request_id = rid
        self.sampling_params = params
        self.output_token_ids: list[int] = []
        self.structured_done = False
        self.structured_error = None
        self.prompt_len = prompt_len

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)


# Constraints that compile but that the grammar engine fails on once decoding starts:
# a recursion without a base case, a row of 30,000 alternatives, a regex its lexer cannot build.
RECURSIVE = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
             "$ref": "#/$defs/a"}
WIDE_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(30000))
HUGE_REGEX = "(a{1000}){1000}"
# Its shortest completion ("a") passes the door; the "b" "c" branch reaches a row of 3,000
# alternatives, which the grammar engine refuses only when decoding gets there.
LATE_FAILURE = 'start: "a" | "b" "c" x\nx: ' + " | ".join(f'"w{i}"' for i in range(3000))


def _clean(message: str) -> bool:
    """A message for a client: one line, none of the grammar engine's internal state."""
    return "\n" not in message and "<state>" not in message and "Parser: {" not in message and len(message) < 400


def test_constraints_the_grammar_engine_fails_on_are_refused_at_the_engine_door(llm):
    engine = llm.engine
    for so, param in (({"json": RECURSIVE}, "structured_outputs.json"),
                      ({"grammar": WIDE_GRAMMAR}, "structured_outputs.grammar"),
                      ({"regex": HUGE_REGEX}, "structured_outputs.regex")):
        with pytest.raises(RequestRejected, match=param.replace(".", r"\.")) as info:
            engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=512, structured_outputs=so))
        assert _clean(str(info.value)), str(info.value)
    # a max_tokens below the constraint's shortest completion: refused naming max_tokens
    const = {"json": {"type": "object", "properties": {"k": {"const": "x" * 60}}, "required": ["k"]}}
    with pytest.raises(RequestRejected, match=r"max_tokens \(8\) is too small"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=8, structured_outputs=const))
    assert not engine.has_unfinished_requests() and engine.grammars.num_active == 0


def test_a_constraint_failure_mid_decode_ends_that_request_alone(llm):
    engine = llm.engine
    tok = engine.tokenizer
    force_bcw = {tok.encode(ch, add_special_tokens=False)[0]: 100.0 for ch in "bcw"}
    bad = SamplingParams(temperature=0, max_tokens=64, logit_bias=force_bcw,
                         structured_outputs={"grammar": LATE_FAILURE})
    engine.add_request("late", tok.encode("Say something:"), bad)
    engine.add_request("fine", tok.encode("The capital of France is"),
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    late, fine = finished["late"], finished["fine"]
    assert late.finish_reason == "error" and late.error_code == "invalid_request"
    assert "output constraint failed" in late.error and _clean(late.error), late.error
    assert fine.finish_reason == "length" and fine.num_output_tokens == 12  # the batch went on
    assert engine.grammars.num_active == 0


def test_eos_only_where_the_grammar_may_end_and_rows_untouched(llm):
    engine = llm.engine
    manager = GrammarManager(engine.tokenizer.backend.to_str(), engine.vocab_size, engine.eos_token_ids)
    seq = _Seq("s", SamplingParams(structured_outputs={"json": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"], "additionalProperties": False}}))
    free = _Seq("f", SamplingParams())
    manager.add(seq)
    manager.add(free)
    assert manager.num_active == 1
    eos = engine.eos_token_ids[0]
    tok = engine.tokenizer
    logits = torch.randn(2, engine.vocab_size)
    before = logits.clone()
    for token in tok.encode('{"a": 7', add_special_tokens=False):
        masked = logits.clone()
        manager.apply_bitmask(masked, [free, seq])
        assert torch.equal(masked[0], before[0])  # the unconstrained row is never touched
        assert masked[1, eos] == float("-inf")  # the document is not complete: no EOS
        assert masked[1, token] == before[1, token]
        manager.accept(seq, token)
        seq.output_token_ids.append(token)
    last = tok.encode("}", add_special_tokens=False)[0]
    manager.accept(seq, last)
    seq.output_token_ids.append(last)
    assert seq.structured_done
    masked = logits.clone()
    manager.apply_bitmask(masked, [seq])
    assert torch.isfinite(masked[0]).sum() == len(set(engine.eos_token_ids))  # only EOS is left
    # a matcher out of step with its tokens (a replay after recompute) is rebuilt from them
    seq.output_token_ids = seq.output_token_ids[:2]
    masked = logits.clone()
    manager.apply_bitmask(masked, [seq])
    assert masked[0, eos] == float("-inf")
    manager.free("s")
    assert manager.num_active == 0


def test_apply_token_bitmask_only_the_given_rows():
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 1] = 1 << 4  # token 36 only
    out = logits.clone()
    apply_token_bitmask(out, [1], bitmask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [36]


def test_structured_outputs_params_forms():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.kind == "choice"
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})


# ---------------------------------------------------------------- the token budget

def _decode_with_random_logits(manager, tok, so, max_tokens, prompt_len=8, seed=0):
    """Decode one sequence as a model that prefers random tokens would (argmax of random logits
    after the mask): left alone, it writes long strings and keeps arrays going."""
    seq = _Seq(f"s{seed}", SamplingParams(max_tokens=max_tokens, structured_outputs=so), prompt_len)
    manager.add(seq)
    gen = torch.Generator().manual_seed(seed)
    limit = max_tokens if max_tokens is not None else manager.max_model_len - prompt_len
    while not seq.structured_done and seq.structured_error is None and len(seq.output_token_ids) < limit:
        logits = torch.randn(1, manager.vocab_size, generator=gen)
        manager.apply_bitmask(logits, [seq])
        token = manager.accept(seq, int(logits[0].argmax()))
        seq.output_token_ids.append(token)
    manager.free(seq.request_id)
    eos = set(manager.eos_token_ids)
    text = tok.decode([t for t in seq.output_token_ids if t not in eos])
    return seq, text


BUDGET_CONSTRAINTS = [
    ({"json": UNBOUNDED_SCHEMAS[0]}, lambda t: validates(t, UNBOUNDED_SCHEMAS[0])),
    ({"json": UNBOUNDED_SCHEMAS[5]}, lambda t: validates(t, UNBOUNDED_SCHEMAS[5])),
    ({"json": UNBOUNDED_SCHEMAS[6]}, lambda t: validates(t, UNBOUNDED_SCHEMAS[6])),  # recursive, finite
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ({"regex": r"[a-z]+( [a-z]+)*\."}, lambda t: re.fullmatch(r"[a-z]+( [a-z]+)*\.", t) is not None),
    ({"grammar": 'start: "[" item ("," item)* "]"\nitem: /[a-z]+/'},
     lambda t: re.fullmatch(r"\[[a-z]+(,[a-z]+)*\]", t) is not None),
    ({"choice": ["a fairly long answer of many words", "no"]},
     lambda t: t in ("a fairly long answer of many words", "no")),
]


@pytest.mark.parametrize("index", range(len(BUDGET_CONSTRAINTS)))
def test_the_token_budget_closes_every_kind_of_constraint(llm, index):
    so, check = BUDGET_CONSTRAINTS[index]
    engine = llm.engine
    manager = GrammarManager(engine.tokenizer.backend.to_str(), engine.vocab_size, engine.eos_token_ids,
                             max_model_len=1024)
    need = manager.check(StructuredOutputsParams.from_dict(so))
    for max_tokens in (need, need + 1, need + 7, 24):
        for seed in range(3):
            seq, text = _decode_with_random_logits(manager, engine.tokenizer, so, max(max_tokens, need), seed=seed)
            assert seq.structured_done and seq.structured_error is None, (so, max_tokens, text)
            assert len(seq.output_token_ids) <= max(max_tokens, need)
            assert check(text), (so, max_tokens, text)
    assert manager.steered > 0 and manager.num_active == 0


def test_without_the_steering_the_budget_cuts_documents(llm):
    # the same decoding with the masks alone: the random "model" runs out of tokens mid-document
    engine = llm.engine
    manager = GrammarManager(engine.tokenizer.backend.to_str(), engine.vocab_size, engine.eos_token_ids,
                             max_model_len=1024)
    manager.budget_steering = False
    cut = 0
    for so, _ in BUDGET_CONSTRAINTS[:3]:
        seq, _ = _decode_with_random_logits(manager, engine.tokenizer, so, 24)
        cut += not seq.structured_done
    assert cut == 3


def test_the_context_end_is_a_budget_too(llm):
    # no max_tokens: the context (max_model_len) ends the request; the document closes before it
    engine = llm.engine
    manager = GrammarManager(engine.tokenizer.backend.to_str(), engine.vocab_size, engine.eos_token_ids,
                             max_model_len=1000)
    so = {"json": UNBOUNDED_SCHEMAS[2]}
    seq, text = _decode_with_random_logits(manager, engine.tokenizer, so, None, prompt_len=980)
    assert seq.structured_done and len(seq.output_token_ids) <= 20
    assert validates(text, UNBOUNDED_SCHEMAS[2]), text


def test_unbounded_schemas_at_temperature_07_always_validate(llm):
    # the real model, sampled: ten unbounded schemas with a budget too small for what it writes
    pairs = unbounded_cases(10)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=40, structured_outputs={"json": schema})
              for i, (_, schema) in enumerate(pairs)]
    outs = llm.chat([_chat(p) for p, _ in pairs], params)
    for out, (_, schema) in zip(outs, pairs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and validates(c.text, schema), c
        assert len(c.token_ids) <= 40
    assert llm.engine.grammars.steered > 0 and llm.engine.grammars.num_active == 0
