#!/usr/bin/env python3
"""Benchmarks of the Python client against a server it starts on 127.0.0.1:0
(parts 1 and 2 are its two targets, issue 22):

1. Overhead: calls/s of Client.attend (numpy, and torch) for B1 H8 L=S=128
   D64, against a raw grpcio call sending the same request pre-serialized
   (bytes in, bytes out, nothing encoded or decoded). Rounds alternate, so
   drift hits every variant alike. Target: client >= 0.8x raw. Beside each,
   the process's minor page faults per call: glibc returning the heap's top
   to the kernel after a call, and faulting it back in on the next, shows
   there (docs/benchmarks.md, "Python client").
2. Copies: what one call with a 24 MiB request allocates at its peak, in
   units of the request's bytes, two ways: tracemalloc (Python objects and
   numpy buffers: the copies made in Python; grpcio's C core and protobuf's
   C++ allocations are not traced), and the process's peak RSS over its RSS
   before the call (/proc/self/clear_refs resets the peak: every copy,
   grpcio's own included). Beside it, protobuf's own encoding
   (Tensor.data = array.tobytes(), SerializeToString) through the raw call.
   Target: at most one copy in Python beyond grpcio's own.
3. Heap: Client.attend alone in a loop in a fresh process (as a program
   that only calls the service runs it), then the raw call: calls/s and
   minor page faults per call, with glibc's malloc defaults (the client
   raises its thresholds once) and with GLIBC_TUNABLES setting them instead
   (docs/python.md, "Performance").
4. Sessions: decode steps/s of one session (one row of 64, one head, after
   128 rows): blocking Session.step, the same requests on one blocking
   stream, and attention_client.aio's unary and stream=True steps, in
   alternating rounds, each round a new session.

    .venv/bin/python tests/bench/python_client_bench.py --server build/attention_server
    # one part: --only overhead|copies|heap|sessions
    # or: PYTHONPATH=build/python /usr/bin/python3 tests/bench/python_client_bench.py ...
"""
import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
import tracemalloc

import grpc
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                "python"))
import attention_client  # noqa: E402
import attention_client.aio  # noqa: E402
from attention_client._proto.attention.v1 import attention_pb2, tensor_pb2  # noqa: E402
from server_fixture import Server  # noqa: E402

MiB = 1 << 20
# Fixed malloc thresholds under which the heap keeps what a call frees
# (docs/python.md, "Performance"); the client then leaves them be.
GLIBC_TUNABLES = "glibc.malloc.mmap_threshold=4194304:glibc.malloc.trim_threshold=16777216"


def protobuf_request(q, k, v):
    def tensor(a):
        return tensor_pb2.Tensor(dtype=tensor_pb2.Tensor.FLOAT32, shape=a.shape, data=a.tobytes())
    return attention_pb2.AttendRequest(query=tensor(q), key=tensor(k), value=tensor(v))


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _minor_faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def rate(call, seconds):
    """(calls/s, minor page faults per call) of call() repeated for `seconds`."""
    faults = _minor_faults()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        call()
        n += 1
    calls_per_second = n / (time.perf_counter() - start)
    return calls_per_second, (_minor_faults() - faults) / n


def overhead(target, seconds, rounds):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for _ in range(3))
    client = attention_client.Client(target)
    raw_channel = grpc.insecure_channel(target)
    raw_attend = raw_channel.unary_unary("/attention.v1.AttentionService/Attend")
    request = protobuf_request(q, k, v).SerializeToString()
    variants = {
        "raw grpcio, pre-serialized bytes": lambda: raw_attend(request, timeout=30),
        "Client.attend numpy": lambda: client.attend(q, k, v),
    }
    try:
        import torch
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        variants["Client.attend torch"] = lambda: client.attend(tq, tk, tv)
    except ImportError:
        pass
    for call in variants.values():  # warm up
        rate(call, 0.3)
    results = {name: [] for name in variants}
    faults = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            calls_per_second, faults_per_call = rate(call, seconds)
            results[name].append(calls_per_second)
            faults[name].append(faults_per_call)
    raw = np.median(results["raw grpcio, pre-serialized bytes"])
    print(f"overhead: B1 H8 L=S=128 D64 float32 ({len(request) / MiB:.2f} MiB request), "
          f"{rounds} rounds of {seconds} s, median calls/s and minor page faults per call")
    for name, rates in results.items():
        med = np.median(rates)
        print(f"  {name:36s} {med:8.1f} calls/s  {med / raw:5.2f}x raw  "
              f"{np.median(faults[name]):6.1f} faults/call  "
              f"(rounds: {', '.join(f'{r:.0f}' for r in rates)})")
    # The client's own work per call, apart from the call: encoding the
    # request and decoding an answer.
    from attention_client import _request, _wire
    raw_request, kind = _request.build(q, k, v, {})
    answer = raw_attend(raw_request, timeout=30)
    for label, work in (("encode", lambda: _request.build(q, k, v, {})),
                        ("decode", lambda: _wire.decode(answer, kind))):
        n = 300
        start = time.perf_counter()
        for _ in range(n):
            work()
        print(f"  client {label} alone: {(time.perf_counter() - start) / n * 1e6:.0f} us per call")
    client.close()
    raw_channel.close()


def loop(target, seconds, rounds):
    """Part 3's child: Client.attend alone, then the raw call (which needs no
    heap of ours); prints each one's median calls/s and faults per call."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for _ in range(3))
    with attention_client.Client(target) as client:
        measured = [rate(lambda: client.attend(q, k, v), seconds) for _ in range(rounds)]
    with grpc.insecure_channel(target) as raw_channel:
        raw_attend = raw_channel.unary_unary("/attention.v1.AttentionService/Attend")
        request = protobuf_request(q, k, v).SerializeToString()
        raw = [rate(lambda: raw_attend(request, timeout=30), seconds) for _ in range(rounds)]
    print(*(np.median(x) for x in zip(*measured)), *(np.median(x) for x in zip(*raw)))


def heap(target, seconds, rounds):
    print(f"heap: Client.attend numpy alone in a fresh process, then the raw call, {rounds} "
          f"rounds of {seconds} s each, median calls/s and minor page faults per call")
    for label, tunables in (("glibc's malloc defaults (and the client's 8 MiB block)", None),
                            (f"GLIBC_TUNABLES={GLIBC_TUNABLES}", GLIBC_TUNABLES)):
        env = {name: value for name, value in os.environ.items()
               if name != "GLIBC_TUNABLES" and not name.startswith("MALLOC_")}
        if tunables:
            env["GLIBC_TUNABLES"] = tunables
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--loop", target,
                              "--seconds", str(seconds), "--rounds", str(rounds)],
                             env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
        client, client_faults, raw, raw_faults = (float(x) for x in out.split())
        print(f"  {label}")
        print(f"    {'Client.attend numpy':34s} {client:8.1f} calls/s  {client / raw:5.2f}x raw  "
              f"{client_faults:6.1f} faults/call")
        print(f"    {'raw grpcio, pre-serialized bytes':34s} {raw:8.1f} calls/s  {'':9s}  "
              f"{raw_faults:6.1f} faults/call")


def copies(target):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 1, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 8, 6144, 64)).astype(np.float32) for _ in range(2))
    request_bytes = k.nbytes + v.nbytes + q.nbytes
    client = attention_client.Client(target)
    raw_channel = grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", 256 * MiB)])
    raw_attend = raw_channel.unary_unary("/attention.v1.AttentionService/Attend")
    client.attend(q, k, v)  # connect and warm up outside the measurement

    def peak(call):
        """(tracemalloc peak, peak RSS growth) of call(), in bytes."""
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        rss = _status_kib("VmRSS")
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        call()
        traced = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        return traced, (_status_kib("VmHWM") - rss) * 1024

    measured = {
        "Client.attend numpy": peak(lambda: client.attend(q, k, v)),
        "protobuf-built request + raw call": peak(
            lambda: raw_attend(protobuf_request(q, k, v).SerializeToString(), timeout=60)),
    }
    try:
        import torch
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        measured["Client.attend torch"] = peak(lambda: client.attend(tq, tk, tv))
    except ImportError:
        pass
    print(f"copies: a {request_bytes / MiB:.1f} MiB request (q [1,8,1,64], k and v "
          f"[1,8,6144,64] float32), tracemalloc peak of one call")
    print(f"  {'':36s} {'tracemalloc (Python)':>28s}   {'peak RSS growth (all)':>28s}")
    for name, (traced, rss) in measured.items():
        print(f"  {name:36s} {traced / MiB:7.1f} MiB = {traced / request_bytes:4.2f} copies   "
              f"{rss / MiB:7.1f} MiB = {rss / request_bytes:4.2f} copies")
    client.close()
    raw_channel.close()


def sessions(target, seconds, rounds):
    rng = np.random.default_rng(0)
    prompt = rng.standard_normal((1, 128, 64)).astype(np.float32)
    row = rng.standard_normal((1, 1, 64)).astype(np.float32)
    fields = {"num_heads": 1, "causal": "bottom_right"}

    def blocking():
        with attention_client.Client(target) as client, client.session(**fields) as s:
            s.step(prompt)
            return rate(lambda: s.step(row), seconds)[0]

    def blocking_stream():
        # What blocking sessions would step at on a stream: the same session
        # requests on one grpcio stream, each written and its answer awaited
        # (grpcio takes a blocking stream's requests from an iterator, on a
        # thread of its own).
        import queue
        from attention_client import _wire
        with attention_client.Client(target) as client, client.session(**fields) as s:
            s.step(prompt)
            core, pending = s._core, queue.Queue()
            answers = client._attend_stream(iter(pending.get, None))

            def step():
                one = core.prepare(row, None, None)
                pending.put(core.request(one))
                core.advance(one, core.position, _wire.decode(next(answers), one[3]))
            try:
                return rate(step, seconds)[0]
            finally:
                pending.put(None)
                answers.cancel()

    async def aio_steps(stream):
        async with attention_client.aio.Client(target) as client:
            async with client.session(stream=stream, **fields) as s:
                await s.step(prompt)
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    await s.step(row)
                    n += 1
                return n / (time.perf_counter() - start)

    variants = {
        "blocking Session.step (unary)": blocking,
        "blocking, steps on one stream": blocking_stream,
        "aio Session.step (unary)": lambda: asyncio.run(aio_steps(False)),
        "aio Session.step, stream=True": lambda: asyncio.run(aio_steps(True)),
    }
    results = {name: [] for name in variants}
    for _ in range(rounds):
        for name, run in variants.items():
            results[name].append(run())
    print(f"sessions: decode steps of one session (a row of 64, one head, over 128+ rows), "
          f"{rounds} rounds of {seconds} s, median steps/s")
    base = np.median(results["aio Session.step (unary)"])
    for name, rates in results.items():
        med = np.median(rates)
        print(f"  {name:36s} {med:8.1f} steps/s  {med / base:5.2f}x aio unary  "
              f"(rounds {min(rates):.0f}-{max(rates):.0f})")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--server", default="build/attention_server", help="attention_server binary")
    p.add_argument("--seconds", type=float, default=2.0, help="per round and variant")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", choices=("overhead", "copies", "heap", "sessions"),
                   help="run one part")
    p.add_argument("--loop", metavar="TARGET", help=argparse.SUPPRESS)  # part 3's child
    a = p.parse_args()
    if a.loop:
        loop(a.loop, a.seconds, a.rounds)
        return
    os.environ["ATTENTION_SERVER"] = a.server
    server = Server()
    try:
        with attention_client.Client(server.target) as c:
            server.wait_serving(c)
        parts = {
            "overhead": lambda: overhead(server.target, a.seconds, a.rounds),
            "copies": lambda: copies(server.target),
            "heap": lambda: heap(server.target, a.seconds, min(a.rounds, 3)),
            "sessions": lambda: sessions(server.target, a.seconds, a.rounds),
        }
        for name, part in parts.items():
            if a.only in (None, name):
                part()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
