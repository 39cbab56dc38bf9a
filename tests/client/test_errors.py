"""The error tree: every SPEC 2.2 code maps to one class and status, and back."""

import pytest
from moegemm.client import (
    APIError,
    BadDtype,
    BadField,
    BadMsgpack,
    BadMSizes,
    BadName,
    BadRouting,
    BadShape,
    BadTensor,
    DeadlineExceeded,
    InternalError,
    InvalidRequest,
    MoegemmError,
    NoSuchFile,
    NoSuchWeights,
    NotFinite,
    NotFound,
    NotReady,
    OutOfMemory,
    Overloaded,
    TooLarge,
    TransportError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
)
from moegemm.client._errors import error_for

# SPEC 2.2, row by row (plus the 500 the ARCHITECTURE tree adds).
SPEC_CODES = [
    (400, "bad_msgpack", BadMsgpack),
    (400, "bad_field", BadField),
    (400, "bad_tensor", BadTensor),
    (400, "bad_dtype", BadDtype),
    (400, "bad_shape", BadShape),
    (400, "bad_m_sizes", BadMSizes),
    (400, "not_finite", NotFinite),
    (400, "bad_name", BadName),
    (400, "bad_routing", BadRouting),
    (401, "unauthorized", Unauthorized),
    (404, "no_such_weights", NoSuchWeights),
    (404, "no_such_file", NoSuchFile),
    (413, "too_large", TooLarge),
    (415, "unsupported_media_type", UnsupportedMediaType),
    (503, "not_ready", NotReady),
    (503, "overloaded", Overloaded),
    (504, "timeout", DeadlineExceeded),
    (507, "out_of_memory", OutOfMemory),
    (500, "internal", InternalError),
]


@pytest.mark.parametrize(("status", "code", "cls"), SPEC_CODES)
def test_error_for_maps_each_code(status, code, cls):
    err = error_for(status, code, "what went wrong", request_id="rid-1", retry_after=2.5)
    assert type(err) is cls
    assert (cls.status, cls.code) == (status, code)
    assert (err.status, err.code) == (status, code)
    assert err.message == "what went wrong"
    assert err.request_id == "rid-1"
    assert err.retry_after == 2.5
    assert err.to_dict() == {"error": {"code": code, "message": "what went wrong"}}
    assert isinstance(err, APIError) and isinstance(err, MoegemmError)
    assert "rid-1" in str(err) and code in str(err)


def test_leaves_sit_under_their_status_class():
    for status, _, cls in SPEC_CODES:
        parent = {400: InvalidRequest, 404: NotFound, 503: Unavailable}.get(status)
        if parent is not None:
            assert issubclass(cls, parent)
    assert not issubclass(TransportError, APIError)
    assert issubclass(TransportError, MoegemmError)


@pytest.mark.parametrize(
    ("status", "cls"),
    [(400, InvalidRequest), (404, NotFound), (503, Unavailable), (401, Unauthorized),
     (413, TooLarge), (415, UnsupportedMediaType), (500, InternalError),
     (504, DeadlineExceeded), (507, OutOfMemory)],
)
def test_unknown_code_falls_back_by_status(status, cls):
    err = error_for(status, "something_new", "msg")
    assert type(err) is cls
    assert err.status == status
    assert err.code == "something_new"


def test_no_code_and_unknown_status_keeps_the_status():
    err = error_for(502, None, "bad gateway")
    assert type(err) is APIError
    assert err.status == 502
    assert err.to_dict()["error"]["message"] == "bad gateway"


def test_raised_server_side_the_class_knows_its_answer():
    err = BadShape("K must be a multiple of 128")
    assert (err.status, err.code) == (400, "bad_shape")
    assert err.request_id is None
    assert err.to_dict() == {
        "error": {"code": "bad_shape", "message": "K must be a multiple of 128"}
    }

