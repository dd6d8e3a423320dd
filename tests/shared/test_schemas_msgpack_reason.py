"""shared.schemas.from_msgpack: bytes that are no msgpack at all raise a SchemaError whose
reason says why -- msgpack's FormatError (a byte no value starts with, ``0xc1``) carries no
message of its own, which left "not msgpack: " and nothing after it."""

from __future__ import annotations

import pytest

from shared.schemas import FirstToken, SchemaError, from_msgpack


@pytest.mark.parametrize("raw", [b"\xc1", b"", b"\x93\x01", b"\x01\x02"],
                         ids=["never-used-byte", "empty", "truncated", "extra-data"])
def test_bytes_that_are_no_msgpack_give_a_reason(raw: bytes) -> None:
    with pytest.raises(SchemaError) as err:
        from_msgpack(FirstToken, raw)
    assert err.value.field == "<payload>"
    assert err.value.reason.startswith("not msgpack: ")
    assert err.value.reason.removeprefix("not msgpack: ").strip(), err.value.reason
