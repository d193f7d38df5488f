"""The planner's cost model: seconds per engine step and per KV byte moved between tiers.

One engine step runs the prefill chunks and the decoding sequences scheduled together:

    step_s = step_s_base + prefill_s_per_token * prefill tokens + decode_s_per_seq * decoding seqs
             + prefill_s_per_pair * prefill attention pairs
             + decode_s_per_context_token * tokens the decoding sequences attend to

A prefill chunk of n tokens after c tokens already computed has n * c + n * (n + 1) / 2 attention
pairs (each token attends to the context and to the chunk up to itself): the cost that makes long
prompts slower than their length alone says. A decoding sequence reads its whole context once a
step. A prefix loaded from a tier costs its bytes times that tier's `load_s_per_byte` (a chunk on
disk is read into host memory and then copied to the device: both costs; the disk tier's loads
straight from the page cache cost less, which the plan does not count). A chunk stored to a tier
(the device's copy into host memory, host memory's write to a secondary tier) costs its bytes times
that tier's `store_s_per_byte`, charged to the step after the one that computed it (simulator.py):
the stores run on threads beside the steps, and on a machine without spare cores they take the
steps' time. Serving adds `server_s_per_step` to every step and `server_s_per_token` to every token
the step streams (its first tokens and decodes): the HTTP server, the output streams and the client
share the machine with the engine. `kvtier plan calibrate` measures the model on this machine and
fits the coefficients; a JSON file of them lets one plan for other hardware.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# A cost model names the machine and model it was measured on; these keys are its numbers.
_NUMBERS = ("step_s_base", "prefill_s_per_token", "decode_s_per_seq")
# Terms a cost model file may leave out (files from earlier calibrations do): 0, no cost from
# context length or from serving.
_OPTIONAL_NUMBERS = ("prefill_s_per_pair", "decode_s_per_context_token", "server_s_per_step",
                     "server_s_per_token")


@dataclass(frozen=True)
class CostModel:
    """Step costs and per-byte tier loads and stores (seconds; see the module docstring for the
    sum). `load_s_per_byte` maps a tier kind (`host`, `disk`, `fs`) to the seconds one byte
    takes to reach the level above it, `store_s_per_byte` to the seconds one byte takes to be
    stored there (a kind it leaves out stores for free)."""

    step_s_base: float
    prefill_s_per_token: float
    decode_s_per_seq: float
    load_s_per_byte: dict[str, float] = field(default_factory=dict)
    model: str = ""
    machine: str = ""
    prefill_s_per_pair: float = 0.0
    decode_s_per_context_token: float = 0.0
    store_s_per_byte: dict[str, float] = field(default_factory=dict)
    server_s_per_step: float = 0.0
    server_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in _NUMBERS + _OPTIONAL_NUMBERS:
            value = getattr(self, name)
            if not _is_cost(value):
                raise ValueError(f"cost model {name} must be a finite number >= 0, got "
                                 f"{value!r}")
        for table in ("load_s_per_byte", "store_s_per_byte"):
            for tier, value in getattr(self, table).items():
                if not _is_cost(value):
                    raise ValueError(f"cost model {table}[{tier!r}] must be a finite number "
                                     f">= 0, got {value!r}")

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_prefill_pairs: int = 0,
               num_decode_context: int = 0) -> float:
        """One engine step: `num_prefill_pairs` summed over its prefill chunks (prefill_pairs),
        and `num_decode_context` the context tokens of its decoding sequences, summed."""
        return (self.step_s_base + self.prefill_s_per_token * num_prefill_tokens
                + self.decode_s_per_seq * num_decode_seqs
                + self.prefill_s_per_pair * num_prefill_pairs
                + self.decode_s_per_context_token * num_decode_context)

    def served_s(self, num_tokens_streamed: int) -> float:
        """What serving adds to a step that streams `num_tokens_streamed` tokens."""
        return self.server_s_per_step + self.server_s_per_token * num_tokens_streamed

    def store_s(self, tier_kind: str, num_bytes: int) -> float:
        """Seconds to store `num_bytes` into `tier_kind`."""
        return self.store_s_per_byte.get(tier_kind, 0.0) * num_bytes

    def load_s(self, tier_kind: str, num_bytes: int) -> float:
        """Seconds to bring `num_bytes` from `tier_kind` one level up."""
        if tier_kind not in self.load_s_per_byte:
            raise ValueError(f"the cost model has no load cost for the {tier_kind!r} tier; add "
                             f"load_s_per_byte.{tier_kind} to it (has "
                             f"{sorted(self.load_s_per_byte)})")
        return self.load_s_per_byte[tier_kind] * num_bytes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str = "cost model") -> CostModel:
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(raw).__name__}")
        known = {"load_s_per_byte", "store_s_per_byte", "model", "machine", "measurements",
                 "served_measurements", *_NUMBERS, *_OPTIONAL_NUMBERS}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; keys are {sorted(known)}")
        missing = [name for name in _NUMBERS if name not in raw]
        if missing:
            raise ValueError(f"{where}: missing {missing}; run `kvtier plan calibrate` to "
                             "measure them")
        return cls(**{k: v for k, v in raw.items()
                      if k not in ("measurements", "served_measurements")})


def _is_cost(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def prefill_pairs(num_tokens: int, num_context: int) -> int:
    """Attention pairs of a prefill chunk of `num_tokens` after `num_context` computed tokens."""
    return num_tokens * num_context + num_tokens * (num_tokens + 1) // 2


def load_cost_model(path: Path) -> CostModel:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the cost model {path}: {exc}") from exc
    return CostModel.from_json(raw, f"cost model {path}")


def write_cost_model(model: CostModel, path: Path, measurements: list[dict] | None = None,
                     served_measurements: list[dict] | None = None) -> None:
    payload = model.to_json()
    # The raw timings the fits came from: the engine's steps, and the batches served.
    if measurements is not None:
        payload["measurements"] = measurements
    if served_measurements is not None:
        payload["served_measurements"] = served_measurements
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def default_cost_model_path() -> Path:
    """The cost model shipped with kvtier: SmolLM2-135M on a 2-core VM (see its `machine`)."""
    return Path(__file__).parent / "cost_models" / "smollm2-135m-2core.json"
