"""SamplingParams.from_dict: defaults, aliases, and errors that name the field."""

from __future__ import annotations

import pytest
from radixrt.sampling_params import SamplingParams


def test_none_and_missing_fields_take_defaults():
    sp = SamplingParams.from_dict({"temperature": None, "stop": "x", "top_k": 0, "max_tokens": 5, "sampling_seed": 3})
    assert sp.temperature == 1.0 and sp.stop == ["x"] and sp.top_k == -1 and sp.max_new_tokens == 5 and sp.seed == 3
    assert SamplingParams.from_dict({"stop": []}).stop == []
    assert SamplingParams.from_dict(None) == SamplingParams()


@pytest.mark.parametrize(
    "params,field",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_token_ids": "a"}, "stop_token_ids"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"regex": "[a-z]+", "json_schema": "{}"}, "regex and json_schema"),  # at most one constraint
        ({"json_schema": "{}", "ebnf": "root ::= [a]"}, "json_schema and ebnf"),
        ({"stop_regex": "[a-z"}, "stop_regex"),  # not a regex
        ({"min_new_tokens": 9, "max_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_values_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)
