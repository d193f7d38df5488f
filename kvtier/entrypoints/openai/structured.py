"""A request's output constraint: OpenAI's response_format or vLLM's structured_outputs,
as StructuredOutputsParams. The engine compiles it; a schema or grammar that does not compile
is a 400 naming the field the client gave it in (`grammar_error`)."""

from __future__ import annotations

from typing import Any

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import SamplingFields
from kvtier.sampling_params import SamplingParams, StructuredOutputsParams
from kvtier.structured_output import GrammarError

# vLLM's removed guided decoding fields, and the structured_outputs field each became.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_FORMATS = ("text", "json_object", "json_schema")
# A constraint the client gave in one of these fields, as a 400 names it.
_GIVEN_AS = {"response_format": "the response format",
             "tools": "the JSON schema of the tool calls (from the tools' parameters)"}


def structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint, or None; 400 naming the field for a bad one."""
    for name, kind in _GUIDED_FIELDS.items():
        if (request.model_extra or {}).get(name) not in (None, False, [], {}, ""):
            raise BadRequestError(f"{name} is not supported (vLLM removed it): use "
                                  f"structured_outputs {{\"{kind}\": ...}}", param=name,
                                  code="unsupported_parameter")
    from_format = _from_response_format(request.response_format)
    if from_format is not None and request.structured_outputs:
        raise BadRequestError("give response_format or structured_outputs, not both",
                              param="structured_outputs", code="invalid_value")
    if from_format is not None:
        return _params(from_format, "response_format")
    if request.structured_outputs:
        return _params(request.structured_outputs, "structured_outputs")
    return None


def constraint_field(request: SamplingFields) -> str:
    """The field of a checked request (see structured_outputs) its constraint came from."""
    if _from_response_format(request.response_format) is not None:
        return "response_format"
    return "structured_outputs"


def grammar_error(exc: GrammarError, param: str) -> BadRequestError:
    """The 400 for a constraint that did not compile, given in the request field `param`.
    The engine's message names SamplingParams.structured_outputs: a client that sent
    response_format or tools gets one that names no field instead (the Responses and Messages
    APIs rename response_format in `param`, not in messages)."""
    given_as = _GIVEN_AS.get(param)
    message = str(exc) if given_as is None else f"{given_as} {exc.problem}"
    return BadRequestError(message, param=param, code="invalid_value")


def check_min_tokens(params: SamplingParams) -> None:
    """400 naming min_tokens when a choice constraint must end the output before it: a token
    spells at least one byte, so no choice takes more tokens than its bytes, and after one the
    grammar allows only EOS, which min_tokens forbids (the request would fail in the engine).
    For a grammar that holds from the first output token only (not after a thinking)."""
    choice = params.structured_outputs.choice if params.structured_outputs else None
    if not choice or params.ignore_eos:  # ignore_eos: the EOS that follows does not end it
        return
    longest = max(len(text.encode()) for text in choice)
    if longest < params.min_tokens:
        raise BadRequestError(f"min_tokens {params.min_tokens} cannot be reached: the longest "
                              f"structured output choice is {longest} bytes, so at most "
                              f"{longest} tokens before the output must end; set min_tokens "
                              f"to at most {longest}", param="min_tokens", code="invalid_value")


def _from_response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "structural_tag":
        raise BadRequestError("response_format structural_tag is not supported; use "
                              "json_schema, json_object or text", param="response_format",
                              code="unsupported_parameter")
    if kind not in _FORMATS:
        raise BadRequestError(f"response_format type must be one of {', '.join(_FORMATS)}, "
                              f"got {kind!r}", param="response_format", code="invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise BadRequestError("response_format json_schema needs a json_schema object with a "
                              "schema object: {\"type\": \"json_schema\", \"json_schema\": "
                              "{\"name\": ..., \"schema\": {...}}}", param="response_format",
                              code="invalid_value")
    return {"json": json_schema["schema"]}


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        if isinstance(exc, TypeError):  # an unknown field
            known = ", ".join(StructuredOutputsParams.__dataclass_fields__)
            message = f"{param} has an unknown field ({exc}); its fields are {known}"
        raise BadRequestError(message, param=param, code="invalid_value") from None
