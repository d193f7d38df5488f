"""SamplingParams refuses non-finite numbers: an infinite temperature samples noise and NaN
passes every range check."""

import math

import pytest

from kvtier.entrypoints.cli import main
from kvtier.sampling_params import SamplingParams


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty",
                                   "frequency_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert str(info.value) == f"SamplingParams.{field} must be a finite number, got {value!r}"


@pytest.mark.parametrize("flag", ["--temperature", "--top-p", "--repetition-penalty"])
def test_generate_refuses_them_in_one_line_before_loading(flag, capsys):
    assert main(["generate", "hi", flag, "inf", "--model", "/no/such/model"]) == 2
    field = flag.removeprefix("--").replace("-", "_")
    assert capsys.readouterr().err.strip() == (
        f"kvtier generate: error: SamplingParams.{field} must be a finite number, got inf")
