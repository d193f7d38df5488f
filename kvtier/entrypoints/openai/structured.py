"""A request's output constraint: OpenAI's response_format or vLLM's structured_outputs,
as StructuredOutputsParams. The engine compiles it (a schema or grammar that does not compile
is a 400 from there)."""

from __future__ import annotations

from typing import Any

from kvtier.entrypoints.openai.errors import BadRequestError
from kvtier.entrypoints.openai.protocol import SamplingFields
from kvtier.sampling_params import StructuredOutputsParams

# vLLM's removed guided decoding fields, and the structured_outputs field each became.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_FORMATS = ("text", "json_object", "json_schema")


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
