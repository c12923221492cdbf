"""A rank's end of the direct lane (``cluster/lane.py``): the notebook's function calls
reach the engine over sockets of their own instead of through the controller's queue.

Two routes share the connection step:

- The **ipyparallel route** carries ipyparallel's own ``apply_request`` and ``apply_reply``,
  signed by the engine's session, each handled by the engine kernel's own
  ``apply_request`` in the engine's main thread, between the messages of its other
  channels, as its shell channel handles them: the parent set for the output, Ctrl-C as
  KeyboardInterrupt during the call, the streams flushed and 'idle' published after the
  reply, so the notebook knows when the rank's output is complete. It serves any function
  (the notebook's own, pickled by value, see the rank's namespace as through the queue).
- The **express route** carries a cell: one of notebook_dist's own functions, by name, with
  plain arguments. A request is three frames, pickled and signed once for every rank
  (each rank's message id is the request's with its own uuid), and the reply is the
  function's packed frames as they are, with a flag that says whether the rank wrote
  anything. 'idle' is published only then, so a cell that printed nothing costs one
  message each way. The output it does write is sent as before (IOPub, parented on the
  request's id), and the notebook waits for its 'idle' exactly as for ipyparallel's.
"""

from __future__ import annotations

import hmac
import pickle
import sys
import traceback
from typing import Any

#: the first frame of an express request and of its reply, and of the rank's hello
EXPRESS = b"nd-express-1"
HELLO = b"nd-hello-1"

#: the lane's streams on this engine (one set at a time: a reconnect replaces them)
_STREAM: list[Any] = []
#: how many messages this engine's session has sent (IOPub included): a call that moved
#: it wrote something the notebook must wait for
_SENT = [0]


def signature(session, parts: list) -> bytes:
    """HMAC of ``parts`` with the cluster's key (b"" without a key, as Session signs)."""
    return session.sign(parts)


def verified(session, sig, parts: list) -> bool:
    return session.auth is None or hmac.compare_digest(bytes(sig), session.sign(parts))


def connect(url: str, express_url: str | None = None) -> str:
    """Connect this engine to the notebook's lane at ``url`` (and its express route at
    ``express_url``) and say so on each; returns the identity the notebook addresses it by
    (the engine's uuid, as ipyparallel's own)."""
    import zmq
    from IPython import get_ipython
    from zmq.eventloop.zmqstream import ZMQStream

    from .state import STATE

    kernel = get_ipython().kernel
    # a release shuts down the rank's Gloo connections, never the lane's
    STATE.extras["lane_ports"] = {int(u.rsplit(":", 1)[1]) for u in (url, express_url) if u}
    for old in _STREAM:
        old.close(linger=0)
    _STREAM.clear()
    sock = _dealer(zmq, kernel, url)
    stream = ZMQStream(sock, kernel.io_loop)
    stream.on_recv(lambda frames: serve(kernel, sock, frames), copy=False)
    _STREAM.append(stream)
    kernel.session.send(sock, "lane_hello", {"engine": kernel.ident})
    if express_url:
        _count_sends(kernel.session)
        xsock = _dealer(zmq, kernel, express_url)
        xstream = ZMQStream(xsock, kernel.io_loop)
        xstream.on_recv(lambda frames: serve_express(kernel, xsock, frames), copy=False)
        _STREAM.append(xstream)
        me = kernel.ident.encode()
        xsock.send_multipart([HELLO, signature(kernel.session, [me]), me])
    return kernel.ident


def _dealer(zmq, kernel, url: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = kernel.ident.encode()
    sock.connect(url)
    return sock


def _count_sends(session) -> None:
    """Count what the engine's session sends (once per session)."""
    if getattr(session.send, "_notebook_dist_counted", False):
        return
    send = session.send

    def counted(*args, **kwargs):
        _SENT[0] += 1
        return send(*args, **kwargs)

    counted._notebook_dist_counted = True
    session.send = counted


def serve(kernel, sock, frames: list) -> None:
    """One request from the lane, handled as the kernel's shell channel handles one."""
    idents, msg = kernel.session.feed_identities(frames, copy=False)
    try:
        msg = kernel.session.deserialize(msg, content=True, copy=False)
    except Exception:  # not signed with the cluster's key, or not a message: dropped
        kernel.log.error("Invalid message on the lane", exc_info=True)
        return
    if msg["header"]["msg_type"] != "apply_request":
        return
    kernel.set_parent(idents, msg, channel="shell")
    try:
        if kernel.should_handle(sock, msg, idents):  # (an aborted request is answered so)
            kernel.pre_handler_hook()  # Ctrl-C is a KeyboardInterrupt in the call
            try:
                kernel.apply_request(sock, idents, msg)
            finally:
                kernel.post_handler_hook()
    except KeyboardInterrupt:  # between the call and its reply: as the shell channel does
        kernel.log.error("KeyboardInterrupt caught in the lane.")
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        kernel._publish_status("idle", "shell")  # the rank's output is complete


def serve_express(kernel, sock, frames: list) -> None:
    """One express request: ``func(*args)`` in the main thread, its output parented on
    the request, the reply its frames (or its pickle), 'idle' only after output."""
    from .streams import flush_written, written

    session = kernel.session
    if len(frames) != 4 or frames[0].bytes != EXPRESS:
        return
    head, body = frames[2].buffer, frames[3].buffer
    if not verified(session, frames[1].bytes, [head, body]):
        kernel.log.error("An express request not signed with the cluster's key: dropped")
        return
    base, sender, username = pickle.loads(head)
    msg_id = f"{base}-{kernel.ident}"  # (the same request went to every rank)
    parent = {
        "header": {
            "msg_id": msg_id,
            "session": sender,
            "username": username,
            "msg_type": "apply_request",
            "version": "5.3",
        },
        "parent_header": {},
        "metadata": {},
        "content": {},
    }
    kernel.set_parent([], parent, channel="shell")
    wrote_before, sent_before = written(), _SENT[0]
    try:
        func, args = pickle.loads(body)
        kernel.pre_handler_hook()  # Ctrl-C is a KeyboardInterrupt in the call
        try:
            status, value = "ok", func(*args)
        finally:
            kernel.post_handler_hook()
    except BaseException as exc:  # KeyboardInterrupt between the call and its reply too
        status, value = "error", _failure(exc)
    flush_written(wrote_before)
    wrote = written() != wrote_before or _SENT[0] != sent_before
    how, parts = _reply_frames(status, value)
    head = pickle.dumps((msg_id, status if how else "error", wrote, how or b"p"))
    sock.send_multipart([EXPRESS, signature(session, [head, *parts]), head, *parts])
    if wrote:
        kernel._publish_status("idle", "shell")  # the rank's output is complete


def _reply_frames(status: str, value: Any) -> tuple[bytes, list]:
    """The reply's frames: a list of bytes-like frames as they are (``b"f"``), anything
    else pickled (``b"p"``); ``b""`` with the pickling error when it cannot be."""
    if (
        status == "ok"
        and isinstance(value, list)
        and all(isinstance(v, (bytes, bytearray, memoryview)) for v in value)
    ):
        return b"f", value
    try:
        return b"p", [pickle.dumps(value, protocol=5)]
    except Exception as exc:
        return b"", [pickle.dumps(_failure(exc))]


def _failure(exc: BaseException) -> dict[str, str]:
    return {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
