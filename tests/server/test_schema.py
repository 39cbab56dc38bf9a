"""schemathesis against the server's own OpenAPI schema, for the JSON endpoints.

Generated requests (any weight-set name, with and without a token) never get
a 500, and every error answer is SPEC 2's JSON with a code from its
table. The msgpack endpoints are fuzzed in test_fuzz.py: their bodies are read
by hand, so the schema says nothing about them.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moegemm.server import Settings, create_app
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from server_support import fp8_problem, serve, wire

TOKEN, ADMIN = "schema-reader", "schema-admin"
KEEP = "schema-keep"  # a set the generated DELETEs must not reach by accident

CODES = {
    400: {"bad_msgpack", "bad_field", "bad_tensor", "bad_dtype", "bad_shape", "bad_m_sizes",
          "not_finite", "bad_name"},
    401: {"unauthorized"},
    404: {"no_such_weights", "no_such_file", "not_found"},
    405: {"method_not_allowed"},
    413: {"too_large"},
    415: {"unsupported_media_type"},
    503: {"not_ready", "overloaded"},
}
JSON_OPERATIONS = r"^/v1/(health/live|health/ready|info|weights(/\{[^}]+\})?)$"


@pytest.fixture(scope="module")
def running():
    config = Settings(device="cpu", demo=False, token=TOKEN, admin_token=ADMIN)
    with serve(config) as srv:
        p = fp8_problem(4, 128, 128, 2)
        r = srv.put(KEEP, {"w": wire(p.wq), "w_scale": wire(p.w_scale)},
                    headers={"authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201, r.text
        srv.keep = srv.services.store.get(KEEP)
        yield srv
        assert srv.services.store.get(KEEP) is srv.keep


def _operations():
    # The app serves no schema (openapi_url=None); the one FastAPI builds is the contract
    # of the JSON endpoints, so it is taken from the app object.
    spec = create_app(Settings(device="cpu")).openapi()
    api = schemathesis.openapi.from_dict(spec).include(path_regex=JSON_OPERATIONS)
    return {f"{op.method.upper()} {op.path}": op
            for op in (result.ok() for result in api.get_all_operations())}


@pytest.fixture(scope="module")
def operations():
    return _operations()


def test_the_schema_covers_the_json_endpoints(operations):
    reads = {"/v1/health/live", "/v1/health/ready", "/v1/info", "/v1/weights"}
    assert set(operations) == {f"{method} {path}" for path in reads for method in ("GET", "HEAD")} | {
        "PUT /v1/weights/{name}", "DELETE /v1/weights/{name}",
    }


@pytest.mark.parametrize(("label", "mode"), [
    ("GET /v1/health/live", GenerationMode.POSITIVE),
    ("GET /v1/health/ready", GenerationMode.POSITIVE),
    ("GET /v1/info", GenerationMode.POSITIVE),
    ("GET /v1/weights", GenerationMode.POSITIVE),
    # The name is any string to the schema (the pattern is checked by the route, to
    # answer bad_name), so positive cases already hold every malformed name and
    # there is nothing for negative ones to break.
    ("PUT /v1/weights/{name}", GenerationMode.POSITIVE),
    ("DELETE /v1/weights/{name}", GenerationMode.POSITIVE),
])
def test_json_endpoints(running, operations, label, mode):
    strategy = operations[label].as_strategy(mode)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy, with_token=st.booleans())
    def check(case, with_token):
        headers = dict(case.headers or {})
        if with_token:  # most calls need a token to reach the handlers
            headers.setdefault("Authorization", f"Bearer {ADMIN}")
        if (case.path_parameters or {}).get("name") == KEEP:
            case.path_parameters["name"] = KEEP + "-not"
        response = case.call(base_url=running.url, headers=headers)
        case.validate_response(response, checks=[not_a_server_error])
        if response.status_code >= 400:
            media = {k.lower(): v for k, v in response.headers.items()}["content-type"]
            assert "application/json" in str(media), media
            code = response.json()["error"]["code"]
            assert code in CODES.get(response.status_code, ()), (response.status_code, code)

    check()
