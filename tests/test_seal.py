"""The express route's sealed frames (runtime/lane.py ``Seal``): a frame opens only under
the key it was sealed with, and only whole: a changed byte of the body, of a frame after it
or of the signature, a frame cut short, or a frame that lost its following frames is
refused. Without a key (as a Session without one) nothing is signed and everything opens."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from notebook_dist.runtime.lane import HELLO, REPLY, REQUEST, Seal


def _seal(key: bytes = b"the cluster's key") -> Seal:
    return Seal(Session(key=key))


def test_a_sealed_frame_opens_whole_under_its_key():
    seal = _seal()
    frame = seal.sealed(REPLY, b"body", [b"buffer one", memoryview(b"buffer two")])
    kind, body = seal.opened(frame, [b"buffer one", b"buffer two"])
    assert (kind, bytes(body)) == (REPLY, b"body")
    assert len(frame) == 1 + 32 + len(b"body")  # kind, HMAC-SHA256, body: nothing else


@pytest.mark.parametrize("where", ["kind", "signature", "body", "extra", "cut", "dropped"])
def test_a_changed_or_cut_frame_is_refused(where):
    seal = _seal()
    extra = [b"buffer"]
    frame = bytearray(seal.sealed(REQUEST, b"a request", extra))
    if where == "kind":  # a reply cannot be passed off as a hello, nor a hello as a request
        frame[0:1] = HELLO
    elif where == "signature":
        frame[5] ^= 1
    elif where == "body":
        frame[-1] ^= 1
    elif where == "extra":
        extra = [b"buffes"]
    elif where == "cut":
        frame = frame[:20]
    elif where == "dropped":
        extra = []
    assert seal.opened(bytes(frame), extra) is None


def test_a_frame_sealed_with_another_key_is_refused():
    frame = _seal(b"another key").sealed(HELLO, b"engine-uuid")
    assert _seal().opened(frame) is None
    assert _seal(b"another key").opened(frame)[0] == HELLO


def test_without_a_key_nothing_is_signed():
    seal = _seal(b"")
    frame = seal.sealed(REPLY, b"body")
    assert frame == REPLY + b"body"
    kind, body = seal.opened(frame)
    assert (kind, bytes(body)) == (REPLY, b"body")
    assert seal.opened(b"") is None
