"""Chunks, keys and configs for the tiering tests, the worker's side of a store, and running an
engine with tiers."""

import itertools
import time

from kvtier.offload.config import OffloadConfig
from kvtier.offload.keys import make_chunk_key
from kvtier.offload.manager import Lookup, TieringManager
from kvtier.offload.tiers.base import LookupResult, TransferJob

NAMESPACE = bytes(range(32))
CHUNK = 64
# The out-of-tree test tiers, as a tier config's module_path names them.
FAULTY_TIERS = "tests.offload.faulty_tiers"


def key(n: int):
    return make_chunk_key(NAMESPACE, 0, n.to_bytes(32, "big"))


def chunk_bytes(n: int) -> bytes:
    return bytes((n * 7 + i) % 256 for i in range(CHUNK))


def offload_config(num_slots: int, tiers=(), **extra) -> OffloadConfig:
    return OffloadConfig.from_extra_config({"cpu_bytes_to_use": num_slots * CHUNK,
                                            "secondary_tiers": list(tiers), **extra})


def store_from_device(manager: TieringManager, n: int) -> None:
    """Play the worker's part of a device->host store of chunk n."""
    manager.record_use(key(n))
    slot = manager.prepare_store(key(n), CHUNK)
    assert slot is not None
    manager.area.slot_view(slot, CHUNK)[:] = chunk_bytes(n)
    manager.complete_store(key(n), ok=True)


def poll_until(manager: TieringManager, n: int, timeout: float = 10.0) -> Lookup:
    """Poll until chunk n's lookup is not RETRY (promotions run on tier threads)."""
    deadline = time.monotonic() + timeout
    while True:
        manager.poll()
        answer = manager.lookup(key(n), CHUNK)
        if answer is not Lookup.RETRY or time.monotonic() > deadline:
            return answer
        time.sleep(0.005)


def read_host(manager: TieringManager, n: int) -> bytes:
    [slot] = manager.prepare_loads([key(n)])
    data = bytes(manager.area.slot_view(slot, CHUNK))
    manager.complete_loads([key(n)], ok=True)
    return data


# Job ids for the tier tests' jobs, unique across tests.
_job_ids = itertools.count()


def tier_job(n: int, buffer=None) -> TransferJob:
    """A job for chunk n; a store job carries its bytes unless `buffer` is given."""
    buffer = memoryview(bytearray(chunk_bytes(n))) if buffer is None else buffer
    return TransferJob(next(_job_ids), key(n), buffer, time.monotonic() + 10)


def wait_jobs(tier, job_ids, timeout=10.0):
    """{job_id: ok} once every job in `job_ids` is reported."""
    deadline, results = time.monotonic() + timeout, {}
    while set(results) != set(job_ids):
        assert time.monotonic() < deadline, f"tier jobs {set(job_ids) - set(results)} hang"
        results.update((r.job_id, r.ok) for r in tier.get_finished_jobs())
        time.sleep(0.002)
    return results


def tier_store(tier, n) -> bool:
    job = tier_job(n)
    tier.submit_store(job)
    return wait_jobs(tier, [job.job_id])[job.job_id]


def tier_load(tier, n) -> tuple[bool, bytes]:
    out = memoryview(bytearray(CHUNK))
    job = tier_job(n, out)
    tier.submit_load(job)
    return wait_jobs(tier, [job.job_id])[job.job_id], bytes(out)


def drain(manager: TieringManager, timeout: float = 10.0) -> None:
    """Poll until the manager has no tier job in flight."""
    deadline = time.monotonic() + timeout
    while manager.num_jobs_in_flight():
        assert time.monotonic() < deadline, "tier jobs hang"
        manager.poll()
        time.sleep(0.002)


def settled_lookup(tier, n: int, timeout: float = 15.0) -> LookupResult:
    """A store tier's answer for chunk `n` once its existence check is back (not UNKNOWN)."""
    deadline = time.monotonic() + timeout
    while (answer := tier.lookup(key(n))) is LookupResult.UNKNOWN:
        assert time.monotonic() < deadline, "existence check hangs"
        time.sleep(0.005)
    return answer


def spy_value_reads(tier, monkeypatch) -> list[int]:
    """The bytes each load of the remote `tier` reads of its value, in order, from now on."""
    lengths = []
    read = tier._get_within

    def get_within(*args):
        data = read(*args)
        lengths.append(len(data))
        return data

    monkeypatch.setattr(tier, "_get_within", get_within)
    return lengths


def tier_factory(build):
    """For a fixture: yields `make(...)`, which builds a tier with `build(...)`; every tier made
    is shut down after the test."""
    tiers = []

    def make(*args, **options):
        tiers.append(build(*args, **options))
        return tiers[-1]

    yield make
    for tier in tiers:
        tier.shutdown()


def stored_bytes(manager: TieringManager, tier: str) -> int:
    """Bytes the manager has written from host memory to `tier`."""
    name = f'kvtier:offload_bytes_total{{direction="host_to_{tier}"}}'
    return manager.metrics.snapshot().get(name, 0)


def generate(llm, prompts: list[list[int]], params) -> tuple[list[list[int]], list[int]]:
    """Each prompt's tokens and cached-token count, the engine checked after."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.engine.check_invariants()
    return [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def flushed(llm) -> None:
    """Every chunk the engine computed has reached its tiers."""
    llm.engine.step()  # the worker half fences the last step's copies and reports them
    assert llm.engine.scheduler.connector.flush(timeout_s=30), "cascade to the tiers hangs"


def offload_bytes(llm, direction: str) -> float:
    return llm.get_metrics().get(f'kvtier:offload_bytes_total{{direction="{direction}"}}', 0.0)
