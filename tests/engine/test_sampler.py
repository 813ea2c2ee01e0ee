"""Sampling on the tiny model: seeds independent of the batch, greedy equivalences, penalties, top-k/top-p/
min-p support, logprobs against a recomputation, and the stop conditions (stop ids, length, EOS)."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, InvalidSamplingParam, LLMEngine, SamplingParams
from engine.request import Request
from engine import sampler as sampler_mod
from engine.sampler import apply_penalties, filter_logits

N = 16  # new tokens per request: enough to see divergence, cheap on 2 cores
PROMPT = "Hello world, the model streams tokens to the chat"


@pytest.fixture(scope="module")
def eng(tiny_model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024))


def greedy(n: int = N, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def ref_out(eng):
    """PROMPT's greedy completion, generated alone."""
    out = eng.generate([PROMPT], greedy())[0]
    assert len(out.token_ids) == N and out.finish_reason == "length"
    return out


@pytest.fixture(scope="module")
def ref(ref_out) -> list[int]:
    return ref_out.token_ids


# -- seeds, greedy, determinism -----------------------------------------------------------------

SEEDED = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.95, top_k=200, seed=1234, ignore_eos=True)
SEEDED_PLAIN = SamplingParams(max_tokens=N, temperature=1.3, seed=99, ignore_eos=True)  # no filters at all


def crowd(i: int) -> SamplingParams:
    """Batch mates with every kind of parameter, so their rows take every path of the sampler."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.7, seed=1234 + i),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, top_p=0.5),
        dict(temperature=1.0, min_p=0.3),
        dict(temperature=0.5, repetition_penalty=1.8, presence_penalty=0.5, frequency_penalty=0.5),
        dict(temperature=1.0, top_k=1, logprobs=3),
    ]
    return SamplingParams(max_tokens=N // 2 + i, ignore_eos=True, **kinds[i % len(kinds)])


def test_seeded_sampling_is_identical_alone_and_in_a_crowded_batch(eng, ref):
    alone = eng.generate([PROMPT], SEEDED)[0].token_ids
    assert eng.generate([PROMPT], SEEDED)[0].token_ids == alone  # a seed replays
    alone_plain = eng.generate([PROMPT], SEEDED_PLAIN)[0].token_ids
    assert alone != ref and alone_plain != ref  # really sampled, not greedy

    prompts = [f"{PROMPT} {i} " * (1 + i % 3) for i in range(16)]
    params = [crowd(i) for i in range(16)]
    outs = eng.generate(prompts[:8] + [PROMPT] + prompts[8:] + [PROMPT, PROMPT],
                        params[:8] + [SEEDED] + params[8:] + [SEEDED_PLAIN, greedy()])
    assert outs[8].token_ids == alone
    assert outs[17].token_ids == alone_plain
    assert outs[18].token_ids == ref  # greedy is batch-independent too
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_top_k_1_equals_greedy(eng, ref):
    params = [SamplingParams(max_tokens=N, temperature=t, top_k=1, ignore_eos=True) for t in (0.5, 1.0, 2.0)]
    outs = eng.generate([PROMPT] * 3, params)
    assert all(o.token_ids == ref for o in outs)


def test_temperature_0_is_deterministic(eng, ref):
    outs = eng.generate([PROMPT, PROMPT], [greedy(), greedy(top_p=0.3, top_k=7, seed=5)])  # filters don't matter at t=0
    assert outs[0].token_ids == ref and outs[1].token_ids == ref


def test_different_seeds_differ(eng):
    params = [SamplingParams(max_tokens=N, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 1)]
    outs = eng.generate([PROMPT] * 3, params)
    assert outs[0].token_ids != outs[1].token_ids
    assert outs[0].token_ids == outs[2].token_ids


def _splitmix64(seed: int, n: int) -> int:
    """SplitMix64's n-th output (from 0) of state `seed`, in Python's unbounded ints: the reference."""
    m = (1 << 64) - 1
    z = (seed + (n + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_seeded_streams_are_splitmix64_batched():
    """A seeded request's uniforms: SplitMix64's outputs (top 24 bits) at its counter, computed for any streams at
    once; the counter is its whole state (what a retry restores and a checkpoint carries)."""
    seeds, counters = [0, 1, 1234, 2**63 - 1, 2**40 + 7], [0, 1, 5, 2**20, 3]
    got = sampler_mod.hashed_uniforms(torch.tensor(seeds), torch.tensor(counters))
    assert got.tolist() == [(_splitmix64(s, n) >> 40) / 2**24 for s, n in zip(seeds, counters)]
    stream = sampler_mod.SeededStream(1234)
    first = stream.rand(4, torch.device("cpu"))
    state = stream.get_state()
    more = stream.rand(3, torch.device("cpu"))
    stream.set_state(state)
    assert torch.equal(stream.rand(3, torch.device("cpu")), more)
    # one per row in a batch, each from its own counter: the same numbers as drawn alone
    a, b = sampler_mod.SeededStream(1234), sampler_mod.SeededStream(99)
    batched = [sampler_mod._uniforms([a, None, b], torch.Generator(), torch.device("cpu")) for _ in range(4)]
    assert [u[0].item() for u in batched] == first.tolist() and a.counter == b.counter == 4
    u = sampler_mod.SeededStream(7).rand(200_000, torch.device("cpu"))
    hist = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.005
    assert ((hist - 12_500) ** 2 / 12_500).sum() < 40  # chi-square, 15 degrees of freedom: p < 0.001 past 37.7


def test_unseeded_requests_do_not_all_draw_the_same(eng):
    outs = eng.generate([PROMPT] * 2, SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True))
    assert outs[0].token_ids != outs[1].token_ids


# -- penalties -----------------------------------------------------------------------------------


def test_penalties_change_a_repetitive_greedy_output(eng):
    prompt = [300, 301, 302, 303] * 12  # a loop the model is invited to continue
    runs = eng.generate([prompt] * 4, [greedy(32), greedy(32, repetition_penalty=2.0),
                                       greedy(32, presence_penalty=2.0), greedy(32, frequency_penalty=2.0)])
    base, rep, pres, freq = (o.token_ids for o in runs)
    assert rep != base and pres != base and freq != base
    # a repetition penalty pushes away from the prompt's tokens too; presence keeps the output diverse
    assert sum(t in (300, 301, 302, 303) for t in rep) <= sum(t in (300, 301, 302, 303) for t in base)
    assert len(set(pres)) >= len(set(base))


def _req(prompt: list[int], output: list[int], **kw) -> Request:
    r = Request("r", prompt, SamplingParams(**kw), 16)
    r.token_ids += output
    return r


def test_apply_penalties_on_handcrafted_logits():
    base = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5])
    prompt, output = [0, 1], [3, 3, 4]
    cases = [
        (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -4.0, 0.0, 1.0, -0.5]),  # prompt + output tokens
        (dict(presence_penalty=0.5), [2.0, -1.0, 0.5, 2.5, -2.5, 0.0, 1.0, -0.5]),  # output tokens, once
        (dict(frequency_penalty=0.25), [2.0, -1.0, 0.5, 2.5, -2.25, 0.0, 1.0, -0.5]),  # per occurrence
        (dict(presence_penalty=-1.0), [2.0, -1.0, 0.5, 4.0, -1.0, 0.0, 1.0, -0.5]),  # negative rewards
        (dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
         [1.0, -2.0, 0.5, 0.5, -4.75, 0.0, 1.0, -0.5]),
        (dict(), base.tolist()),
    ]
    reqs = [_req(prompt, output, **kw) for kw, _ in cases]
    logits = base.repeat(len(cases), 1)
    apply_penalties(logits, reqs)
    for row, (kw, want) in zip(logits, cases):
        assert row.tolist() == pytest.approx(want), kw


def test_batched_penalties_equal_the_per_row_formula_bit_for_bit():
    """The sparse batched penalties against the per-request loop they replaced (bench/host.py keeps it as the
    baseline): every mix of penalties, rows without any, empty outputs, repeated tokens, long prompts."""
    from bench.host import looped_penalties

    rng = random.Random(0)
    V = 512
    kinds = [dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1), dict(repetition_penalty=0.8),
             dict(frequency_penalty=-0.7), dict(), dict(presence_penalty=1.5), dict(repetition_penalty=1.3,
                                                                                    frequency_penalty=2.0)]
    reqs = []
    for i in range(40):
        r = Request(str(i), [rng.randrange(V) for _ in range(rng.choice([1, 7, 300]))], SamplingParams(**kinds[i % 6]), 16)
        r.token_ids += [rng.randrange(8) if i % 4 else rng.randrange(V) for _ in range(rng.choice([0, 1, 5, 60]))]
        reqs.append(r)
    logits = 5 * torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(0))
    want = logits.clone()
    looped_penalties(want, reqs)
    apply_penalties(logits, reqs)
    assert torch.equal(logits, want)
    assert not torch.equal(logits, 5 * torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(0)))


def test_a_tiny_repetition_penalty_keeps_the_logits_finite(eng):
    """A penalty near 0 divides a seen token's positive logit past float32's range; inf logits would make the
    softmax NaN (and the draws garbage). Clamped, the seen tokens win, as a strong penalty below 1 means."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    apply_penalties(logits, [_req([0], [3], repetition_penalty=1e-300)])
    assert torch.isfinite(logits).all() and logits[0, 0] == logits[0, 3] > 1e30
    assert torch.isfinite((logits / 1e-5).softmax(-1)).all()  # the smallest temperature divides them next
    prompt = [5, 6, 7, 8, 9, 10]
    for t in (0.7, 1e-5):
        got = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=t, seed=3, repetition_penalty=1e-39,
                                                    ignore_eos=True))[0].token_ids
        assert set(got) <= set(prompt) | {got[0]}, t  # every token after the first repeats one already seen


def test_a_temperature_too_small_to_divide_by_is_greedy(eng):
    prompt = [5, 6, 7, 8, 9, 10]
    greedy = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    for t in (1e-38, 1e-45):
        assert eng.generate([prompt], SamplingParams(max_tokens=12, temperature=t, ignore_eos=True))[0].token_ids == greedy


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(1, 6)
    apply_penalties(logits, [_req([1, 2, 3], [], presence_penalty=1.0, frequency_penalty=1.0)])
    assert logits.tolist() == [[0.0] * 6]


# -- top-k / top-p / min-p support ---------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


def _support(logits: torch.Tensor, top_k=0, top_p=1.0, min_p=0.0) -> set[int]:
    out = filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite]), "surviving logits must be untouched"
    return set(finite.nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "kw, support",
    [
        (dict(), {0, 1, 2, 3}),
        (dict(top_k=1), {0}),
        (dict(top_k=2), {0, 1}),
        (dict(top_k=10), {0, 1, 2, 3}),
        (dict(top_p=0.1), {0}),
        (dict(top_p=0.75), {0, 1}),  # the smallest set whose mass reaches top_p
        (dict(top_p=0.85), {0, 1, 2}),
        (dict(top_p=0.99), {0, 1, 2, 3}),
        (dict(min_p=0.2), {0, 1, 2}),  # keep p >= 0.2 * 0.5
        (dict(min_p=0.5), {0, 1}),
        (dict(min_p=0.7), {0}),
        (dict(top_k=3, top_p=0.7), {0, 1}),
        (dict(top_k=2, min_p=0.01), {0, 1}),
        (dict(top_p=0.9, min_p=0.4), {0, 1}),
    ],
)
def test_filter_logits_support(kw, support):
    logits = torch.tensor(PROBS).log() + 1.7  # softmax is shift invariant
    assert _support(logits, **kw) == support
    assert _support(logits[[2, 0, 3, 1]], **kw) == {[2, 0, 3, 1].index(i) for i in support}  # by value, not position


@settings(max_examples=60, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=16, max_size=16),
            st.sampled_from([0, 0, 1, 3, 8]),
            st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.1]),
            st.sampled_from([0.0, 0.0, 0.05, 0.5]),
        ),
        min_size=1,
        max_size=5,
    )
)
def test_filter_logits_rows_do_not_depend_on_their_batch_mates(rows):
    """A request's samples must not depend on what else is in the batch (issue #2), so neither may its mask."""
    logits = torch.tensor([r[0] for r in rows])
    top_k, top_p, min_p = (torch.tensor([r[i] for r in rows]) for i in (1, 2, 3))
    batched = filter_logits(logits, top_k, top_p, min_p)
    for i in range(len(rows)):
        alone = filter_logits(logits[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1])[0]
        assert torch.equal(torch.isfinite(batched[i]), torch.isfinite(alone)), f"row {i} {rows[i][1:]}"
        assert torch.isfinite(batched[i]).any()
        if rows[i][1:] == (0, 1.0, 0.0):
            assert torch.equal(batched[i], logits[i]), "a row with every filter off must be left alone"


def test_filter_off_keeps_even_very_unlikely_tokens_next_to_a_filtering_row():
    logits = torch.tensor([[0.0, -40.0, -40.0, -40.0], [0.0, -1.0, -2.0, -3.0]])
    out = filter_logits(logits, torch.tensor([0, 2]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert torch.equal(out[0], logits[0]), "top_p=1.0 means off: a nonzero-probability token may still be drawn"
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]


# -- logprobs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (T, V)


def test_logprobs(eng, ref_out, hf_model):
    ref = ref_out.token_ids
    prompt_ids = eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    k = 5
    g, s, z, p = eng.generate(
        [PROMPT] * 4,
        [greedy(logprobs=k),
         SamplingParams(max_tokens=N, temperature=1.5, seed=3, logprobs=k, ignore_eos=True),
         greedy(logprobs=0),
         greedy(logprobs=2, repetition_penalty=1.5)],
    )
    assert g.token_ids == ref
    for out, n_top in ((g, k), (s, k), (z, 0), (p, 2)):
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == N
        lp_all = _hf_logprobs(hf_model, prompt_ids + out.token_ids[:-1])[len(prompt_ids) - 1 :]  # (N, V)
        for step, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.token_id == tok
            assert lp.logprob <= 0.0
            assert len(lp.top) == n_top
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            # the raw distribution (before penalties / temperature), recomputed by transformers
            assert lp.logprob == pytest.approx(lp_all[step, tok].item(), abs=1e-3)
            want_top = lp_all[step].topk(max(n_top, 1))
            assert [v for _, v in lp.top] == pytest.approx(want_top.values[:n_top].tolist(), abs=1e-3)
            if out is g:
                assert lp.top[0] == (tok, pytest.approx(lp.logprob))  # greedy picks the top-1 entry
            assert sum(math.exp(v) for v in values) <= 1.0 + 1e-5
    assert ref_out.logprobs is None  # off by default


# -- stop conditions ------------------------------------------------------------------------------


def _first_fresh(ids: list[int], start: int) -> int:
    """Index of the first token at or after `start` that did not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_stop_token_ids_stop_with_reason_stop(eng, ref_out):
    ref, full = ref_out.token_ids, ref_out
    i = _first_fresh(ref, 3)
    unused = next(t for t in range(1023, 3, -1) if t not in ref)
    out = eng.generate([PROMPT], greedy(stop_token_ids=[unused, ref[i]]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[: i + 1]  # the stop token is reported, and nothing after it
    assert full.text.startswith(out.text) and len(out.text) < len(full.text)


def test_max_tokens_gives_length(eng, ref):
    for n in (1, 5):
        out = eng.generate([PROMPT], greedy(n))[0]
        assert out.finish_reason == "length" and out.token_ids == ref[:n]


def test_eos_is_respected_unless_ignore_eos(eng, ref):
    i = _first_fresh(ref, 2)
    saved = eng.eos_token_ids
    try:
        eng.eos_token_ids = {ref[i]}  # make the model's own greedy choice an EOS token
        stopped, ignored = eng.generate([PROMPT] * 2, [SamplingParams(max_tokens=N, temperature=0.0), greedy()])
    finally:
        eng.eos_token_ids = saved
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref[: i + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == ref


def test_min_tokens_holds_back_eos_and_stop_token_ids(eng, ref, hf_model):
    """The first min_tokens tokens are never EOS or a stop token id: the sampler masks them (the greedy token is then
    the model's best other one), and after them they stop the request again."""
    i = _first_fresh(ref, 2)
    prompt_ids = eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    saved = eng.eos_token_ids
    try:
        eng.eos_token_ids = {ref[i]}  # the model's own greedy choice at i is EOS
        by_eos, by_id, ignored = eng.generate([PROMPT] * 3, [
            SamplingParams(max_tokens=N, temperature=0.0, min_tokens=i + 1),
            greedy(stop_token_ids=[ref[i]], min_tokens=i + 1),
            greedy(min_tokens=i + 1),  # ignore_eos: EOS ends nothing, and is held back all the same (as vLLM)
        ])
        early = eng.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0.0, min_tokens=i))[0]
    finally:
        eng.eos_token_ids = saved
    assert ignored.token_ids[:i] == ref[:i] and ignored.token_ids[i] != ref[i]
    assert early.finish_reason == "stop" and early.token_ids == ref[: i + 1]  # token i+1 may end it again
    logits = _hf_logprobs(hf_model, prompt_ids + ref[:i])[-1].clone()
    logits[ref[i]] = float("-inf")
    for out in (by_eos, by_id, ignored):
        assert out.token_ids[: i + 1] == ref[:i] + [int(logits.argmax())], "the next best token, in EOS's place"
        assert len(out.token_ids) > i + 1 and ref[i] not in out.token_ids[: i + 1]
        assert out.finish_reason == "length" or out.token_ids.index(ref[i]) == len(out.token_ids) - 1


def test_min_tokens_holds_back_stop_tokens_under_sampling(eng):
    """Seeded sampling with half the vocabulary as stop token ids: none of them among the first min_tokens tokens
    (without the minimum, a request of these ends at once)."""
    vocab = eng.model_config.vocab_size
    banned = list(range(3, vocab, 2))
    ps = [SamplingParams(max_tokens=N, temperature=1.5, seed=s, stop_token_ids=banned, min_tokens=10, ignore_eos=True)
          for s in range(4)]
    outs = eng.generate([PROMPT] * 4, ps)
    free = eng.generate([PROMPT] * 4, [replace(p, min_tokens=0) for p in ps])
    assert sum(len(o.token_ids) for o in free) < 4 * 10  # (the ban is what keeps them going)
    for o in outs:
        assert not set(o.token_ids[:10]) & set(banned), o.token_ids
        assert len(o.token_ids) > 10 and (o.finish_reason == "length" or o.token_ids[-1] in banned)


def test_logit_bias_moves_the_draw_and_only_its_own_row(eng, ref, hf_model):
    """OpenAI's logit_bias: -100 takes the greedy token out (the model's next best comes), +100 makes a token win
    every step, greedy or sampled; the logprobs stay the model's; batch mates are untouched."""
    prompt_ids = eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    favourite = next(t for t in range(1023, 3, -1) if t not in ref)
    banned, forced, sampled, plain = eng.generate([PROMPT] * 4, [
        greedy(logit_bias={ref[0]: -100.0}, logprobs=1),
        greedy(logit_bias={favourite: 100, ref[0]: 5}),  # (ints, as Python callers write them: taken as floats)
        SamplingParams(max_tokens=N, temperature=1.0, seed=3, ignore_eos=True, logit_bias={favourite: 100.0}),
        greedy(logprobs=1)])
    assert plain.token_ids == ref
    logits = _hf_logprobs(hf_model, prompt_ids)[-1].clone()
    logits[ref[0]] -= 100.0
    assert banned.token_ids[0] == int(logits.argmax()) != ref[0]
    own = float(_hf_logprobs(hf_model, prompt_ids)[-1][banned.token_ids[0]])
    assert banned.logprobs[0].logprob == pytest.approx(own, abs=1e-4)  # the model's own logprob
    assert forced.token_ids == sampled.token_ids == [favourite] * N
    with pytest.raises(InvalidSamplingParam) as info:
        eng.add_request("oov", PROMPT, greedy(logit_bias={eng.model_config.vocab_size: 1.0}))
    assert info.value.param == "logit_bias" and "oov" not in eng.requests


def test_allowed_token_ids_are_all_that_comes(eng, ref, hf_model):
    """vLLM's allowed_token_ids: greedy takes the best of them, sampling draws among them; with logit_bias and
    min_tokens' mask beside it in one batch; batch mates untouched."""
    allowed = sorted({ref[1], ref[2], 700, 701})
    greedy_out, sampled, mixed, plain = eng.generate([PROMPT] * 4, [
        greedy(allowed_token_ids=allowed),
        SamplingParams(max_tokens=N, temperature=1.5, seed=5, ignore_eos=True, allowed_token_ids=allowed),
        greedy(allowed_token_ids=allowed, logit_bias={700: 100.0}, min_tokens=2, stop_token_ids=[701]),
        greedy()])
    assert plain.token_ids == ref
    assert set(greedy_out.token_ids + sampled.token_ids + mixed.token_ids) <= set(allowed)
    first = _hf_logprobs(hf_model, eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])[-1]
    assert greedy_out.token_ids[0] == max(allowed, key=lambda t: float(first[t]))  # the model's best of them
    assert mixed.token_ids == [700] * N
    with pytest.raises(InvalidSamplingParam) as info:
        eng.add_request("oov", PROMPT, greedy(allowed_token_ids=[eng.model_config.vocab_size]))
    assert info.value.param == "allowed_token_ids" and "oov" not in eng.requests


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5


# ---- sample(): no sort, the nucleus by rejection ----------------------------------------------------------
SAMPLE_CASES = [  # (top_k, top_p, min_p)
    (0, 1.0, 0.0), (3, 1.0, 0.0), (0, 0.6, 0.0), (0, 0.9, 0.0), (4, 0.8, 0.0), (0, 1.0, 0.2), (5, 0.7, 0.1), (1, 1.0, 0.0),
]


@pytest.mark.parametrize("rounds", [sampler_mod.MAX_ROUNDS, 0], ids=["rejection", "fallback"])
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=str)
def test_sample_draws_from_the_filtered_distribution(monkeypatch, rounds, case):
    """20,000 draws of one 8-token distribution equal filter_logits' support renormalized, by a chi-square test
    whose false-failure rate is 1e-6 (a fixed seed: the outcome is deterministic); never a token outside it."""
    monkeypatch.setattr(sampler_mod, "MAX_ROUNDS", rounds)
    top_k, top_p, min_p = case
    probs = torch.tensor([0.30, 0.22, 0.15, 0.12, 0.09, 0.06, 0.04, 0.02])
    n = 20_000
    kept = filter_logits(probs.log()[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    want = kept.softmax(-1)
    g = torch.Generator().manual_seed(0)
    draws = sampler_mod.sample(probs.expand(n, -1).clone(), torch.full((n,), top_k), torch.full((n,), top_p),
                               torch.full((n,), min_p), [None] * n, g)
    counts = torch.bincount(draws, minlength=8).double()
    assert not counts[want == 0].any(), (counts, want)
    support = want > 0
    if support.sum() > 1:
        expected = n * want[support].double()
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        dof = int(support.sum()) - 1
        assert chi2 < _chi2_isf(1e-6, dof), (chi2, counts, expected)


def _chi2_isf(q: float, dof: int) -> float:
    """x with P(chi2_dof > x) = q, by bisection on the regularized upper incomplete gamma function."""
    lo, hi = 0.0, 500.0
    for _ in range(100):
        mid = (lo + hi) / 2
        tail = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(mid / 2, dtype=torch.float64)))
        lo, hi = (mid, hi) if tail > q else (lo, mid)
    return hi


def test_sample_stays_in_the_support_of_random_rows():
    g = torch.Generator().manual_seed(3)
    R, V = 512, 300
    probs = (torch.randn(R, V, generator=g) * 3).softmax(-1)
    top_k = torch.randint(0, 40, (R,), generator=g)
    top_p = torch.rand(R, generator=g).clamp(min=0.05)
    min_p = torch.rand(R, generator=g) * 0.2
    draws = sampler_mod.sample(probs, top_k, top_p, min_p, [None] * R, torch.Generator().manual_seed(1))
    kept = filter_logits(probs.log(), top_k, top_p, min_p)
    assert torch.isfinite(kept.gather(1, draws[:, None])).all()


@pytest.mark.parametrize("rounds", [sampler_mod.MAX_ROUNDS, 0], ids=["rejection", "fallback"])
@pytest.mark.parametrize("case,support", [((2, 1.0, 0.0), {0, 1, 2}), ((0, 0.5, 0.0), {0, 1, 2}),
                                          ((0, 0.3, 0.0), {0}), ((3, 1.0, 0.0), {0, 1, 2})], ids=str)
def test_tied_tokens_stay_or_go_together(monkeypatch, rounds, case, support):
    """[.4, .2, .2, .1, .1]: top_k=2 keeps both .2s, a nucleus reaching into a tied group keeps all of it; the
    sorted filter and the rejection sampler agree (the fallback is the sorted filter), draws split evenly."""
    monkeypatch.setattr(sampler_mod, "MAX_ROUNDS", rounds)
    top_k, top_p, min_p = case
    probs = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1])
    kept = filter_logits(probs.log()[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
    assert set(torch.isfinite(kept).nonzero().flatten().tolist()) == support
    n = 20_000
    draws = sampler_mod.sample(probs.expand(n, -1).clone(), torch.full((n,), top_k), torch.full((n,), top_p),
                               torch.full((n,), min_p), [None] * n, torch.Generator().manual_seed(2))
    counts = torch.bincount(draws, minlength=5)
    assert set(counts.nonzero().flatten().tolist()) == support
    if {1, 2} <= support:
        assert abs(int(counts[1]) - int(counts[2])) < 0.05 * n  # the tied pair, evenly
