"""A request's custom_params parsed once into a frozen `RequestOptions` (integration/requests.py, no SGLang): the
values each mechanism reads, the 400 messages for bad ones, and the scheduler's copy kept beside the request."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from sglang_tiered.integration.requests import RequestOptions, options, parse_options


def test_every_option_is_parsed_into_one_frozen_value():
    opts = parse_options({"tiered_chunks": [3, 2], "tiered_importance": "gated", "tiered_importance_gate": "mass",
                          "tiered_importance_ratio": 0.3, "tiered_kvpr": 128, "tiered_retain": 60}, 5, 3600)
    assert opts == RequestOptions(chunks=(3, 2), sparse="gated", gate="mass", ratio=0.3, kvpr=128, retain=60.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.kvpr = "off"
    assert parse_options(None, 5, 3600) == RequestOptions() == parse_options({}, 5, 3600)


@pytest.mark.parametrize("custom, message", [
    ({"tiered_kvpr": "sometimes"}, "custom_params.tiered_kvpr must be one of"),
    ({"tiered_kvpr": "compute"}, "custom_params.tiered_kvpr must be one of"),
    ({"tiered_kvpr": -1}, "custom_params.tiered_kvpr"),
    ({"tiered_kvpr": True}, "custom_params.tiered_kvpr"),
    ({"tiered_importance": "half"}, "custom_params.tiered_importance must be one of"),
    ({"tiered_importance_gate": "none"}, "custom_params.tiered_importance_gate must be one of"),
    ({"tiered_importance_ratio": 0}, "custom_params.tiered_importance_ratio must be a number in (0, 1]"),
    ({"tiered_retain": 7200}, "custom_params.tiered_retain must be a number of seconds in [0, 3600]"),
    ({"tiered_chunks": [3, 3]}, "adds up to 6 tokens; the prompt has 5"),
    ({"tiered_chunks": "3,2"}, "must be a list of integers"),
])
def test_a_bad_value_is_refused_with_the_message_a_client_gets(custom, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        parse_options(custom, 5, 3600)


def test_the_scheduler_parses_a_requests_options_once_and_keeps_them_beside_it():
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"tiered_kvpr": "force"}),
                          origin_input_ids=[1, 2, 3])
    first = options(req)
    assert first.kvpr == "force" and req.tiered_options is first
    req.sampling_params.custom_params["tiered_kvpr"] = "off"  # (never rewritten: read once)
    assert options(req) is first
    assert req.sampling_params.custom_params == {"tiered_kvpr": "off"}  # the client's dict carries no mark of ours


def test_a_value_the_launcher_would_refuse_reads_as_not_given_in_the_scheduler():
    req = SimpleNamespace(sampling_params=SimpleNamespace(custom_params={"tiered_kvpr": "sometimes"}),
                          origin_input_ids=[1])
    assert options(req) == RequestOptions()
    plain = SimpleNamespace(sampling_params=None, origin_input_ids=[1])
    assert options(plain) == RequestOptions()
