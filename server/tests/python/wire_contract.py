#!/usr/bin/env python3
"""A Tidepool client written in Python with stock grpcio and stubs that
protoc generated from proto/: what a user of another language does.

Usage: wire_contract.py STUBS_DIR COORDINATOR_URL

It checks the error contract of proto/tidepool/v1/common.proto: a put and
a get round trip; NOT_FOUND and NAMESPACE_NOT_FOUND with their stable codes;
a put sent to a replica that does not lead answers NOT_LEADER with a leader
hint, which the client follows to complete the write. Every error's
grpc-status-details-bin trailer must be a google.rpc.Status with the same
code and message as the call (what grpc-go and grpc-java verify), packing
one tidepool.v1.ErrorDetail. Prints one line per check; exits 1 on the
first failure.
"""

import hashlib
import struct
import sys

STUBS, COORDINATOR = sys.argv[1], sys.argv[2]
sys.path.insert(0, STUBS)

import grpc  # noqa: E402

import rpc_status_pb2  # noqa: E402
from tidepool.v1 import blob_pb2, blob_pb2_grpc  # noqa: E402
from tidepool.v1 import common_pb2  # noqa: E402
from tidepool.v1 import coordinator_pb2, coordinator_pb2_grpc  # noqa: E402

DETAIL_TYPE = "type.googleapis.com/tidepool.v1.ErrorDetail"
TIMEOUT_S = 10


def check(what, ok, context=""):
    print(("ok   " if ok else "FAIL ") + what + (f": {context}" if context and not ok else ""))
    if not ok:
        sys.exit(1)


def target(url):
    return url.removeprefix("http://")


def detail_of(error):
    """The ErrorDetail of a failed call, checking the trailer on the way."""
    trailer = [v for k, v in (error.trailing_metadata() or ()) if k == "grpc-status-details-bin"]
    check("the error carries grpc-status-details-bin", len(trailer) == 1, error)
    status = rpc_status_pb2.RpcStatus.FromString(trailer[0])
    check(
        "its google.rpc.Status has the call's code and message",
        status.code == error.code().value[0] and status.message == error.details(),
        f"{status.code} {status.message!r} vs {error.code()} {error.details()!r}",
    )
    packed = [d for d in status.details if d.type_url == DETAIL_TYPE]
    check("it packs one tidepool.v1.ErrorDetail", len(packed) == 1, status)
    detail = common_pb2.ErrorDetail()
    check("the Any unpacks", packed[0].Unpack(detail), packed[0])
    return detail


def code_name(detail):
    return common_pb2.ErrorCode.Name(detail.code)


def storage_position(namespace_id, key):
    digest = hashlib.sha256(b"tidepool.v1.key" + struct.pack("<I", namespace_id) + key).digest()
    return struct.unpack(">Q", digest[:8])[0]


def put(stub, namespace, key, content):
    def messages():
        header = blob_pb2.PutHeader(
            blob=blob_pb2.BlobRef(namespace=namespace, key=key), size=len(content)
        )
        yield blob_pb2.PutRequest(header=header)
        yield blob_pb2.PutRequest(data=content)

    return stub.Put(messages(), timeout=TIMEOUT_S)


def get(stub, namespace, key):
    request = blob_pb2.GetRequest(blob=blob_pb2.BlobRef(namespace=namespace, key=key))
    content = b""
    for message in stub.Get(request, timeout=TIMEOUT_S):
        if message.WhichOneof("msg") == "data":
            content += message.data
    return content


def main():
    coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(
        grpc.insecure_channel(target(COORDINATOR))
    )
    cluster = coordinator.GetClusterMap(coordinator_pb2.GetClusterMapRequest(), timeout=TIMEOUT_S)
    nodes = {n.node_id: n.address for n in cluster.nodes}
    namespace = next(n for n in cluster.namespaces if n.name == "default")
    key = b"python/wire-contract"
    position = storage_position(namespace.id, key)
    shard = next(s for s in cluster.shards if s.hash_start <= position <= s.hash_end)
    check("the map names the shard's replicas", len(shard.replicas) == 3, shard)

    def stub(node):
        return blob_pb2_grpc.BlobServiceStub(grpc.insecure_channel(target(nodes[node])))

    # NOT_LEADER from a replica that does not lead (the map's hint may be a
    # round old: ask the replicas the hint does not name first); follow the
    # hint it carries.
    content = b"written from Python"
    replicas = sorted((r.node_id for r in shard.replicas), key=lambda n: n == shard.leader_hint)
    leader = None
    for node in replicas:
        try:
            put(stub(node), "default", key, content)
        except grpc.RpcError as error:
            check("a follower's refusal is UNAVAILABLE", error.code() == grpc.StatusCode.UNAVAILABLE, error)
            detail = detail_of(error)
            check("its stable code is NOT_LEADER", code_name(detail) == "NOT_LEADER", detail)
            check("it names the leader", detail.HasField("leader_hint") and detail.leader_hint.address, detail)
            leader = blob_pb2_grpc.BlobServiceStub(
                grpc.insecure_channel(target(detail.leader_hint.address))
            )
            break
    check("some replica refused the put as not the leader", leader is not None)
    response = put(leader, "default", key, content)
    check("the put completes at the hinted leader", response.info.size == len(content), response)
    check(
        "the node computed the SHA-256",
        response.info.sha256 == hashlib.sha256(content).digest(),
        response,
    )
    check("the get returns the bytes", get(leader, "default", key) == content)

    # NOT_FOUND, with its stable code (a key of the same shard, so this
    # leader answers for it).
    missing = next(
        k
        for k in (b"python/never-written-%d" % i for i in range(100_000))
        if shard.hash_start <= storage_position(namespace.id, k) <= shard.hash_end
    )
    try:
        get(leader, "default", missing)
        check("a missing key is an error", False)
    except grpc.RpcError as error:
        check("a missing key is NOT_FOUND", error.code() == grpc.StatusCode.NOT_FOUND, error)
        check("its stable code is NOT_FOUND", code_name(detail_of(error)) == "NOT_FOUND")

    # NAMESPACE_NOT_FOUND.
    try:
        get(leader, "no-such-namespace", key)
        check("a missing namespace is an error", False)
    except grpc.RpcError as error:
        check("a missing namespace is NOT_FOUND", error.code() == grpc.StatusCode.NOT_FOUND, error)
        detail = detail_of(error)
        check("its stable code is NAMESPACE_NOT_FOUND", code_name(detail) == "NAMESPACE_NOT_FOUND", detail)

    # The coordinator speaks the same contract.
    try:
        coordinator.CreateNamespace(
            coordinator_pb2.CreateNamespaceRequest(name="default"), timeout=TIMEOUT_S
        )
        check("creating an existing namespace is an error", False)
    except grpc.RpcError as error:
        detail = detail_of(error)
        check("the coordinator's stable code is NAMESPACE_EXISTS", code_name(detail) == "NAMESPACE_EXISTS", detail)
    print("wire contract: all checks passed")


if __name__ == "__main__":
    main()
