"""The notebook's end of the relay (``runtime/relay.py`` says what the relay does): its
process, started and recorded here, and the batches it sends, opened into the ranks'
own messages for the lane (``cluster/lane.py``)."""

from __future__ import annotations

import json
import os
import select
import time
import uuid
from collections.abc import Iterator
from subprocess import PIPE, Popen

from ..runtime.relay import BATCH, DROP, FANOUT, UNREACHED
from ..signals import close_input

#: how long a relay has to say its address (it imports zmq and nothing heavier)
START_S = 10.0


class RelayLink:
    """A running relay: its process, its identity at the notebook's express socket, and the
    address the ranks connect to."""

    def __init__(self, proc: Popen, record, ident: bytes, back_url: str):
        self.proc, self.record, self.ident, self.back_url = proc, record, ident, back_url

    @classmethod
    def start(cls, python: str, session, express_url: str, ip: str) -> RelayLink:
        """Start a relay for the lane whose express socket is at ``express_url``; raises
        RuntimeError (the relay ended, or never said its address) after ending it."""
        from ..signals import Started, end

        ident = f"relay-{uuid.uuid4().hex}"
        proc = Popen(
            [python, "-m", "notebook_dist.runtime.relay"],
            stdin=PIPE,
            stdout=PIPE,
            start_new_session=True,  # a terminal's Ctrl-C is not for it
        )
        record = Started.record(proc.pid, "relay", parent=os.getpid())
        digest = session.signature_scheme.partition("-")[2] or "sha256"
        spec = {"key": (session.key or b"").hex(), "digest": digest, "front": express_url}
        spec.update(ip=ip, identity=ident)
        try:
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()  # (kept open: the relay ends when it closes)
            said = _line(proc, START_S)
            back = json.loads(said)["back"]
        except Exception as exc:
            if record is not None:
                end([record], grace_s=1.0)
            proc.wait(timeout=5)
            raise RuntimeError(f"the relay did not start ({exc or 'no address said'})") from None
        return cls(proc, record, ident.encode(), back)

    def gone(self) -> str | None:
        """How the relay ended ("exited with code 1"), or None while it runs."""
        code = self.proc.poll()
        if code is None:
            return None
        return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"

    def close(self) -> None:
        """Its input closed: it ends by itself (the cluster's stop ends it if it does not)."""
        close_input(self.proc, 1.0)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def request(self, base: str, engines: list[str], request: bytes) -> list:
        """The frames that ask the relay to pass ``request`` to ``engines``."""
        return [self.ident, FANOUT, base.encode(), " ".join(engines).encode(), request]

    def given_up(self, engines: list[str]) -> list:
        """The frames that tell the relay the notebook no longer waits for one reply from
        each of ``engines``."""
        return [self.ident, DROP, " ".join(engines).encode()]


def _line(proc: Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"nothing said in {timeout:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise EOFError(f"it exited with code {proc.wait()}")
        data += chunk
    return data.decode()


def entries(seal, frames: list) -> Iterator[tuple[str, bytes | None, object, list]]:
    """The ranks' messages in a batch from the relay (nothing when its seal is not the
    cluster's): ``(engine, kind, body, extra)`` as each rank sealed them, or ``(engine,
    None, base, [])`` where the rank could not be reached for request ``base``."""
    if len(frames) != 2:
        return
    data = frames[1].buffer
    opened = seal.opened(frames[0].buffer, (data,))
    if opened is None or opened[0] != BATCH:
        return
    words = bytes(opened[1]).split()
    skip = 1 + seal.size  # a rank's seal, checked by the relay
    i, n, at = 0, len(words), 0
    while i + 2 < n:
        engine, count = words[i].decode(), words[i + 1]
        if count == UNREACHED:
            yield engine, None, words[i + 2].decode(), []
            i += 3
            continue
        k = int(count)
        if k == 1:  # (a reply that is not a tensor's frames: most)
            end = at + int(words[i + 2])
            first, extra = data[at:end], ()
            at = end
        else:
            parts = []
            for size in words[i + 2 : i + 2 + k]:
                end = at + int(size)
                parts.append(data[at:end])
                at = end
            first, extra = parts[0], parts[1:]
        i += 2 + k
        yield engine, bytes(first[:1]), first[skip:], extra
