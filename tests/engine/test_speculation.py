"""Prompt-lookup speculation (engine.scheduling.speculation): the n-gram proposer, and greedy output
token-for-token identical to plain decoding on tiny random fp32 models over real stdlib
code — drafts partly rejected, ends (EOS, max_tokens, stop strings) inside an accepted
run, deadline, cancellation, alternatives, several sequences decoding together — with the
KV of rejected tokens never kept."""

from __future__ import annotations

import pytest
import torch

import engine.scheduling.steps as steps_module
from engine.api import InfillRequest
from engine.text.sampler import Sampler
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sequence import Prompt, Sequence
from engine.scheduling.speculation import DraftLength, NgramIndex, VerifyCost, greedy_accept
from scheduler_doubles import drain as drain_scheduler
from scheduler_doubles import make as make_scheduler
from tiny_models import stdlib_sources, tiny_tokenizer_json

# ----------------------------------------------------------------------------- proposer


def test_index_proposes_what_followed_the_latest_earlier_occurrence():
    ix = NgramIndex([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6])
    # tail [5, 6]: latest earlier occurrence ends before 7, 9, 2, ...
    assert ix.propose(3) == [7, 9, 2]
    assert ix.propose(1) == [7]
    assert ix.propose(0) == []


def test_the_longest_tail_ngram_wins_then_shorter_ones():
    # tail [1, 2, 3] occurred once (followed by 40); tail [3] alone occurred later (followed by 50)
    ix = NgramIndex([1, 2, 3, 40, 9, 3, 50, 1, 2, 3])
    assert ix.propose(1) == [40]
    ix = NgramIndex([9, 3, 50, 7, 8, 3])  # only the 1-gram [3] matches: a short draft
    assert ix.propose(4) == [50, 7]
    assert NgramIndex([9, 3, 50, 7, 8, 3], one_token_draft=4).propose(4) == [50, 7, 8, 3]


def test_no_match_and_no_self_match():
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []  # every n-gram is new
    assert NgramIndex([7]).propose(4) == []
    assert NgramIndex([]).propose(4) == []
    # a repeated token proposes itself from the earlier place, never from its own end;
    # a copy that reaches the end repeats the period it matched
    assert NgramIndex([7, 7, 7]).propose(3) == [7, 7, 7]
    assert NgramIndex([4, 1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]


def test_appends_extend_the_index_one_token_at_a_time_as_in_bulk():
    tokens = torch.randint(0, 12, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    bulk, one_by_one, pieces = NgramIndex(tokens), NgramIndex(), NgramIndex(tokens[:100])
    for t in tokens:
        one_by_one.append(t)
    pieces.extend(tokens[100:350])
    pieces.extend(tokens[350:])
    for cut in (5, 50, 300, 599):
        a, b, c = NgramIndex(tokens[:cut]), NgramIndex(), NgramIndex(tokens[:2])
        for t in tokens[:cut]:
            b.append(t)
        c.extend(tokens[2:cut])
        assert a.propose(6) == b.propose(6) == c.propose(6)
    assert bulk.propose(8) == one_by_one.propose(8) == pieces.propose(8)


def test_a_source_is_looked_up_and_the_history_wins_over_it():
    ix = NgramIndex()
    ix.add_source([10, 11, 12, 13, 14])  # e.g. the suggestion shown at the previous keystroke
    ix.extend([1, 2, 10, 11])
    assert ix.propose(3) == [12, 13, 14]
    ix.extend([99, 10, 11])  # now the history itself has 10, 11 followed by 99
    assert ix.propose(3) == [99, 10, 11]


def test_greedy_accept_is_the_agreeing_prefix():
    assert greedy_accept([4, 5, 6], [4, 5, 6, 7]) == 3
    assert greedy_accept([4, 5, 6], [4, 9, 6, 7]) == 1
    assert greedy_accept([4, 5, 6], [1, 5, 6, 7]) == 0
    assert greedy_accept([], [3]) == 0


def test_verify_cost_keeps_drafts_only_where_they_pay():
    dear = VerifyCost()
    dear.observe_plain(0.1)
    for _ in range(40):
        dear.observe_verify(5, 0, 0.19)  # 5 extra rows cost 90 % of a step, nothing accepted
    lengths = [dear.best_length(6) for _ in range(2 * VerifyCost.EXPLORE_EVERY)]
    assert lengths.count(1) == 2 and set(lengths) == {0, 1}  # plain, but still measuring now and then
    cheap = VerifyCost()
    cheap.observe_plain(0.1)
    for _ in range(40):
        cheap.observe_verify(5, 3, 0.102)  # rows nearly free, most drafts accepted
    assert cheap.row_cost < 0.01 and cheap.best_length(6) == 6 and cheap.best_length(3) == 3
    fresh = VerifyCost()  # priors: a middling draft before anything was measured
    assert 1 <= fresh.best_length(6) < 6


def test_draft_length_grows_on_success_and_shrinks_on_rejection():
    n = DraftLength(8)
    n.update(8, 3)
    assert n.now == 7
    for _ in range(10):
        n.update(n.now, 0)
    assert n.now == 1
    n.update(1, 1)
    assert n.now == 3
    n.update(0, 0)  # nothing proposed: unchanged
    assert n.now == 3
    for _ in range(5):
        n.update(n.now, n.now)
    assert n.now == 8


# ----------------------------------------------------------------------------- scheduler


class Sink:
    """Token-level sink: max_tokens; "eos" at token number `eos_at` (as an end token there
    would: a random model's accepted drafts repeat earlier tokens, so a real end id would
    end the output at its first, earlier occurrence); a deadline after `deadline_at` tokens."""

    def __init__(self, ids, max_tokens=32, eos_at=None, deadline_at=None):
        self.ids, self.max_tokens, self.eos_at, self.deadline_at = list(ids), max_tokens, eos_at, deadline_at
        self.tokens, self.finished = [], None

    def prepare(self, context_length):
        return Prompt(self.ids)

    def before_step(self):
        if len(self.tokens) >= self.max_tokens:
            return "length"
        if self.deadline_at is not None and len(self.tokens) >= self.deadline_at:
            return "deadline"
        return None

    def on_token(self, t):
        self.tokens.append(t)
        if len(self.tokens) == self.eos_at:
            return "eos"
        return "length" if len(self.tokens) >= self.max_tokens else None

    def on_finish(self, reason, stats, error):
        assert self.finished is None, "finished twice"
        self.finished = (reason, stats, error)


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    from engine.model.loader import load_model

    return load_model(str(tiny_model_factory("llama")), dtype="fp32").model


@pytest.fixture(scope="module")
def code_prompts() -> list[list[int]]:
    """Token ids of real code (stdlib), 200-400 tokens each, cut at a line start."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tiny_tokenizer_json())
    out = []
    for src in stdlib_sources(("textwrap.py", "shlex.py", "heapq.py", "fnmatch.py")):
        for at in range(2000, len(src) - 200, 2300):
            at = src.index("\n", at) + 1
            out.append(tok.encode(src[at - 1200 : at]).ids[-300:])
    return out


def make(model):
    return make_scheduler(model, step=128, slots=8000)


_ids = iter(range(1, 1_000_000))


def job(sink, key, speculate, cache=True):
    return Sequence(request_id=next(_ids), key=key, sink=sink, sampler=Sampler(), max_tokens=sink.max_tokens,
                    cache=cache, speculate=speculate)


def drain(s):
    drain_scheduler(s, limit=5000)


@pytest.fixture
def steps(monkeypatch):
    """Every verify step the scheduler runs: (seq, draft, StepResult, sequences decoding,
    ended, tokens generated before it)."""
    seen = Steps()
    real = steps_module.speculate_step

    def spy(runner, seq, draft, accept, cost=None):
        decoding, generated = len(seen.scheduler._decoding), seq.generated
        out = real(runner, seq, draft, accept, cost)
        seen.append((seq, list(draft), out, decoding, seq.kv is None, generated))
        return out

    monkeypatch.setattr(steps_module, "speculate_step", spy)
    return seen


class Steps(list):
    scheduler: Scheduler | None = None

    def watch(self, scheduler: Scheduler, *, measured_cost: bool = False) -> None:
        """Record `scheduler`'s verify steps; unless `measured_cost`, drafts are as long as
        allowed (no timing-dependent `VerifyCost`), so the same request gets the same drafts."""
        self.scheduler = scheduler
        if not measured_cost:
            scheduler.verify_cost = None


def run_one(s, ids, speculate, key, **sink_kw):
    sink = Sink(ids, **sink_kw)
    s.submit(job(sink, key, speculate))
    drain(s)
    return sink


def accepted_positions(steps, seq) -> list[int]:
    """Indices into `seq`'s generated tokens that were accepted drafts (not the model's own)."""
    return [at + j for sq, _, res, _, _, at in steps if sq is seq for j in range(min(res.accepted, res.emitted))]


def test_greedy_tokens_identical_and_rejected_rows_never_kept(model, code_prompts, steps):
    s = make(model)
    steps.watch(s)
    proposed = accepted = 0
    for i, ids in enumerate(code_prompts):
        plain = run_one(s, ids, 0, f"plain{i}", max_tokens=40)
        sink = Sink(ids, max_tokens=40)
        seq = job(sink, f"spec{i}", 8)
        s.submit(seq)
        drain(s)
        assert sink.tokens == plain.tokens, f"prompt {i}"
        assert sink.finished[0] == plain.finished[0]
        st = sink.finished[1]
        proposed, accepted = proposed + st.draft_tokens, accepted + st.accepted_tokens
        # each step emits its accepted drafts + 1 (the last one maybe fewer: the sequence ended)
        assert st.decode_steps + st.accepted_tokens >= len(sink.tokens) - 1 > st.decode_steps
        assert st.decode_steps >= st.verify_steps > 0
        # Rollback: the retained rows are the fed tokens only (the last sampled one never fed),
        # and they hold what a fresh prefill of those tokens computes.
        kept = dict(s.retained.entries())[f"spec{i}"]
        assert kept.ids == ids + sink.tokens[:-1] == dict(s.retained.entries())[f"plain{i}"].ids
        fresh = model.new_kv(kept.kv.capacity)
        model.forward(torch.tensor(kept.ids), fresh, 0, "none")
        n = len(kept.ids)
        torch.testing.assert_close(kept.kv.k[:, :, :n], fresh.k[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kept.kv.v[:, :, :n], fresh.v[:, :, :n], atol=1e-4, rtol=1e-4)
        assert s.cache.match(ids + sink.tokens).n_tokens == len(ids)  # the radix tree: prompt rows only
    assert 0 < accepted < proposed, (accepted, proposed)  # drafts were accepted, and some rejected
    assert all(step[3] == 1 for step in steps)
    s.check_integrity()


def test_eos_and_max_tokens_inside_an_accepted_run(model, code_prompts, steps):
    s = make(model)
    steps.watch(s)
    cases = 0
    for i, ids in enumerate(code_prompts):
        sink = Sink(ids, max_tokens=48)
        seq = job(sink, f"probe{i}", 8)
        s.submit(seq)
        drain(s)
        inside = accepted_positions(steps, seq)
        if not inside:
            continue
        p = inside[len(inside) // 2]
        # EOS: the same drafts as the probe (a fresh key: no previous suggestion to look up
        # in) until the end token, which is an accepted draft.
        plain = run_one(s, ids, 0, f"eos-p{i}", eos_at=p + 1, max_tokens=48)
        before = len(steps)
        spec = run_one(s, ids, 8, f"eos-s{i}", eos_at=p + 1, max_tokens=48)
        assert spec.tokens == plain.tokens == sink.tokens[: p + 1]
        assert spec.finished[0] == plain.finished[0] == "eos"
        last = steps[-1]
        assert len(steps) > before and last[4], "the last verify step ended the sequence"
        assert last[2].emitted <= last[2].accepted, "it ended on an accepted draft, not the model's own token"
        assert dict(s.retained.entries())[f"eos-s{i}"].ids == ids + spec.tokens[:-1]
        # max_tokens inside what was an accepted run: drafts are cut to the tokens left
        # (minus the model's own), so no row is computed past the end
        plain = run_one(s, ids, 0, f"len-p{i}", max_tokens=p + 1)
        before = len(steps)
        spec = run_one(s, ids, 8, f"len-s{i}", max_tokens=p + 1)
        assert spec.tokens == plain.tokens == sink.tokens[: p + 1]
        assert spec.finished[0] == plain.finished[0] == "length"
        assert len(steps) > before
        # no draft reaches past the limit: its tokens + the model's own fit what is left
        assert all(step[5] + len(step[1]) + 1 <= p + 1 for step in steps[before:])
        assert dict(s.retained.entries())[f"len-s{i}"].ids == ids + spec.tokens[:-1]
        cases += 1
    assert cases >= 3
    s.check_integrity()


def test_deadline_and_cancel_end_with_a_prefix_of_the_plain_output(model, code_prompts, steps):
    s = make(model)
    steps.watch(s)
    for i, ids in enumerate(code_prompts[:4]):
        plain = run_one(s, ids, 0, f"plain{i}", max_tokens=40)
        late = run_one(s, ids, 8, f"late{i}", max_tokens=40, deadline_at=10)
        assert late.finished[0] == "deadline"
        assert 10 <= len(late.tokens) and late.tokens == plain.tokens[: len(late.tokens)]
        sink = Sink(ids, max_tokens=40)
        seq = job(sink, f"cancel{i}", 8)
        s.submit(seq)
        for _ in range(6):
            s.step()
        s.cancel(seq)
        drain(s)
        assert sink.finished[0] == "cancelled"
        assert sink.tokens == plain.tokens[: len(sink.tokens)]
        assert dict(s.retained.entries())[f"cancel{i}"].ids == ids + sink.tokens[:-1]
    s.check_integrity()


def test_several_sequences_decode_in_one_batch_and_only_a_lone_one_speculates(model, code_prompts, steps):
    s = make(model)
    steps.watch(s)
    alone = [run_one(s, ids, 0, f"alone{i}", max_tokens=24 + 8 * i).tokens for i, ids in enumerate(code_prompts[:3])]
    sinks = [Sink(ids, max_tokens=24 + 8 * i) for i, ids in enumerate(code_prompts[:3])]
    for i, sk in enumerate(sinks):
        s.submit(job(sk, f"together{i}", 8))
    drain(s)
    assert [sk.tokens for sk in sinks] == alone
    assert steps and all(step[3] == 1 for step in steps)  # the last one, once alone
    assert sum(sk.finished[1].verify_steps for sk in sinks) == len(steps)
    s.check_integrity()


# ----------------------------------------------------------------------------- engine (text)


def _engine(tiny_model_factory, arch):
    from engine.local import load_engine

    return load_engine(str(tiny_model_factory(arch)), dtype="fp32", kv_budget="32M", check_integrity=True)


def _places(n_per_file: int):
    for name in ("textwrap.py", "shlex.py", "heapq.py", "fnmatch.py"):
        src = stdlib_sources((name,))[0]
        for at in range(1500, len(src) - 400, max(1, (len(src) - 1900) // n_per_file))[:n_per_file]:
            yield name, src, at


@pytest.mark.parametrize(
    "arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow), pytest.param("starcoder2", marks=pytest.mark.slow)]
)
def test_engine_text_identical_with_stop_strings_and_max_tokens(tiny_model_factory, arch, steps):
    eng = _engine(tiny_model_factory, arch)
    steps.watch(eng.scheduler)
    try:
        draft = accepted = 0
        ended_in_verify = []
        for j, (name, src, at) in enumerate(_places(4)):
            for fmt, stop, max_tokens in (("efim", ("\n",), 48), ("prefix", (")", "\n\n"), 23), ("efim", (), 17)):
                req = dict(prefix=src[at - 1200 : at], suffix=src[at : at + 300], increment=src[at : at + 3],
                           format=fmt, stop=stop, max_tokens=max_tokens, cache=False)
                plain = eng.submit(InfillRequest(key=f"p{j}", speculate=0, **req)).result(60)
                before = len(steps)
                spec = eng.submit(InfillRequest(key=f"s{j}", speculate=8, **req)).result(60)
                eng.wait_idle()  # the step that answered has ended (and the spy recorded it)
                if len(steps) > before and steps[-1][4]:  # its last token came from a verify step
                    ended_in_verify.append(spec.finish_reason)
                assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason), (name, at, fmt)
                assert spec.stats.generated_tokens == plain.stats.generated_tokens
                assert plain.stats.draft_tokens == 0 and plain.stats.decode_steps == plain.stats.generated_tokens - 1
                draft, accepted = draft + spec.stats.draft_tokens, accepted + spec.stats.accepted_tokens
        assert 0 < accepted < draft
        assert ended_in_verify  # requests that ended within a verify step's tokens
        stats = eng.stats()
        assert stats.accepted_tokens == accepted and stats.draft_tokens == draft
        eng.check_integrity().result(30)
    finally:
        eng.close()


def test_engine_alternatives_and_typing_on_after_a_speculative_suggestion(tiny_model_factory, steps):
    eng = _engine(tiny_model_factory, "llama")
    steps.watch(eng.scheduler, measured_cost=True)  # the engine as served: drafts sized by measured cost
    try:
        src = stdlib_sources(("textwrap.py",))[0]
        at = src.index("def wrap(")
        req = dict(prefix=src[at - 1000 : at], suffix=src[at : at + 300], increment="def ", n=3, max_tokens=30)
        plain = eng.submit(InfillRequest(key="alt-p", speculate=0, **req)).result(60)
        spec = eng.submit(InfillRequest(key="alt-s", speculate=8, **req)).result(60)
        assert (spec.text, spec.alternatives) == (plain.text, plain.alternatives)
        # The same document typed on: the new prompt reuses the suggestion's retained rows
        # (rows of rejected drafts would be garbage there) and looks up in the suggestion.
        base = dict(prefix=src[at - 1000 : at], suffix=src[at : at + 300], max_tokens=30, format="efim")
        first = eng.submit(InfillRequest(key="doc", increment="def ", speculate=8, **base)).result(60)
        typed = "def " + first.text[:3]
        again = eng.submit(InfillRequest(key="doc", increment=typed, speculate=8, **base)).result(60)
        fresh = eng.submit(InfillRequest(key="fresh", increment=typed, speculate=0, cache=False, **base)).result(60)
        assert again.stats.reused_tokens > 0
        assert again.text == fresh.text
        eng.check_integrity().result(30)
    finally:
        eng.close()


def test_engine_stop_string_inside_an_accepted_run(tiny_model_factory, steps):
    """A stop string completed by an accepted draft ends the request there, with the text
    plain decoding gives (the stop string is cut from a speculative run's own output, so
    its first occurrence ends on an accepted draft token)."""
    eng = _engine(tiny_model_factory, "llama")
    steps.watch(eng.scheduler)
    text_of = eng.tokenizer.vocab.text_of
    try:
        found = 0
        for j, (_, src, at) in enumerate(_places(3)):
            base = dict(prefix=src[at - 1200 : at], suffix=src[at : at + 300], format="efim", heal=False,
                        max_tokens=48, cache=False)
            before = len(steps)
            eng.submit(InfillRequest(key=f"probe{j}", speculate=8, **base)).result(60)
            eng.wait_idle()
            mine = steps[before:]
            if not mine:
                continue
            seq = mine[0][0]
            generated = seq.tokens[seq.n_prompt :] + ([seq.pending] if seq.pending is not None else [])
            runs = [st[5] + i for st in mine for i in range(min(st[2].accepted, st[2].emitted))]
            for q in runs:
                head = text_of(generated[: q + 1])
                if not head or text_of(generated[:q]) == head:
                    continue  # the token completes no character: no stop string ends on it
                stop = next(head[-n:] for n in range(1, len(head) + 1) if head.find(head[-n:]) == len(head) - n)
                plain = eng.submit(InfillRequest(key=f"p{j}", speculate=0, stop=(stop,), **base)).result(60)
                before = len(steps)
                spec = eng.submit(InfillRequest(key=f"s{j}", speculate=8, stop=(stop,), **base)).result(60)
                eng.wait_idle()
                assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason) == (head[: -len(stop)], "stop")
                last = steps[-1]
                assert len(steps) > before and last[4] and last[2].emitted <= last[2].accepted
                found += 1
                break
        assert found >= 2
        eng.check_integrity().result(30)
    finally:
        eng.close()


def test_efim_stats_reports_the_engine_speculation_counters():
    from engine.api import EngineStats
    from efim_lsp.stats import ServerStats

    wire = ServerStats().to_wire(EngineStats(decode_steps=10, verify_steps=6, draft_tokens=30, accepted_tokens=12), 0, 0)
    assert wire["speculation"] == {"decodeSteps": 10, "verifySteps": 6, "draftTokens": 30, "acceptedTokens": 12}
    assert ServerStats().to_wire(None, 0, 0)["speculation"]["acceptedTokens"] == 0
