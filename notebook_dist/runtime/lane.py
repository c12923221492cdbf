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
  plain arguments. Every message on it is one sealed frame (:class:`Seal`: a kind byte,
  the HMAC of the kind, the body and any frames after it under the cluster's key, the
  body), with the reply's buffers, if any, as frames after it. A request is pickled and sealed once for every rank (each
  rank's message id is the request's with its own uuid); the reply is the function's
  packed frames as they are, with a byte that says whether the rank wrote anything. What
  it wrote on one stream, none of it sent yet, goes in the reply after its head (up to
  64 KiB: :func:`~notebook_dist.runtime.streams.taken`), and the notebook waits for
  nothing more. Other output (both streams, a display, more) is sent as before (IOPub,
  parented on the request's id), and 'idle' after it, which the notebook waits for
  exactly as for ipyparallel's; a cell that printed nothing costs one frame each way.
"""

from __future__ import annotations

import _signal
import hmac
import pickle
import sys
import traceback
from typing import Any

from .pipes import reply_record
from .streams import flush_written, for_the_reply, rotations, taken, written

#: the first byte of a sealed frame on the express route: a request, its reply, a hello
REQUEST, REPLY, HELLO = b"Q", b"R", b"H"
#: a request on a rank's pipe whose reply counts down (``runtime/pipes.py``, COUNT)
COUNTED = b"C"
#: a reply's body begins with the request's id (32 hex digits), then status, wrote and how
#: (a byte each)
REPLY_HEAD = 35

#: the lane's streams on this engine (one set at a time: a reconnect replaces them)
_STREAM: list[Any] = []
#: how many messages this engine's session has sent (IOPub included): a call that moved
#: it wrote something the notebook must wait for
_SENT = [0]


class Seal:
    """Seals and opens the express route's frames with a session's key (the HMAC of the
    kind, the body and any frames after it, as raw bytes; nothing without a key, as
    Session signs)."""

    __slots__ = ("key", "keyed", "size")

    def __init__(self, session):
        self.key = session.key or None
        self.keyed = hmac.new(self.key, digestmod=session.digest_mod) if self.key else None
        self.size = self.keyed.digest_size if self.key else 0

    def _mac(self, kind, body, extra) -> bytes:
        h = self.keyed.copy()  # (the key's own setup done once)
        h.update(kind)
        h.update(body)
        for part in extra:
            h.update(part)
        return h.digest()

    def sealed(self, kind: bytes, body, extra: list | tuple = ()) -> bytes:
        """One frame: ``kind``, the signature of ``kind``, ``body`` and ``extra``, ``body``."""
        return b"".join((kind, self._mac(kind, body, extra) if self.key else b"", body))

    def opened(self, frame, extra: list | tuple = ()):
        """``(kind, body)`` of a sealed frame (memoryviews), or None when its signature is
        not the cluster's."""
        frame = memoryview(frame)
        end = 1 + self.size
        if len(frame) < end:
            return None
        body = frame[end:]
        if self.key and not hmac.compare_digest(frame[1:end], self._mac(frame[:1], body, extra)):
            return None
        return bytes(frame[:1]), body


def connect(url: str, express_url: str | None = None, pipe_dir: str | None = None) -> str:
    """Connect this engine to the notebook's lane at ``url`` (and its express route at
    ``express_url``, with its pipes in ``pipe_dir`` where it can open them,
    ``runtime/pipes.py``) and say so on each; returns the identity the notebook addresses
    it by (the engine's uuid, as ipyparallel's own)."""
    import zmq
    from IPython import get_ipython
    from zmq.eventloop.zmqstream import ZMQStream

    from .state import STATE

    kernel = get_ipython().kernel
    # a release shuts down the rank's Gloo connections, never the lane's
    STATE.extras["lane_ports"] = {int(u.rsplit(":", 1)[1]) for u in (url, express_url) if u}
    disconnect()
    sock = _dealer(zmq, kernel, url)
    stream = ZMQStream(sock, kernel.io_loop)
    stream.on_recv(lambda frames: serve(kernel, sock, frames), copy=False)
    _STREAM.append(stream)
    kernel.session.send(sock, "lane_hello", {"engine": kernel.ident})
    if express_url:
        _count_sends(kernel.session)
        xsock = _dealer(zmq, kernel, express_url)
        _STREAM.append(_Reader(xsock, kernel.io_loop, lambda f: serve_express(kernel, xsock, f)))
        if pipe_dir:
            _join_pipes(kernel, xsock, pipe_dir)
        xsock.send(_seal(kernel.session).sealed(HELLO, kernel.ident.encode()))
    return kernel.ident


def disconnect() -> None:
    """Close this engine's end of the lane (its sockets, and its pipes): before it joins
    again, or as it stops being a rank of a notebook that attached to it."""
    for old in _STREAM:
        old.close(linger=0)
    _STREAM.clear()


def _join_pipes(kernel, sock, pipe_dir: str) -> None:
    """Read requests from this engine's pipe in ``pipe_dir`` and write replies into the
    notebook's; nothing when they cannot be opened (the socket serves)."""
    import os

    from . import pipes

    fds: list[int] = []
    try:  # (the request pipe last: a rank holds it only with the others, for the notebook
        # takes one that is open as the rank's promise to count its replies down)
        for name, mode in (
            (pipes.REPLIES, os.O_WRONLY),
            (pipes.COUNT, os.O_RDONLY),
            (pipes.BELL, os.O_WRONLY),
            (kernel.ident, os.O_RDONLY),
        ):
            fds.append(pipes.open_pipe(os.path.join(pipe_dir, name), mode))
    except OSError:  # not on the notebook's machine
        for fd in fds:
            os.close(fd)
        return
    reply_fd, count_fd, bell_fd, fd = fds
    reader = pipes.PipeReader(
        (fd, reply_fd, count_fd, bell_fd),
        kernel.io_loop,
        lambda b: serve_piped(kernel, sock, reader, b),
    )
    _STREAM.append(reader)


class _Reader:
    """The express route's socket in the engine's event loop: one message each time round
    the loop, as ipyparallel's own streams are read, without a ZMQStream's bookkeeping
    around each (its option reads and flag conversions were a third of the loop's work
    for an empty cell)."""

    def __init__(self, sock, io_loop, handle):
        self.sock, self.io_loop, self.handle = sock, io_loop, handle
        io_loop.add_handler(sock, self._ready, io_loop.READ)
        io_loop.add_callback(self._ready)  # (what came before the descriptor was watched)

    def _ready(self, *_) -> None:
        sock = self.sock
        # the descriptor only says that something changed: the socket's events say what
        # (reading them is what lets the descriptor signal again)
        if sock is None or not sock.getsockopt(_EVENTS) & _POLLIN:
            return
        frames = received(sock)
        try:
            self.handle(frames)
        except Exception:  # (serve_express answers every request itself)
            import logging

            logging.getLogger("notebook_dist").exception("an express request failed")
        if self.sock is not None and self.sock.getsockopt(_EVENTS) & _POLLIN:
            self.io_loop.add_callback(self._ready)  # the next, after the loop's other work

    def close(self, linger: int = 0) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            self.io_loop.remove_handler(sock)
            sock.close(linger=linger)


#: zmq's option and flags as plain ints (pyzmq's enum conversions, and send_multipart's and
#: recv_multipart's combining of flags for every frame, cost more than the calls)
_EVENTS, _POLLIN, _NOBLOCK, SNDMORE = 15, 1, 1, 2


def received(sock) -> list:
    """One whole message, without waiting (zmq.Again when none has come); its frames as
    zmq Frames."""
    frames = [sock.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:
        frames.append(sock.recv(copy=False))
    return frames


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
    """One express request from the socket, its seal checked: answered there."""
    seal = _seal(kernel.session)
    opened = seal.opened(frames[0].buffer) if len(frames) == 1 else None
    if opened is None or opened[0] != REQUEST:
        kernel.log.error("An express request not signed with the cluster's key: dropped")
        return
    answer(kernel, opened[1], lambda first, extra: _by_socket(seal, sock, first, extra))


def serve_piped(kernel, sock, reader, body) -> None:
    """One express request from the rank's pipe: answered in the notebook's pipe when
    the reply fits (else by the socket)."""
    kind = body[:1]
    if kind != REQUEST and kind != COUNTED:
        kernel.log.error("Not an express request on the rank's pipe: dropped")
        return
    ident = kernel.ident.encode()

    def send(first: bytes, extra: list) -> None:
        record = reply_record(ident, [REPLY + first, *extra])
        if record is None or not reader.reply(record):
            _by_socket(_seal(kernel.session), sock, first, extra)
        if kind == COUNTED:
            reader.count_down()

    answer(kernel, body[1:], send)


def _by_socket(seal: Seal, sock, first: bytes, extra: list) -> None:
    sock.send_multipart([seal.sealed(REPLY, first, extra), *extra])


def answer(kernel, body, send) -> None:
    """One express request's body (its id, then its pickled call): ``func(*args)`` in the
    main thread, its output parented on the request, the reply's first frame (its head and
    the value's frame) and its other frames given to ``send(first, extra)``; 'idle' only
    after output."""
    base = bytes(body[:32]).decode()
    try:
        sender, username, func, args = pickle.loads(body[32:])
    except Exception as exc:  # (a function this rank cannot import): said in the reply
        sender, username, func, args = "", "", _raise, (exc,)
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
    wrote_before, sent_before, rotated = written(), _SENT[0], rotations()
    try:
        # Ctrl-C is a KeyboardInterrupt in the call, as the kernel's pre_handler_hook does,
        # without the signal module's enum conversions (a tenth of an empty cell's time)
        saved = _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        try:
            with for_the_reply():
                status, value = "ok", func(*args)
        finally:
            _signal.signal(_signal.SIGINT, saved)
    except BaseException as exc:  # KeyboardInterrupt between the call and its reply too
        status, value = "error", _failure(exc)
    # the output in the reply, when it can go there whole (no message of its own sent yet)
    output = taken(rotated) if _SENT[0] == sent_before else None
    if output is None:
        flush_written(wrote_before)
        moved = written() != wrote_before or _SENT[0] != sent_before
        wrote, said = (WROTE if moved else WROTE_NOTHING), b""
    else:
        wrote, said = in_reply(*output)
    how, parts = _reply_frames(status, value)
    head = b"".join((base.encode(), b"e" if status != "ok" or how == b"x" else b"o", wrote, how))
    send(head + said + bytes(parts[0]), parts[1:])
    if wrote == WROTE:
        kernel._publish_status("idle", "shell")  # the rank's output is complete


#: a reply's wrote byte: nothing, output sent as messages (wait for 'idle'), or the text
#: of stdout or of stderr in the reply, after its head: its length (4 bytes), then UTF-8
WROTE_NOTHING, WROTE, IN_STDOUT, IN_STDERR = b"0", b"1", b"O", b"E"


def in_reply(name: str, text: str) -> tuple[bytes, bytes]:
    """The wrote byte and what goes after the reply's head for a call's output."""
    if not text:
        return WROTE_NOTHING, b""
    try:  # (as the kernel's messages encode text: a lone surrogate reads as one U+FFFD)
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "replace")
    return IN_STDOUT if name == "stdout" else IN_STDERR, len(data).to_bytes(4, "little") + data


#: [the engine's session, its Seal]: made at the first request
_SEAL: list = []


def _seal(session) -> Seal:
    if not _SEAL or _SEAL[0] is not session:
        _SEAL[:] = [session, Seal(session)]
    return _SEAL[1]


def _raise(exc: BaseException):
    raise exc


def _reply_frames(status: str, value: Any) -> tuple[bytes, list]:
    """The reply's frames: a list of bytes-like frames as they are (``b"f"``), anything
    else pickled (``b"p"``); ``b"x"`` with the pickling error when it cannot be."""
    if (
        status == "ok"
        and isinstance(value, list)
        and all(isinstance(v, (bytes, bytearray, memoryview)) for v in value)
    ):
        return b"f", value
    try:
        return b"p", [pickle.dumps(value, protocol=5)]
    except Exception as exc:
        return b"x", [pickle.dumps(_failure(exc))]


def _failure(exc: BaseException) -> dict[str, str]:
    return {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }
