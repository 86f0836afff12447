#!/usr/bin/env python3
"""Checks a running attention_server's reflection (grpc.reflection.v1alpha,
what grpcurl asks): every service it lists is described, its file and each
file that imports, so that a client can rebuild every type. The messages are
encoded here by hand: Debian packages no Python reflection stubs.

usage: reflection_check.py HOST:PORT
"""
import sys

import grpc
from google.protobuf import descriptor_pb2

METHOD = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"


def varint(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(number, payload):
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def fields(data):
    """The (number, value) pairs of a message: ints for varints, bytes for
    length-delimited fields (the only wire types these messages use)."""
    at, out = 0, []

    def read_varint():
        nonlocal at
        shift = value = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < len(data):
        key = read_varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            out.append((number, read_varint()))
        elif wire_type == 2:
            size = read_varint()
            out.append((number, data[at:at + size]))
            at += size
        else:
            raise ValueError(f"field {number}: wire type {wire_type} not expected")
    return out


def ask(channel, request):
    """One ServerReflectionRequest, its response's fields by number."""
    call = channel.stream_stream(METHOD, request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    (response,) = list(call(iter([request]), timeout=10))
    return dict((n, v) for n, v in fields(response) if n != 2)  # 2: the request echoed


def main():
    channel = grpc.insecure_channel(sys.argv[1])
    listed = ask(channel, length_delimited(7, b"*"))  # list_services
    services = [dict(fields(s))[1].decode() for n, s in fields(listed[6]) if n == 1]
    failures = []
    for service in services:
        answer = ask(channel, length_delimited(4, service.encode()))  # file_containing_symbol
        if 7 in answer:  # error_response
            error = dict(fields(answer[7]))
            failures.append(f"{service}: error {error.get(1)}: {error.get(2, b'').decode()}")
            continue
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for n, b in fields(answer[4]) if n == 1]
        defined = {f"{f.package}.{s.name}" for f in files for s in f.service}
        names = {f.name for f in files}
        missing = [d for f in files for d in f.dependency if d not in names]
        if service not in defined:
            failures.append(f"{service}: not in the files described ({sorted(names)})")
        if missing:
            failures.append(f"{service}: its files import {missing}, not described")
    print(f"reflection: {len(services)} services listed: {', '.join(services)}")
    for failure in failures:
        print(f"reflection: FAIL {failure}")
    return 1 if failures or len(services) < 3 else 0


if __name__ == "__main__":
    sys.exit(main())
