"""The gRPC transport against real gRPC servers: plaintext on a Unix socket (what local sandboxes use), and TLS
with a bearer token (what remote sandboxes will use), with errors translated to status codes."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import trustme
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rewardbox.errors import TransportError
from rewardbox.scoring.transport import Endpoint, GrpcTransport
from rewardbox.wire import SERVICE_NAME
from tests.conftest import run
from rewardbox.wire.pb import reward_pb2 as pb

TOKEN = "s3cret-token"


class RequireToken(grpc.ServerInterceptor):
    def intercept_service(self, continuation, details):
        if dict(details.invocation_metadata).get("authorization") == f"Bearer {TOKEN}":
            return continuation(details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")

        return grpc.unary_unary_rpc_method_handler(deny)


def health_server(port_spec: str, credentials=None, interceptors=()):
    """A gRPC server with only the health service (SERVING): Load/Describe/Score are UNIMPLEMENTED there."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=list(interceptors))
    servicer = health.HealthServicer()
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port(port_spec, credentials) if credentials else server.add_insecure_port(port_spec)
    server.start()
    return server, port


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_server(ca):
    cert = ca.issue_cert("localhost")
    credentials = grpc.ssl_server_credentials([(cert.private_key_pem.bytes(), cert.cert_chain_pems[0].bytes())])
    server, port = health_server("localhost:0", credentials, [RequireToken()])
    yield f"localhost:{port}"
    server.stop(0)


def test_a_unix_socket_endpoint_is_plaintext_and_rpc_errors_carry_their_code(tmp_path):
    target = f"unix://{tmp_path / 'grpc.sock'}"
    server, _ = health_server(target)
    try:
        connection = GrpcTransport().connect(Endpoint(target))
        assert connection.check_health(timeout_s=5)
        with pytest.raises(TransportError) as caught:
            connection.describe(timeout_s=5)
        assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(TransportError) as caught:
            run(connection.score(pb.ScoreRequest(function="r"), timeout_s=5))
        assert caught.value.code == grpc.StatusCode.UNIMPLEMENTED
        connection.close()
    finally:
        server.stop(0)


def test_tls_with_the_right_ca_and_token_is_accepted(tls_server, ca):
    connection = GrpcTransport().connect(Endpoint(tls_server, root_certificates=ca.cert_pem.bytes(), token=TOKEN))
    assert connection.check_health(timeout_s=5)


def test_a_wrong_token_is_refused_as_unauthenticated(tls_server, ca):
    connection = GrpcTransport().connect(Endpoint(tls_server, root_certificates=ca.cert_pem.bytes(), token="nope"))
    assert not connection.check_health(timeout_s=5)
    with pytest.raises(TransportError) as caught:
        connection.describe(timeout_s=5)
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED and "bad token" in str(caught.value)


def test_an_untrusted_certificate_or_plaintext_never_reaches_the_service(tls_server):
    other_ca = trustme.CA()
    untrusted = GrpcTransport().connect(Endpoint(tls_server, root_certificates=other_ca.cert_pem.bytes(),
                                                 token=TOKEN))
    assert not untrusted.check_health(timeout_s=3)
    plaintext = GrpcTransport().connect(Endpoint(tls_server))
    with pytest.raises(TransportError) as caught:
        plaintext.describe(timeout_s=3)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_an_endpoints_secrets_stay_out_of_its_repr():
    endpoint = Endpoint("host:1", root_certificates=b"PEM", token=TOKEN)
    assert TOKEN not in repr(endpoint) and "PEM" not in repr(endpoint)
