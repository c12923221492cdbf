"""Shared fixtures: an isolated IPython shell and one real 2-rank Gloo cluster.

Isolation: a temporary IPYTHONDIR, OMP_NUM_THREADS=1, OS-assigned ports (the cluster
asks the OS), and finalizers that stop every process a fixture started, by pid.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time

# before IPython or ipyparallel are imported anywhere
os.environ["IPYTHONDIR"] = tempfile.mkdtemp(prefix="nd-ipython-")
# removed at exit, after the session's IPython shell has written its history there (exit
# callbacks run last-registered first, and IPython registers its own later)
atexit.register(shutil.rmtree, os.environ["IPYTHONDIR"], ignore_errors=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["JUPYTER_PLATFORM_DIRS"] = "1"

import psutil  # noqa: E402
import pytest  # noqa: E402


@contextlib.contextmanager
def ctrl_c_after(seconds: float):
    """The user's Ctrl-C, ``seconds`` into the block: SIGINT to this process.

    A shell starts a background job (``bash .ci/run &``) with SIGINT ignored, and Python
    then keeps it ignored; Ctrl-C in a notebook always arrives, so Python's own handler is
    put in place for the block.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(seconds, lambda: signal.raise_signal(signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)


class Hung(KeyboardInterrupt):
    """The test's Ctrl-C, raised from the watch once a verdict shows."""


def until_verdict(cluster, code: str, hang_after: float, give_up_s: float | None = None):
    """Run ``code`` as a ``%%distributed`` cell until the doctor shows its verdict, then press
    Ctrl-C as a user would (after ``give_up_s`` without one, too). Returns the diagnosis (None
    if none showed), what the cell printed, the seconds until the verdict and until the end."""
    out = io.StringIO()
    t0 = time.monotonic()
    seen = {}

    def on_update(watch):
        if watch.shown_verdict and "diag" not in seen:
            seen["diag"] = watch.diagnosis
            seen["t"] = time.monotonic() - t0
            raise Hung()
        if give_up_s is not None and time.monotonic() - t0 > give_up_s:
            raise Hung()

    with pytest.raises(KeyboardInterrupt):
        cluster.run(
            code,
            filename="Cell In[5]",
            header="%%distributed",
            out=out,
            hang_after=hang_after,
            on_update=on_update,
        )
    end = time.monotonic() - t0
    return seen.get("diag"), out.getvalue(), seen.get("t", end), end


def torchrun(script, nproc: int = 2, env: dict | None = None, timeout: float = 240):
    """``torchrun --standalone --nproc_per_node=N script`` in this Python, one thread per
    rank (as CI's 2 cores need): the CompletedProcess, text captured."""
    import subprocess

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )


def wait_until(holds, within_s: float, every_s: float = 0.1) -> bool:
    """Ask ``holds()`` until it is true or ``within_s`` seconds have passed; whether it
    held. The one polling loop of the tests (each says how long it gives the machine)."""
    deadline = time.monotonic() + within_s
    while True:
        if holds():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture(scope="session")
def ip():
    """An in-process IPython shell with notebook_dist loaded."""
    from IPython.terminal.interactiveshell import TerminalInteractiveShell

    shell = TerminalInteractiveShell.instance()
    shell.colors = "nocolor"
    shell.run_line_magic("load_ext", "notebook_dist")
    yield shell
    from notebook_dist import session

    session.shutdown()


class CellRun:
    def __init__(self, stdout: str, stderr: str, result):
        self.stdout = stdout
        self.stderr = stderr
        self.result = result

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def error(self):
        return self.result.error_before_exec or self.result.error_in_exec


@pytest.fixture(scope="session")
def run(ip):
    """run(text) executes a cell in the shell and returns what it printed and its result."""
    from IPython.utils.capture import capture_output

    def _run(text: str) -> CellRun:
        with capture_output() as cap:
            result = ip.run_cell(text, store_history=True)
        return CellRun(cap.stdout, cap.stderr, result)

    return _run


@pytest.fixture(scope="session")
def cluster2(ip, run):
    """The shell's cluster: 2 CPU ranks on Gloo, shared by the tests that only run cells."""
    from notebook_dist import session

    started: list = []

    def ensure():
        cluster = session.current()
        if cluster is None or cluster.world_size != 2 or cluster.dead_ranks():
            out = run("%dist_init -n 2 --backend gloo")
            assert out.error is None, out.output
            cluster = session.current()
            started.append([r.pid for r in cluster.ranks])
        return cluster

    yield ensure
    session.shutdown()
    for pids in started:
        assert pids_alive(pids) == [], "engines left running after shutdown"


@pytest.fixture
def live(cluster2):
    """The shared 2-rank cluster; a fresh one if an earlier test replaced or broke it."""
    return cluster2()


def rank_table(stdout: str) -> list[str]:
    """The rank table %dist_init prints (header first), below its versions line."""
    lines = stdout.strip().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["rank", "host"])
    return lines[start:]


def python_exe() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """The wheel and the sdist, built from a clean copy of the checkout (tests/installs.py)."""
    from installs import build, clean_copy

    src = clean_copy(tmp_path_factory.mktemp("src"))
    return build(src, tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def executed_notebooks(tmp_path_factory):
    """Where the tutorial tests leave each executed notebook, for the site to show (and
    not execute again): tests/test_site.py builds it from these."""
    return tmp_path_factory.mktemp("executed-notebooks")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel started in a folder of its own with 2 CPU ranks, and a front end that
    answers input requests as JupyterLab's input box does (jupyter_client's stdin
    channel). ``kernel(code, answers)`` runs a cell, answering each input request with the
    next answer ("c" when they run out), and returns (everything the cell showed, the
    prompts it asked, the error name or None); ``messages`` (a list) also gets each output
    message as (type, stream name or display id, text, the display's data);
    ``answer_after_s``: how long each answer takes. ``run.ids`` lists the cells' message ids
    in order, and ``run.elsewhere`` gets (message id, stream name, text) for each stream
    message that came under another cell than the one running."""
    from jupyter_client.manager import start_new_kernel

    folder = tmp_path_factory.mktemp("kernel")
    env = dict(os.environ, IPYTHONDIR=str(folder / "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(folder))

    def run(
        code: str,
        answers=(),
        timeout: float = 120,
        messages: list | None = None,
        answer_after_s: float = 0.0,
    ):
        answers = list(answers)
        messages = [] if messages is None else messages
        msg_id = kc.execute(code, allow_stdin=True)
        run.ids.append(msg_id)
        texts, prompts, error = [], [], None

        def take(msg) -> bool:
            """One output message of the cell's; True once the cell is over."""
            nonlocal error
            c, kind = msg["content"], msg["msg_type"]
            if msg["parent_header"].get("msg_id") != msg_id:
                if kind == "stream":
                    run.elsewhere.append((msg["parent_header"].get("msg_id"), c["name"], c["text"]))
                return False
            if kind == "stream":
                texts.append(c["text"])
                messages.append((kind, c["name"], c["text"], {}))
            elif kind == "error":
                error = c["ename"]
                texts.append(f"{c['ename']}: {c['evalue']}\n")
            elif kind in ("execute_result", "display_data", "update_display_data"):
                plain = c["data"].get("text/plain", "")
                if kind != "update_display_data":
                    texts.append(plain + "\n")
                display_id = c.get("transient", {}).get("display_id")
                messages.append((kind, display_id, plain, c["data"]))
            return kind == "status" and c["execution_state"] == "idle"

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                req = kc.get_stdin_msg(timeout=0.05)
                # what the kernel sent before it asked is on its way on the other channel:
                # taken first, so ``messages`` has the prompt where a person sees it
                while True:
                    try:
                        if take(kc.get_iopub_msg(timeout=0.1)):
                            raise AssertionError("the cell ended while it asked for input")
                    except queue.Empty:
                        break
                prompts.append(req["content"]["prompt"])
                messages.append(("input_request", None, req["content"]["prompt"], {}))
                time.sleep(answer_after_s)  # a person reading the prompt
                kc.input(answers.pop(0) if answers else "c")
            except queue.Empty:
                pass
            try:
                msg = kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if take(msg):
                return "".join(texts), prompts, error
        raise AssertionError(f"no end within {timeout} s: {''.join(texts)[-2000:]}")

    run.ids, run.elsewhere = [], []
    out, _, error = run("%load_ext notebook_dist\n%dist_init -n 2")
    assert error is None, out
    yield run
    run("%dist_shutdown")
    kc.stop_channels()
    km.shutdown_kernel(now=True)


@pytest.fixture
def no_current(ip):
    """Set the session's cluster aside (a test's own cluster does not replace it); restored after."""
    from notebook_dist import session

    saved = session.current()
    session.set_current(None)
    yield
    session.shutdown()
    session.set_current(saved)


# a short DDP run whose value is True on every rank when the replicas ended equal
DDP_IN_SYNC = """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(nd.rank)
for _ in range(5):
    opt.zero_grad()
    model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
    opt.step()
w = model.module.weight.detach().clone()
ws = [torch.zeros_like(w) for _ in range(nd.world_size)]
dist.all_gather(ws, w)
all(torch.equal(ws[0], x) for x in ws)
"""


class SignalSpy:
    """Every signal this process sends while a test runs, checked as it is sent.

    A call is *foreign* when its target is not this process's descendant and not among
    ``allowed`` (processes a cluster recorded as its own: a Slurm job's tasks are
    slurmd's children). A target of 1 or less, or a foreign one, is recorded and never
    passed on, so a regression shows as a failed assertion and harms nothing."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self.foreign: list[tuple[str, int, int]] = []
        self.allowed: set[int] = set()

    def _ours(self, pid: int, group: bool) -> bool:
        if pid <= 1:
            return False
        if pid in self.allowed:
            return True
        me = os.getpid()
        targets = [pid]
        if group:  # every member of the group must be ours
            targets = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == pid] or [pid]
        for target in targets:
            try:
                if target not in self.allowed and me not in [
                    p.pid for p in psutil.Process(target).parents()
                ]:
                    return False
            except psutil.NoSuchProcess:
                continue
        return True

    def check(self, call: str, pid: int, sig: int) -> bool:
        self.calls.append((call, pid, sig))
        if sig == 0 and pid > 1:
            return True  # a probe, not a signal
        if not self._ours(pid, group=call == "killpg"):
            self.foreign.append((call, pid, sig))
            return False
        return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _pidfd_pid(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("Pid:"):
                return int(line.split()[1])
    return -1


@pytest.fixture
def signal_spy(monkeypatch):
    """A :class:`SignalSpy` on ``os.kill``, ``os.killpg`` and ``signal.pidfd_send_signal``."""
    spy = SignalSpy()
    real_kill, real_killpg = os.kill, os.killpg
    real_pidfd = getattr(signal, "pidfd_send_signal", None)

    def kill(pid, sig):
        if spy.check("kill", pid, sig):
            return real_kill(pid, sig)

    def killpg(pgid, sig):
        if spy.check("killpg", pgid, sig):
            return real_killpg(pgid, sig)

    def pidfd_send_signal(fd, sig, *args):
        if spy.check("pidfd", _pidfd_pid(fd), sig):
            return real_pidfd(fd, sig, *args)

    monkeypatch.setattr(os, "kill", kill)
    monkeypatch.setattr(os, "killpg", killpg)
    if real_pidfd is not None:
        monkeypatch.setattr(signal, "pidfd_send_signal", pidfd_send_signal)
    return spy


@pytest.fixture
def bystanders(tmp_path):
    """Processes no cluster started, beside it: a sentinel and the ``mpiexec`` of another
    job (a program of that name, in a session of its own). Yields their Popen objects;
    the test asserts they survive. Ended here, by pid, after."""
    import subprocess

    decoy = tmp_path / "mpiexec"
    shutil.copy("/bin/sleep", decoy)
    procs = [
        subprocess.Popen(["sleep", "600"], start_new_session=True),
        subprocess.Popen([str(decoy), "600"], start_new_session=True),
    ]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


# every rank exits, together: the barrier first, so a rank that a busy machine starts late
# is not interrupted (2 s after the first death) before it reaches its own exit
ALL_RANKS_EXIT = "%%distributed\nimport os\ndist.barrier()\nos._exit(1)"


def every_rank_dies_twice(run, spy, bystanders, then: str = "%dist_shutdown") -> str:
    """Every rank of the session's cluster dies; ``%dist_restart --replay``; every rank of
    the fresh cluster dies; ``then``. Nothing but what each cluster started is signalled
    (``spy``), and the ``bystanders`` (another job's mpiexec) live. What ``then`` printed."""
    from notebook_dist import session

    spy.allowed = {p.pid for p in session.current().processes.started}
    out = run(ALL_RANKS_EXIT)
    assert type(out.error).__name__ == "ClusterError", out.output
    out = run("%dist_restart --replay")
    assert out.error is None, out.output
    assert spy.foreign == [], spy.calls
    spy.allowed |= {p.pid for p in session.current().processes.started}
    out = run(ALL_RANKS_EXIT)
    assert type(out.error).__name__ == "ClusterError", out.output
    out = run(then)
    assert out.error is None, out.output
    assert spy.foreign == [], spy.calls
    assert [p.poll() for p in bystanders] == [None, None], "a bystander (another mpiexec) was hit"
    return out.stdout


@contextlib.contextmanager
def cpu_burners(count: int = 2):
    """``count`` processes that each keep a CPU busy (``while True: pass``), beside what the
    block runs: a user's machine is busy, and a verdict must hold there too. Ended by pid."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()
