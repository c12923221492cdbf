"""A rank's end of the direct lane (``cluster/lane.py``): the notebook's function calls
reach the engine over a socket of its own instead of through the controller's queue.

The messages are ipyparallel's own ``apply_request`` and ``apply_reply``, signed by the
engine's session, and each is handled by the engine kernel's own ``apply_request`` in the
engine's main thread, between the messages of its other channels, as its shell channel
handles them: the parent set for the output, Ctrl-C as KeyboardInterrupt during the call,
the streams flushed and 'idle' published after the reply, so the notebook knows when the
rank's output is complete. Only the route is shorter: one hop fewer each way.
"""

from __future__ import annotations

import sys
from typing import Any

#: the lane's stream on this engine (one at a time: a reconnect replaces it)
_STREAM: list[Any] = []


def connect(url: str) -> str:
    """Connect this engine to the notebook's lane at ``url`` and say so on it; returns the
    identity the notebook addresses it by (the engine's uuid, as ipyparallel's own)."""
    import zmq
    from IPython import get_ipython
    from zmq.eventloop.zmqstream import ZMQStream

    kernel = get_ipython().kernel
    for old in _STREAM:
        old.close(linger=0)
    _STREAM.clear()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = kernel.ident.encode()
    sock.connect(url)
    stream = ZMQStream(sock, kernel.io_loop)
    stream.on_recv(lambda frames: serve(kernel, sock, frames), copy=False)
    _STREAM.append(stream)
    kernel.session.send(sock, "lane_hello", {"engine": kernel.ident})
    return kernel.ident


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
