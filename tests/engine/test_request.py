"""SamplingParams (engine/request.py): a value out of range is an `InvalidSamplingParam` (a `ValueError`) that names
its field; `max_tokens=None` means all the context the prompt leaves (resolved by `LLMEngine.add_request`)."""
from __future__ import annotations

import dataclasses

import pytest

from engine import InvalidSamplingParam, SamplingParams

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_tokens": 0}, "SamplingParams: max_tokens must be >= 1, got 0"),
    ({"temperature": -0.5}, "SamplingParams: temperature must be >= 0, got -0.5"),
    ({"top_p": 0.0}, "SamplingParams: top_p must be in (0, 1], got 0.0"),
    ({"top_k": -2}, "SamplingParams: top_k must be -1, 0 (off) or a positive int32, got -2"),
    ({"top_k": 2**31}, f"SamplingParams: top_k must be -1, 0 (off) or a positive int32, got {2**31}"),
    ({"seed": -1}, "SamplingParams: seed must be in [0, 2**63), got -1"),
    ({"min_p": 1.5}, "SamplingParams: min_p must be in [0, 1], got 1.5"),
    ({"presence_penalty": 2.5}, "SamplingParams: presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3.0}, "SamplingParams: frequency_penalty must be in [-2, 2], got -3.0"),
    ({"repetition_penalty": 0.0}, "SamplingParams: repetition_penalty must be > 0, got 0.0"),
    ({"stop": ["ok", ""]}, "SamplingParams: stop must be a list of non-empty strings"),
    ({"logprobs": 21}, "SamplingParams: logprobs must be in [0, 20], got 21"),
    ({"min_tokens": -1}, "SamplingParams: min_tokens must be >= 0, got -1"),
    ({"logit_bias": {5: 101.0}}, "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"logit_bias": {5: float("nan")}},
     "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"logit_bias": {True: 1.0}}, "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"logit_bias": {5: "1"}}, "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"logit_bias": [(5, 1.0)]}, "SamplingParams: logit_bias must map token ids (>= 0) to biases in [-100, 100]"),
    ({"allowed_token_ids": []}, "SamplingParams: allowed_token_ids must be a non-empty list of token ids (>= 0)"),
    ({"allowed_token_ids": [3, -1]}, "SamplingParams: allowed_token_ids must be a non-empty list of token ids (>= 0)"),
])
def test_out_of_range_names_its_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidSamplingParam) as info:
        SamplingParams(**kwargs)
    (param,) = kwargs
    assert info.value.param == param and param in FIELDS
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_defaults_and_normalisations() -> None:
    assert SamplingParams().max_tokens == 16
    assert SamplingParams(max_tokens=None).max_tokens is None  # all the room the prompt leaves
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy
    # a temperature too small to divide by (1e-38 is a float32 denormal) samples greedily, as vLLM's below 1e-5
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=1e-300).temperature == 0.0
    assert not SamplingParams(temperature=1e-5).greedy
