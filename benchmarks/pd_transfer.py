"""P/D transfer: the transport's throughput against raw TCP, and layer-wise against whole-request
push, all on loopback in one run.

(a) transport  ZmqTransferEngine between two processes (one transfer of SIZE bytes from a
    registered buffer into another, send() -> the sender's result, which waits for the
    receiver's done; both sides wait in get_finished(timeout_s)) against a plain socket loop
    moving the same bytes between two processes (sendall, recv_into, a one-byte ack), taking
    turns round by round, each the median of --repeats rounds; GB/s and the ratio (target
    >= 0.70).
(b) push       a producer engine here and a consumer engine in a second process, both on the
    default model (SmolLM2-135M) unless --model: the producer prefills a fresh random prompt
    (max_tokens=1) with P2PConnector push "layer" or "request", the consumer is then given the
    returned kv_transfer_params, as the router does, and decodes; the time from the producer's
    request start to the consumer's first token is the median of --repeats prompts, with the
    producer's prefill and the rest (handing over, transfer, consumer's last token) apart. The
    two pushes have a producer each and take turns prompt by prompt; the producer keeps stepping
    meanwhile, as its serving loop would.

    python benchmarks/pd_transfer.py                                # 1/16/128 MiB, 2k and 8k
    python benchmarks/pd_transfer.py --sizes 1 --lengths 256 --repeats 1    # a quick check
Prints markdown tables; writes --out-json (default benchmarks/results/pd_transfer.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import time
import uuid

from kvtier import LLM, SamplingParams
from kvtier.transport import BufferId, Region, TransferId, TransportConfig
from kvtier.transport.zmq_engine import ZmqTransferEngine

NAMESPACE = hashlib.sha256(b"kvtier pd_transfer benchmark").digest()
MiB = 2**20
TIMEOUT_S = 120.0
PREFILL = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
DECODE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PUSHES = ("request", "layer")


# ---- (a) transport vs raw TCP ----------------------------------------------------------------

def _transport_receiver(conn, max_bytes: int) -> None:
    engine = ZmqTransferEngine(TransportConfig(namespace=NAMESPACE))
    buffer = bytearray(max_bytes)
    engine.register_buffer(BufferId("in"), memoryview(buffer))
    conn.send(engine.address)
    while (command := conn.recv()) is not None:
        transfer_id, size = command
        engine.recv(TransferId(transfer_id), [Region(BufferId("in"), 0, size)], TIMEOUT_S)
        conn.send("posted")
        results = engine.get_finished(timeout_s=TIMEOUT_S)
        conn.send(results[0].error if results else "no result in time")
    engine.shutdown(timeout_s=2.0)


class TransportPair:
    """A sender engine here, connected to a receiver engine in another process."""

    def __init__(self, max_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipe, there = ctx.Pipe()
        self.child = ctx.Process(target=_transport_receiver, args=(there, max_bytes), daemon=True)
        self.child.start()
        self.engine = ZmqTransferEngine(TransportConfig(namespace=NAMESPACE))
        self.source = bytearray(os.urandom(max_bytes))
        self.engine.register_buffer(BufferId("out"), memoryview(self.source))
        self.peer = self.engine.connect(self.pipe.recv(), 10.0)

    def seconds(self, size: int) -> float:
        """One transfer of `size` bytes, send() to the sender's result; the receiver posted
        its recv before."""
        transfer_id = uuid.uuid4().hex
        self.pipe.send((transfer_id, size))
        self.pipe.recv()
        start = time.perf_counter()
        self.engine.send(self.peer, TransferId(transfer_id),
                         [Region(BufferId("out"), 0, size)], TIMEOUT_S)
        results = self.engine.get_finished(timeout_s=TIMEOUT_S)
        seconds = time.perf_counter() - start
        error = results[0].error if results else "no result in time"
        if error or (error := self.pipe.recv()):
            raise RuntimeError(f"transfer of {size} bytes failed: {error}")
        return seconds

    def close(self) -> None:
        self.pipe.send(None)
        self.child.join(10.0)
        self.engine.shutdown(timeout_s=2.0)


def _tcp_receiver(conn_to_parent, max_bytes: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn_to_parent.send(listener.getsockname())
    conn, _ = listener.accept()
    listener.close()
    buffer = memoryview(bytearray(max_bytes))
    with conn:
        while header := conn.recv(8, socket.MSG_WAITALL):
            size, received = int.from_bytes(header, "little"), 0
            while received < size:
                received += conn.recv_into(buffer[received:size])
            conn.sendall(b"k")


class TcpPair:
    """A plain socket here, connected to a receiver loop in another process."""

    def __init__(self, max_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        pipe, there = ctx.Pipe()
        self.child = ctx.Process(target=_tcp_receiver, args=(there, max_bytes), daemon=True)
        self.child.start()
        self.source = memoryview(bytearray(os.urandom(max_bytes)))
        self.conn = socket.create_connection(pipe.recv(), timeout=TIMEOUT_S)

    def seconds(self, size: int) -> float:
        """One round: `size` bytes there, a one-byte ack back."""
        start = time.perf_counter()
        self.conn.sendall(size.to_bytes(8, "little"))
        self.conn.sendall(self.source[:size])
        if self.conn.recv(1) != b"k":
            raise RuntimeError("the raw TCP receiver went away")
        return time.perf_counter() - start

    def close(self) -> None:
        self.conn.close()
        self.child.join(10.0)


def measure_transport(sizes_mib: list[int], repeats: int) -> list[dict]:
    """The median seconds of each size, transport and raw TCP taking turns round by round so
    that a change in the machine's load touches both alike."""
    sizes = [n * MiB for n in sizes_mib]
    pairs = {"transport": TransportPair(max(sizes)), "raw_tcp": TcpPair(max(sizes))}
    rows = []
    for size in sizes:
        rounds: dict[str, list[float]] = {name: [] for name in pairs}
        for _ in range(repeats + 1):  # the first round of each size warms up
            for name, pair in pairs.items():
                rounds[name].append(pair.seconds(size))
        zmq_s, tcp_s = (statistics.median(rounds[name][1:]) for name in pairs)
        rows.append({"size_mib": size // MiB, "transport_gb_s": size / zmq_s / 1e9,
                     "raw_tcp_gb_s": size / tcp_s / 1e9, "ratio": tcp_s / zmq_s})
    for pair in pairs.values():
        pair.close()
    return rows


# ---- (b) layer-wise vs whole-request push --------------------------------------------------------

def _engine(model: str | None, role: str, args: dict, extra: dict, **fields) -> LLM:
    return LLM(model, kv_transfer_config={"kv_connector": "P2PConnector", "kv_role": role,
                                          "kv_connector_extra_config": extra, **fields}, **args)


def _run(llm: LLM, request_id: str, prompt: list[int], params: SamplingParams,
         kv_transfer_params: dict) -> tuple[float, object]:
    """(monotonic time of the first token, the finished output) of one request."""
    llm.engine.add_request(request_id, prompt, params,
                           kv_transfer_params=kv_transfer_params)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for output in llm.engine.step():
            if output.request_id == request_id and output.finished:
                return time.monotonic(), output
    raise TimeoutError(f"request {request_id} did not finish in {TIMEOUT_S} s")


def _consumer(conn, model: str | None, engine_args: dict) -> None:
    llm = _engine(model, "kv_consumer", engine_args, {}, kv_load_timeout_s=TIMEOUT_S)
    conn.send(llm.engine.runner.connector.address)
    while (command := conn.recv()) is not None:
        request_id, prompt, params = command
        first_token, output = _run(llm, request_id, prompt, DECODE, params)
        conn.send((first_token, output.num_cached_tokens))
    llm.engine.shutdown()


def _serve_until(producer: LLM, conn) -> object:
    """Step the producer (its sends end there) until the consumer answers."""
    deadline = time.monotonic() + TIMEOUT_S
    while not conn.poll():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the consumer did not answer in {TIMEOUT_S} s")
        connector = producer.engine.runner.connector
        if producer.engine.has_unfinished_requests() or connector.num_open_transfers:
            producer.engine.step()
        else:
            time.sleep(0.0002)
    return conn.recv()


def _one_prompt(producer: LLM, conn, address: str, prompt: list[int]) -> dict:
    transfer_id = uuid.uuid4().hex
    start = time.monotonic()
    prefilled, output = _run(producer, transfer_id, prompt, PREFILL,
                             {"transfer_id": transfer_id, "consumer_address": address})
    conn.send((transfer_id, prompt, output.kv_transfer_params))
    first_token, cached = _serve_until(producer, conn)
    return {"ttft_s": first_token - start, "prefill_s": prefilled - start,
            "cached_tokens": cached}


def measure_push(model: str | None, lengths: list[int], repeats: int, engine_args: dict,
                 seed: int) -> list[dict]:
    """Both pushes, one producer engine each, taking turns prompt by prompt so that a change in
    the machine's load touches both alike."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_consumer, args=(there, model, engine_args), daemon=True)
    child.start()
    address, rng = here.recv(), random.Random(seed)
    producers = {push: _engine(model, "kv_producer", engine_args, {"push": push})
                 for push in PUSHES}
    vocab = producers["request"].engine.model_config.vocab_size
    runs: dict[tuple[str, int], list[dict]] = {}
    for n in [64, *lengths]:  # 64: first-call costs (allocations, kernel selection)
        for _ in range(repeats):
            for push, producer in producers.items():
                # A fresh prompt each time: neither engine may find it in its prefix cache.
                prompt = [rng.randrange(100, vocab) for _ in range(n)]
                runs.setdefault((push, n), []).append(
                    _one_prompt(producer, here, address, prompt))
    for producer in producers.values():
        producer.engine.shutdown()
    here.send(None)
    child.join(30.0)
    return [{"push": push, "prompt_tokens": n,
             "ttft_s": statistics.median(r["ttft_s"] for r in runs[(push, n)]),
             "prefill_s": statistics.median(r["prefill_s"] for r in runs[(push, n)]),
             "cached_tokens": [r["cached_tokens"] for r in runs[(push, n)]]}
            for n in lengths for push in PUSHES]


# ---- report --------------------------------------------------------------------------------------

def print_tables(transport: list[dict], push: list[dict]) -> None:
    print("| size | transport GB/s | raw TCP GB/s | transport / raw |\n|---|---|---|---|")
    for row in transport:
        print(f"| {row['size_mib']} MiB | {row['transport_gb_s']:.2f} | "
              f"{row['raw_tcp_gb_s']:.2f} | {row['ratio']:.2f} |")
    print("\n| prompt tokens | push | producer start -> consumer first token (s) | "
          "producer prefill (s) | after the prefill (s) | consumer cached tokens |\n"
          "|---|---|---|---|---|---|")
    for row in push:
        print(f"| {row['prompt_tokens']} | {row['push']} | {row['ttft_s']:.3f} | "
              f"{row['prefill_s']:.3f} | {row['ttft_s'] - row['prefill_s']:.3f} | "
              f"{row['cached_tokens']} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 128],
                        help="transfer sizes in MiB for (a)")
    # 8191: SmolLM2's 8192 positions hold the prompt and the one generated token.
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8191],
                        help="prompt lengths in tokens for (b)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--device-kv", default="1GiB", help="device KV cache budget")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=("transport", "push"), default=None)
    parser.add_argument("--out-json", default="benchmarks/results/pd_transfer.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    engine_args = dict(dtype=args.dtype, device=args.device, kv_cache_memory_bytes=args.device_kv,
                       max_num_batched_tokens=args.chunk, max_model_len=max(args.lengths) + 1)
    transport = [] if args.skip == "transport" else measure_transport(args.sizes, args.repeats)
    push = [] if args.skip == "push" else measure_push(args.model, args.lengths, args.repeats,
                                                       engine_args, args.seed)
    print_tables(transport, push)
    os.makedirs(os.path.dirname(args.out_json) or ".", exist_ok=True)
    with open(args.out_json, "w") as f:
        json.dump({"args": vars(args), "transport": transport, "push": push}, f, indent=2)


if __name__ == "__main__":
    main()
