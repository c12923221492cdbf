"""The express route's pipes (runtime/pipes.py, cluster/pipes.py): a cell's request and
reply between the notebook and a local rank go through named pipes; what does not fit in
one goes by the socket and comes back whole; a rank's pipe that is full fails the call
that did not fit, and the queued requests are all served; a rank that ended fails its
call at once; a rank whose pipe the notebook closed reads its socket; the pipes are the
user's alone, and what is not a reply on them is dropped."""

from __future__ import annotations

import os
import stat
import time

import pytest

from notebook_dist.runtime import pipes as rt_pipes

pytestmark = pytest.mark.skipif(not rt_pipes.available(), reason="named pipes: Linux only")


def test_records_come_whole_however_the_bytes_are_cut():
    """Records cut anywhere, across reads, come out whole and in order; a reply's record
    gives back its engine and frames; one longer than a pipe's whole write is refused."""
    bodies = [b"", b"a", b"x" * 70_000, b"Q" + b"0" * 32 + b"call"]
    stream = b"".join(rt_pipes.record(b) for b in bodies)
    for cut in (1, 3, 4, 5, 4096, len(stream)):
        records, got = rt_pipes.RecordStream(), []
        for i in range(0, len(stream), cut):
            got.extend(bytes(r) for r in records.feed(stream[i : i + cut]))
        assert got == bodies, cut
    import array

    floats = memoryview(array.array("f", [1.0, 2.0]))
    made = rt_pipes.reply_record(b"engine-1", [b"R" + b"head", floats, b""])
    (body,) = rt_pipes.RecordStream().feed(made)
    engine, frames = rt_pipes.reply_parts(body)
    assert engine == "engine-1"
    assert [bytes(f) for f in frames] == [b"Rhead", floats.tobytes(), b""]
    assert rt_pipes.reply_record(b"e", [b"x" * rt_pipes.PIPE_BUF]) is None


def _rings(bell: int) -> int:
    """How many times the bell rang since the last look (its bytes taken)."""
    try:
        return len(os.read(bell, 4096))
    except BlockingIOError:
        return 0


def test_a_calls_last_reply_rings_the_bell_once_however_late_ranks_take_tokens(tmp_path):
    """The count's tokens: of a call's ranks, only the one that takes the last token
    rings. A rank of an earlier call that takes one of this call's tokens late leaves the
    last rank of this call none: it rings all the same. Tokens an earlier call left (a rank
    that died before it took its own) are taken before a call's are written, so they never
    ring for it early, and a rank the notebook did not reach by its pipe is counted down
    by the notebook."""
    from notebook_dist.cluster.pipes import RankPipes

    pipes = RankPipes(str(tmp_path / "pipes"))
    try:
        count, bell = pipes.count_fd, pipes.bell
        assert pipes.count(3)
        for rang in (0, 0, 1):  # (three ranks answer: the third rings)
            rt_pipes.count_down(count, bell)
            assert _rings(bell) == rang
        assert pipes.count(2)
        rt_pipes.count_down(count, bell)  # (a rank of an earlier call, late: takes 1)
        rt_pipes.count_down(count, bell)  # (this call's first rank takes 0: rings early)
        assert _rings(bell) == 1
        rt_pipes.count_down(count, bell)  # (its last finds none: rings, as it must)
        assert _rings(bell) == 1
        assert pipes.count(3)
        rt_pipes.count_down(count, bell)  # (a rank that then dies leaves 2 tokens)
        assert pipes.count(2)  # (they are taken first)
        rt_pipes.count_down(count, bell)
        assert _rings(bell) == 0
        pipes.uncount()  # (a rank not reached by its pipe, counted down by the notebook)
        assert _rings(bell) == 1
        assert not pipes.count(rt_pipes.PIPE_BUF)  # (more tokens than one whole write)
    finally:
        pipes.close()
    assert not os.path.exists(tmp_path / "pipes")


def test_a_cells_replies_wake_the_notebook_once_and_a_call_sent_meanwhile_each_time():
    """A cell's ranks answer through the pipes and ring the bell once: the notebook's
    wait wakes for the bell, not for each reply. A call sent while another waits is not
    counted; its reply is read as it comes, and the next cell rings again."""
    import time as _time

    from conftest import wait_until

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=4, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane, ids, view = c.processes.lane, c.processes.engine_ids, c.processes.view
        route = lane.route
        rang, seen = [], _spied(route)
        ring, poll, woke = route.pipes.rang, route._bell_poller.poll, set()
        route.pipes.rang = lambda: (rang.append(1), ring())[1]

        def polled(timeout):  # (what each wait of a cell woke for)
            ready = poll(timeout)
            woke.update(fd for fd, _ in ready)
            return ready

        route._bell_poller.poll = polled
        for i in range(10):
            assert dict(c.run(f"nd.rank + {i}").values) == {r: r + i for r in range(4)}
        assert len(rang) == 10 and seen == {"pipe": 40, "socket": 0}
        assert route.pipes.bell in woke and route.pipes.fd not in woke

        slow = lane.express(ids[:1], view, _time.sleep, 1.0)  # (counted: alone)
        quick = lane.express(ids[1:2], view, os.getpid)  # (sent while it waits)
        assert quick.wait(30) and not slow.ready()
        assert quick._children[0].result() == c.processes.rank_procs[1].pid
        assert slow.wait(30)  # (its reply read as it came, perhaps before its bell)
        for call in (slow, quick):
            call.forget()
        assert wait_until(lambda: (route.pump(0), len(rang))[1] == 11, 10)  # (it rang)
        woke.clear()
        assert dict(c.run("nd.rank").values) == {r: r for r in range(4)}
        assert len(rang) == 12 and route.pipes.bell in woke and route.pipes.fd not in woke


def _spied(route):
    """Count the replies that came by the pipe and the messages that came by the socket."""
    seen = {"pipe": 0, "socket": 0}
    replies, take = route.pipes.replies, route._take

    def by_pipe():
        got = replies()
        seen["pipe"] += len(got)
        return got

    def by_socket(frames):
        seen["socket"] += 1
        return take(frames)

    route.pipes.replies, route._take = by_pipe, by_socket
    return seen


def test_a_cells_request_and_reply_go_through_the_pipes_and_what_does_not_fit_by_the_socket():
    """Each rank reads its own pipe; a cell's reply comes by the replies' pipe. A value
    too long for one write comes by the socket; a cell longer than a write, by the pipe
    when it has room; one longer than the pipe holds, by the socket, which carries its
    replies: each returns whole."""
    import io

    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        route = c.processes.lane.route
        engines = [c.processes.client._engines[e] for e in c.processes.engine_ids]
        assert sorted(route.pipes.to) == sorted(engines)
        folder = route.pipes.folder
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        # the request pipes' names went once both ends held them
        shared = [rt_pipes.BELL, rt_pipes.COUNT, rt_pipes.REPLIES]
        assert sorted(os.listdir(folder)) == shared
        for name in shared:
            made = os.stat(os.path.join(folder, name))
            assert stat.S_ISFIFO(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o600

        seen = _spied(route)
        out = io.StringIO()
        r = c.run("print('said', nd.rank)\nnd.rank * 3", out=out)
        assert dict(r.values) == {0: 0, 1: 3}
        assert sorted(out.getvalue().splitlines()) == ["[rank 0] said 0", "[rank 1] said 1"]
        assert seen == {"pipe": 2, "socket": 0}

        r = c.run("'v' * 100_000")  # (its reply: longer than a pipe's whole write)
        assert dict(r.values) == {0: "v" * 100_000, 1: "v" * 100_000}
        assert seen == {"pipe": 2, "socket": 2}

        room = min(room for _, room in route.pipes.to.values())
        for size, came in (
            (50_000, {"pipe": 4, "socket": 2}),
            (room + 1000, {"pipe": 4, "socket": 4}),
        ):
            r = c.run(f"# {'c' * size}\nlen({size!r} * 'c')")  # (a comment: the cell is long)
            assert dict(r.values) == {0: size, 1: size}
            assert seen == came  # (a request by the socket is answered there)


def test_a_full_pipe_fails_the_call_that_did_not_fit_and_the_queued_ones_are_served(tmp_path):
    """While a rank sleeps, requests fill its pipe: the one that does not fit fails at
    once with a sentence, every one that fit is served in order once the rank wakes, and
    the next cell takes the pipe again."""
    import time as _time

    from notebook_dist import DistCluster
    from notebook_dist.cluster.express import ExpressError
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane, ids, view = c.processes.lane, c.processes.engine_ids, c.processes.view
        engine = c.processes.client._engines[ids[0]]
        room = lane.route.pipes.to[engine][1]
        busy = lane.express(ids[:1], view, _time.sleep, 3)
        filler = "f" * 100_000  # (each request carries it: a few fill the pipe)
        calls = []
        for i in range(3 * (room // 100_000) + 3):  # (the rank may take a few first)
            call = lane.express(ids[:1], view, os.path.join, str(tmp_path), str(i), filler)
            calls.append(call)
            if call.ready():  # (it failed at once: the pipe is full)
                break
        failed = calls.pop()
        assert failed.ready() and len(calls) >= 2
        with pytest.raises(ExpressError, match="has not read the requests sent to it before"):
            failed._children[0].result()
        for call in [busy, *calls]:
            assert call.wait(60)
        made = [call._children[0].result() for call in calls]
        assert made == [os.path.join(str(tmp_path), str(i), filler) for i in range(len(calls))]
        assert engine in lane.route.pipes.to
        seen = _spied(lane.route)
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        assert seen == {"pipe": 2, "socket": 0}


def test_a_rank_that_ended_fails_its_call_at_once():
    """A rank's engine killed between calls: the next call to it fails at once, saying
    its pipe is closed, without waiting for the controller to find the engine gone."""
    import select
    import signal

    from conftest import wait_until

    from notebook_dist import DistCluster
    from notebook_dist.cluster.express import ExpressError
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        lane, ids, view = c.processes.lane, c.processes.engine_ids, c.processes.view
        fd = lane.route.pipes.to[c.processes.client._engines[ids[1]]][0]
        os.kill(c.processes.rank_procs[1].pid, signal.SIGKILL)  # (an engine this test started)

        def no_reader() -> bool:  # (its last thread ended: its pipe's end closed with it)
            ended = select.poll()
            ended.register(fd, 0)
            return bool(ended.poll(0))

        assert wait_until(no_reader, 30)
        call = lane.express(ids[1:], view, os.getpid)
        assert call.ready()
        with pytest.raises(ExpressError, match="its pipe is closed"):
            call._children[0].result()


def test_a_rank_whose_pipe_the_notebook_closed_reads_its_socket_and_does_not_spin():
    """The notebook's end of a rank's pipe closed: the rank closes its own end (it does
    not wake again and again for the pipe's end), and its next cells come by the socket."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    probe: dict = {"__name__": "__main__"}  # (pickled by value: the ranks cannot import tests)
    exec(
        "def pipe_readers():\n"
        "    from notebook_dist.runtime import lane, pipes\n"
        "    return [r.fd for r in lane._STREAM if isinstance(r, pipes.PipeReader)]\n",
        probe,
    )

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        route, ids = c.processes.lane.route, c.processes.engine_ids
        engine = c.processes.client._engines[ids[0]]
        assert c.apply(probe["pipe_readers"], ranks=[0])[0] != [None]
        with route._lock:
            route.pipes.drop(engine)
        pid = c.processes.rank_procs[0].pid

        def ticks() -> int:  # (the engine's user and system CPU, in clock ticks)
            return sum(map(int, open(f"/proc/{pid}/stat").read().rsplit(")")[1].split()[11:13]))

        before = ticks()
        time.sleep(1.0)
        assert ticks() - before < 30  # (a rank woken again and again would use the second)
        assert c.apply(probe["pipe_readers"], ranks=[0])[0] == [None]
        seen = _spied(route)
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        assert seen == {"pipe": 1, "socket": 1}


def test_what_is_not_a_reply_on_the_replies_pipe_is_dropped():
    """Records on the replies' pipe that are not replies, or not to a call in flight,
    are dropped; the cluster goes on."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        c.run("pass")
        route = c.processes.lane.route
        fd = os.open(os.path.join(route.pipes.folder, rt_pipes.REPLIES), os.O_WRONLY)
        try:
            os.write(fd, rt_pipes.record(b"\x05ab"))  # (cut short)
            os.write(fd, rt_pipes.reply_record(b"nobody", [b"R" + b"0" * 32 + b"o0p"]))
            os.write(fd, rt_pipes.reply_record(b"nobody", [b"H" + b"nobody"]))
        finally:
            os.close(fd)
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        assert "nobody" not in route.ready


def test_ranks_whose_pipes_cannot_be_made_take_the_socket(monkeypatch):
    """Pipes that cannot be made as the ranks join (the system refuses a named pipe):
    the ranks join the socket alone, and cells come and go as before."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    def refused(path, mode=0o666):
        raise PermissionError(13, "Permission denied", path)

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        route = c.processes.lane.route
        assert route.pipes is not None and not route.pipes.to  # (no rank has joined yet)
        monkeypatch.setattr(os, "mkfifo", refused)
        seen = _spied(route)
        assert dict(c.run("nd.rank").values) == {0: 0, 1: 1}
        assert not route.pipes.to
        assert seen == {"pipe": 0, "socket": 4}  # (each rank's hello, then its reply)
        assert c.processes.lane.refused == set()
