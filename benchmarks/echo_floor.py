"""The floor under a cell's dispatch on this machine: ``n`` plain Python processes, each
answering one zmq frame with one frame, as bare as an engine could be (no kernel, no
event loop, no work), and one process that sends a frame to each and waits for every
answer, as the notebook does for a cell.

    python benchmarks/echo_floor.py N ROUNDS [pipes]   prints {"wall_s": ..., "cpu_s": ...}

With ``pipes``, each process reads its own pipe and all of them answer into one pipe, as a
cell's request and reply go between the notebook and its ranks by default
(``runtime/pipes.py``): the floor under that route.

What it takes at 16 processes against 2 is the best ratio one process per rank can reach
here: with fewer cores than processes, their wake-ups alone queue for the cores.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

RESPONDER = """
import sys, zmq
s = zmq.Context().socket(zmq.DEALER)
s.linger = 0
s.connect(sys.argv[1])
s.send(b"hello")
while True:
    m = s.recv()
    if m == b"q":
        break
    s.send(m)
"""


def echo_rounds(n: int, rounds: int, warm: int = 100) -> dict:
    """Median wall and CPU (of the sending process) per round of ``n`` echoes."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    url = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    procs = [subprocess.Popen([sys.executable, "-c", RESPONDER, url]) for _ in range(n)]
    try:
        peers = []
        while len(peers) < n:
            if not sock.poll(60_000):
                raise RuntimeError("a responder did not say hello within 60 s")
            peers.append(sock.recv_multipart()[0])

        def one_round() -> None:
            for p in peers:
                sock.send_multipart([p, b"x"])
            for _ in peers:
                sock.recv_multipart()

        timed = _timed(one_round, rounds, warm)
        for p in peers:
            sock.send_multipart([p, b"q"])
    finally:
        _ended(procs)
        sock.close()
        ctx.term()
    return timed


PIPE_RESPONDER = """
import os, sys
fd, answer = int(sys.argv[1]), int(sys.argv[2])
while True:
    m = os.read(fd, 65536)
    if not m or m == b"q":
        break
    os.write(answer, m)
"""


def pipe_rounds(n: int, rounds: int, warm: int = 100) -> dict:
    """:func:`echo_rounds` through pipes: one to each process, one back from all of them."""
    import os
    import select

    back, answer = os.pipe()
    to, procs = [], []
    try:
        for _ in range(n):
            theirs, ours = os.pipe()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", PIPE_RESPONDER, str(theirs), str(answer)],
                    pass_fds=(theirs, answer),
                )
            )
            os.close(theirs)
            to.append(ours)

        def one_round() -> None:
            for fd in to:
                os.write(fd, b"x")
            got = 0
            while got < n:  # (one byte an answer)
                select.select([back], [], [])
                got += len(os.read(back, 65536))

        timed = _timed(one_round, rounds, warm)
    finally:
        for fd in to:
            os.write(fd, b"q")
            os.close(fd)
        _ended(procs)
        os.close(back)
        os.close(answer)
    return timed


def _timed(one_round, rounds: int, warm: int) -> dict:
    """Median wall and CPU of ``rounds`` calls of ``one_round``, after ``warm`` more."""
    walls, cpus = [], []
    for i in range(warm + rounds):
        w0, c0 = time.perf_counter(), time.process_time()
        one_round()
        if i >= warm:
            cpus.append(time.process_time() - c0)
            walls.append(time.perf_counter() - w0)
    return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def _ended(procs: list) -> None:
    for p in procs:  # ours, by pid
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    how = pipe_rounds if sys.argv[3:] == ["pipes"] else echo_rounds
    print(json.dumps(how(int(sys.argv[1]), int(sys.argv[2]))))
