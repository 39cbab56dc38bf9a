"""SPEC 2's media types of msgpack bodies: what the client sends and accepts, and what the
server takes as msgpack (its transports and acceptor processes judge them from a head, so this
module imports nothing)."""

MSGPACK = "application/vnd.msgpack"
MSGPACK_TYPES = frozenset({MSGPACK, "application/msgpack", "application/x-msgpack"})
