"""Local engines forked from one process that imported torch once (runtime/forkserver.py,
cluster/forks.py): the ranks are that process's children in sessions of their own, each
rank's end is reported with its exit code or signal, nothing outlives the cluster, and
the server starts engines only. A cluster without the server starts each engine itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import pids_alive, wait_until

pytestmark = pytest.mark.slow

WHO = "import os, sys\n(os.getppid(), os.getsid(0) == os.getpid(), 'torch' in sys.modules, os.environ.get('ND_TEST_MARK'))"


def test_ranks_are_forked_from_one_server_and_nothing_outlives_the_cluster(monkeypatch):
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.signals import is_running

    monkeypatch.setenv("ND_TEST_MARK", "from the kernel")
    with DistCluster(n=3, config=DistConfig(spare_engines=0)) as c:
        server = c.processes.forks
        assert server is not None
        records = [p for p in c.processes.started if p.what == "fork server"]
        assert [p.pid for p in records] == [server.pid] and is_running(records[0])
        r = c.run(WHO)
        assert not r.errors
        # the server's children, each leading a session of its own (as ipyparallel starts
        # an engine), torch already there, the kernel's environment as it was at the fork
        assert dict(r.values) == {k: (server.pid, True, True, "from the kernel") for k in range(3)}
        assert all(c.processes.rank_procs[k].leads_group for k in range(3))
        # the server kept debugpy out of its imports (ipykernel's Jupyter debugger, which
        # no engine serves), not out of reach: a cell imports it
        r = c.run("was = 'debugpy' in sys.modules\nimport debugpy\n(was, debugpy.__name__)")
        assert not r.errors and dict(r.values) == {k: (False, "debugpy") for k in range(3)}
        # what the server worked out for its engines served them, and left ipykernel,
        # IPython and ipyparallel as they were: the kernel's list of module files, of use
        # only to ipykernel's debugger, which needs debugpy, is empty; the shell's modules
        # at its start (what ``%reset -a`` keeps) are the engine's modules then, the server's
        # and those it imported itself; its SQLite history is not made (a rank's cells are
        # not the shell's); the engine's settings are its command line's
        r = c.run(
            "import ipykernel.ipkernel as ik, IPython.core.shellapp as sa\n"
            "from ipyparallel.engine.app import IPEngine\n"
            "from IPython import get_ipython\n"
            "shell, app = get_ipython(), IPEngine.instance()\n"
            "(shell.kernel._kernel_modules, shell.history_manager.enabled, "
            "shell._sys_modules_keys <= set(sys.modules), "
            "{'notebook_dist.runtime.engine', 'IPython.core.shellapp', 'torch'} "
            "<= shell._sys_modules_keys, "
            "ik.sys is sys and sa.sys is sys, ik.IPythonKernel.__init__.__name__, "
            "sa.InteractiveShellApp.init_code.__name__, "
            "'parse_command_line' in IPEngine.__dict__, app.config.IPEngine.enable_nanny, "
            "app.config.IPEngine.out_stream_factory)"
        )
        assert not r.errors and dict(r.values) == {
            k: (
                [],
                False,
                True,
                True,
                True,
                "__init__",
                "init_code",
                False,
                False,
                "notebook_dist.runtime.outstream.RankOutStream",
            )
            for k in range(3)
        }, r.values
        pids = [rk.pid for rk in c.ranks] + [server.pid]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


FIRST_OPTIMIZER = (
    "import sys\nwas = 'torch._dynamo' in sys.modules\nbefore = len(sys.modules)\n"
    "opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
    "(was, len(sys.modules) - before)"
)


PREPARED = """
import sys
from ipyparallel.engine.app import IPEngine
from notebook_dist.runtime import engine, forkserver

argv = ["--IPEngine.enable_nanny=False", "--IPEngine.wait_for_url_file=60",
        "--profile-dir=/nowhere", "--cluster-id=abc", "--log-level=20"]
args = engine.engine_args(argv)
itself = IPEngine()
itself.parse_command_line(args)
prepared = forkserver.prepared_for([sys.executable, "-m", forkserver.ENGINE_MODULE, *argv])
engine.command_line_parsed(prepared.args, prepared.parsed)
create_loader = IPEngine._create_loader
IPEngine._create_loader = None  # (the parser is not made again: calling it would fail)
app = IPEngine()
app.parse_command_line(args)
IPEngine._create_loader = create_loader
other = IPEngine()
other.parse_command_line(["--cluster-id=xyz"])
count = len(sys.modules)
import nd_imported_later
print(repr((
    app.config == itself.config, app.cli_config == itself.cli_config,
    app.extra_args == itself.extra_args, app.argv == itself.argv, app.argv == args,
    "parse_command_line" in IPEngine.__dict__, other.config.IPEngine.cluster_id,
    forkserver.prepared_for([sys.executable, "-m", forkserver.ENGINE_MODULE, "--no-such"]).parsed,
    engine.imported_since(count), "nd_imported_later" in prepared.names,
    len(prepared.names) == prepared.count,
)))
# a part that does not fit (here: an IPython whose shellapp has no ``sys``) is left out,
# the others taken
import ipykernel.ipkernel as ik, IPython.core.shellapp as sa
real_sys = sa.sys
del sa.sys
engine.take(prepared)
sa.sys = real_sys
print(repr((ik.IPythonKernel.__init__.__name__, sa.InteractiveShellApp.init_code.__name__)))
forkserver.later_imports()  # (torch._dynamo's lookups, cached as it is imported, cleared)
import torch
from IPython.utils.PyColorize import theme_table
forkserver.shell_colours()  # (the shell's colours, read from their file once)
print(torch._dynamo.trace_rules.get_torch_obj_rule_map.cache_info().currsize,
      list(getattr(theme_table, "_by_name", {"neutral": 0})))
"""


def test_what_the_server_works_out_once_is_what_each_engine_would_have(tmp_path):
    """What the fork server works out for every engine it forks (``engine.Prepared``), each
    engine then takes as it starts: its command line parses to the very settings it would
    have parsed to itself, without parsing it again, only when it is the command line the
    server parsed, and only once; a command line that does not parse is left to the engine; the modules an engine
    imports after the fork are read from the end of ``sys.modules``."""
    (tmp_path / "nd_imported_later.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-c", PREPARED],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    *_, said, parts, cached = out.stdout.strip().splitlines()
    assert parts == repr(("once", "init_code")) and cached == "0 ['neutral']"
    assert said == repr(
        (True, True, True, True, True, False, "xyz", None, ["nd_imported_later"], False, True)
    ), out.stdout


@pytest.mark.parametrize("preload", [True, False])
def test_ranks_forked_after_the_servers_preload_share_what_a_first_optimizer_loads(preload):
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(spare_engines=0, preload_ranks=preload)) as c:
        r = c.run(FIRST_OPTIMIZER)
        assert not r.errors
        for was, loaded in r.values.values():
            # torch._dynamo and its ~800 modules: loaded once in the server, or by each rank
            assert (was, loaded < 20) == (preload, preload), r.values


def test_ranks_are_preloaded_by_default_when_they_outnumber_the_cores(monkeypatch):
    from notebook_dist.config import DistConfig

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert [DistConfig().preloads(n) for n in (1, 4, 5, 32)] == [False, False, True, True]
    assert DistConfig(preload_ranks=True).preloads(1) and not DistConfig(
        preload_ranks=False
    ).preloads(32)
    # %dist_init --preload on/off/auto, without starting anything
    from notebook_dist.errors import PreflightError
    from notebook_dist.request import ClusterRequest

    for said, field in (("on", True), ("off", False), ("auto", None)):
        assert ClusterRequest(n=2, preload=said).cluster().config.preload_ranks is field
    with pytest.raises(PreflightError, match="--preload yes: give auto, on or off"):
        ClusterRequest(n=2, preload="yes").check()


@pytest.mark.parametrize(
    "how, said", [("os._exit(7)", "exited with code 7"), ("os.kill(os.getpid(), 9)", "SIGKILL")]
)
def test_a_forked_rank_ends_with_its_exit_code_or_signal(how, said):
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        try:
            c.run(f"import os\nif nd.rank == 1:\n    {how}\n")
        except ClusterError:
            pass
        assert wait_until(lambda: 1 in c.dead_ranks(), 10)
        assert said in c.dead_ranks()[1], c.dead_ranks()
        assert 0 not in c.dead_ranks()


def test_ranks_outlive_a_killed_fork_server_and_still_end_with_the_cluster():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError
    from notebook_dist.signals import send

    with DistCluster(n=2, config=DistConfig(spare_engines=0)) as c:
        server = c.processes.forks
        record = next(p for p in c.processes.started if p.what == "fork server")
        assert send(record, 9)
        assert wait_until(lambda: server.gone, 10)
        r = c.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        assert dict(r.values) == {0: 2.0, 1: 2.0} and c.dead_ranks() == {}
        # a dead rank is then healed by an engine started as ipyparallel starts one
        try:
            c.run("import os\nif nd.rank == 1:\n    os._exit(1)\n")
        except ClusterError:
            pass
        assert wait_until(lambda: 1 in c.dead_ranks(), 10)
        c.heal()
        r = c.run("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n(float(t), os.getppid())")
        assert dict(r.values)[1] == (2.0, os.getpid())
        pids = [rk.pid for rk in c.ranks]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


def test_without_the_fork_server_each_engine_is_started_by_the_kernel():
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    with DistCluster(n=2, config=DistConfig(fork_engines=False, spare_engines=0)) as c:
        assert c.processes.forks is None
        r = c.run(WHO)
        assert {v[0] for v in r.values.values()} == {os.getpid()}


def test_the_fork_server_starts_engines_only_and_ends_when_its_input_closes(tmp_path):
    """The server process itself, spoken to as the kernel speaks to it: ready once it has
    imported, a request for anything but the engine refused with the reason, and its end
    when its stdin closes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen(
        [sys.executable, "-m", "notebook_dist.runtime.forkserver"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        ready = json.loads(server.stdout.readline())
        assert ready == {"ready": server.pid}
        request = {
            "fork": 1,
            "argv": [sys.executable, "-c", "print('not an engine')"],
            "env": env,
            "cwd": str(tmp_path),
            "out": str(tmp_path / "out.log"),
        }
        server.stdin.write((json.dumps(request) + "\n").encode())
        server.stdin.flush()
        answer = json.loads(server.stdout.readline())
        assert answer["forked"] == 1 and "starts engines only" in answer["error"]
        server.stdin.close()
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdin.close()
        server.stdout.close()


def files_and_ranks(c) -> tuple[str, list[int]]:
    return c.processes.profile_dir, [r.pid for r in c.ranks]


def forked_before_the_controller_was_ready(profile_dir: str, pids: list[int]) -> bool:
    """Whether the first engine of the cluster in ``profile_dir``, whose ranks are
    ``pids``, was forked before its controller wrote the file engines connect by (a
    process's start is read in clock ticks after boot)."""
    import glob
    import time

    from notebook_dist.signals import start_time

    [path] = glob.glob(os.path.join(profile_dir, "security", "*-engine.json"))
    after_boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    forked = min(int(start_time(pid)) for pid in pids) / os.sysconf("SC_CLK_TCK")
    return forked + after_boot < os.path.getmtime(path)


def test_a_server_started_ahead_is_taken_by_the_first_cluster_of_its_environment():
    """``%load_ext`` starts the fork server ahead: the next cluster's ranks are its
    children, its log joins the cluster's, and it ends with the cluster."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster.processes import fork_ahead
    from notebook_dist.config import DistConfig

    config = DistConfig(spare_engines=0)
    server = fork_ahead(config)
    assert fork_ahead(config) is server  # one at a time
    first_log = server.log_file
    server.wait_ready(120)
    with DistCluster(n=2, config=config) as c:
        assert c.processes.forks is server
        assert {v[0] for v in c.run(WHO).values.values()} == {server.pid}
        # (ready, it forks the engines while the controller starts, not after the client
        # connected to it, and they wait for its file)
        assert forked_before_the_controller_was_ready(*files_and_ranks(c))
        assert server.log_file.startswith(c.processes.profile_dir) and os.path.exists(
            server.log_file
        )
        assert not os.path.exists(os.path.dirname(first_log))
        pids = [rk.pid for rk in c.ranks] + [server.pid]
    assert wait_until(lambda: not pids_alive(pids), 10), pids_alive(pids)


@pytest.mark.parametrize("waited", [True, False])
def test_a_server_started_ahead_loads_what_ranks_load_later_while_it_waits(waited):
    """A server started ahead that waits (the user reads on after ``%load_ext``) loads what
    a first optimizer needs by itself, so the next cluster's ranks share it whatever their
    number; one taken by a cluster at once (a notebook run as a whole) loads nothing by
    itself, and the cluster decides (2 ranks on 2 cores or more: nothing)."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster.processes import fork_ahead
    from notebook_dist.config import DistConfig

    config = DistConfig(spare_engines=0, preload_ranks=None if waited else False)
    server = fork_ahead(config)
    if waited:
        assert server.idle_preloaded.wait(120), "the waiting server did not load by itself"
    with DistCluster(n=2, config=config) as c:
        assert c.processes.forks is server
        # (still importing torch, it forks them once the client has connected, as a server
        # started with the cluster does: the client's own start is not held up by the forks)
        assert forked_before_the_controller_was_ready(*files_and_ranks(c)) == waited
        r = c.run(FIRST_OPTIMIZER)
        assert not r.errors
        for was, loaded in r.values.values():
            assert (was, loaded < 20) == (waited, waited), r.values
    assert server.idle_preloaded.is_set() == waited


@pytest.mark.parametrize("change", ["environment", "fresh engines"])
def test_a_server_started_ahead_that_does_not_fit_is_ended_at_once(monkeypatch, change):
    """A server started ahead in another environment (a variable set since) is ended,
    even while it still imports torch, and the cluster starts its own; so is one that a
    cluster of fresh engines would never use."""
    from notebook_dist import DistCluster
    from notebook_dist.cluster.processes import fork_ahead
    from notebook_dist.config import DistConfig

    server = fork_ahead(DistConfig(spare_engines=0))
    folder = os.path.dirname(server.log_file)
    config = DistConfig(spare_engines=0, fork_engines=change != "fresh engines")
    if change == "environment":
        monkeypatch.setenv("ND_TEST_MARK", "set after the extension loaded")
    with DistCluster(n=2, config=config) as c:
        assert not pids_alive([server.pid]) and not os.path.exists(folder)
        assert c.processes.forks is not server
        marks = {v[3] for v in c.run(WHO).values.values()}
        assert marks == {"set after the extension loaded" if change == "environment" else None}


def test_a_kernel_killed_before_a_cluster_took_its_server_leaves_no_folder():
    """A process that started the fork server ahead (``%load_ext``) and is killed before
    any cluster takes it (no ``atexit`` runs): the server ends as its input closes, and
    the folder of its log goes with it."""
    import signal
    import subprocess
    import sys

    kernel = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom notebook_dist.cluster.processes import fork_ahead\n"
            "from notebook_dist.config import DistConfig\n"
            "s = fork_ahead(DistConfig())\n"
            "print(s.pid, s.log_file, flush=True)\ntime.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, log = kernel.stdout.readline().split()
        folder = os.path.dirname(log)
        assert os.path.isdir(folder)
    finally:
        kernel.send_signal(signal.SIGKILL)  # (the process this test started)
        kernel.wait()
    assert wait_until(lambda: not pids_alive([int(pid)]), 120), "the server outlived its kernel"
    assert wait_until(lambda: not os.path.exists(folder), 10), os.listdir(folder)


def test_loading_the_extension_starts_the_fork_server_the_next_cell_takes(tmp_path):
    """In a real kernel, in an empty folder: ``%load_ext notebook_dist`` in one cell, then
    ``%dist_init`` in the next uses the server the first started; nothing is left once
    the kernel is shut down. Loading the extension starts the server before it imports
    ipyparallel (for the next cell): the server's import of torch is not held up by it."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    printed: list[str] = []

    def cell(code: str) -> str:
        printed.clear()

        def hook(msg):
            if msg["msg_type"] == "stream":
                printed.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                printed.append(msg["content"]["ename"] + ": " + msg["content"]["evalue"])

        reply = kc.execute_interactive(code, output_hook=hook, timeout=120)
        assert reply["content"]["status"] == "ok", "".join(printed)
        return "".join(printed)

    try:
        # the server is started before anything imports ipyparallel (0.3 s here): asked
        # of the first import of ipyparallel as it happens
        cell(
            "import sys\nipp_before = 'ipyparallel' in sys.modules\n"
            "class FirstImport:\n"
            "    server_started = None\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'ipyparallel' and FirstImport.server_started is None:\n"
            "            forks = sys.modules.get('notebook_dist.cluster.forks')\n"
            "            FirstImport.server_started = getattr(forks, '_AHEAD', None) is not None\n"
            "sys.meta_path.insert(0, FirstImport())"
        )
        cell("%load_ext notebook_dist")
        said = cell("print(ipp_before, 'ipyparallel' in sys.modules, FirstImport.server_started)")
        assert said == "False True True\n"
        ahead = int(cell("from notebook_dist.cluster import forks\nprint(forks._AHEAD.pid)"))
        # the user reads on: the server loads by itself, and then forks the next cell's
        # engines while its controller starts
        assert cell("print(forks._AHEAD.idle_preloaded.wait(120))") == "True\n"
        cell("%dist_init -n 2")
        said = cell(
            "from notebook_dist.session import SESSION\nc = SESSION.current()\n"
            "print(c.processes.profile_dir, c.processes.forks.pid, *[r.pid for r in c.ranks])"
        )
        profile_dir, server, *ranks = said.split()
        server, ranks = int(server), [int(pid) for pid in ranks]
        assert server == ahead
        assert forked_before_the_controller_was_ready(profile_dir, ranks)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert wait_until(lambda: not pids_alive([server, *ranks]), 15)


def test_a_script_that_imports_notebook_dist_starts_the_fork_server_first():
    """``from notebook_dist import DistCluster`` imports neither ipyparallel nor torch, and
    ``start()`` starts the fork server before it imports ipyparallel: torch's import in
    the server begins at once (a plain script's start is its longest wait)."""
    script = (
        "import sys\nfrom notebook_dist import DistCluster\n"
        "print(sorted(m for m in ('ipyparallel', 'torch') if m in sys.modules))\n"
        "from notebook_dist.cluster import processes\nreal = processes.ipp_cluster\n"
        "def ipp_cluster(p, *args):\n"
        "    from notebook_dist.cluster import forks\n"
        "    print('server first:', bool(forks._SERVERS), 'ipyparallel' in sys.modules)\n"
        "    return real(p, *args)\n"
        "processes.ipp_cluster = ipp_cluster\n"
        "with DistCluster(n=2) as c:\n    print(dict(c.run('nd.rank').values))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[]", "server first: True False", "{0: 0, 1: 1}"]


@pytest.mark.parametrize("idle_preload_s", [60.0, 0.0])
def test_a_server_taken_while_it_may_load_by_itself_forks_after_the_client(
    tmp_path, idle_preload_s
):
    """A server started ahead forks a cluster's engines at once only when nothing queues
    before the forks: not while it may have begun to load what ranks load later by itself
    (it was ready longer than its ``--preload-when-idle``), and not when the cluster wants
    that load and it has not made it."""
    from notebook_dist.cluster.forks import ForkServer

    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = ForkServer(sys.executable, env, str(tmp_path / "forks.log"), 120, idle_preload_s)
    try:
        server.wait_ready(120)
        server.taken()
        assert server.forks_now(preload=False) == (idle_preload_s > 0)
        assert not server.forks_now(preload=True)
    finally:
        server.close()
    assert wait_until(lambda: not pids_alive([server.pid]), 10)


def test_an_engine_started_before_its_controller_takes_the_file_once_it_is_whole(tmp_path):
    """An engine forked while its controller starts looks for the controller's connection
    file more often than ipyparallel's engine (every 0.1 s), takes it only once it reads as
    whole JSON, and past ``wait_for_url_file`` goes on to ipyparallel's own check, which
    says that it never arrived."""
    import threading
    import time
    from types import SimpleNamespace

    from notebook_dist.runtime.engine import controller_file_sooner

    seen = []

    class IPEngine:
        connection_info_env = ""
        url_file = ""

        def __init__(self, url_file, wait_s):
            self.path, self.wait_for_url_file = url_file, wait_s

        def find_connection_file(self):
            self.url_file = self.path

        def init_engine(self):
            seen.append(open(self.url_file).read() if os.path.exists(self.url_file) else None)

    app = SimpleNamespace(IPEngine=IPEngine)
    controller_file_sooner(app)
    path = tmp_path / "ipcontroller-engine.json"

    def controller():
        time.sleep(0.2)
        path.write_text('{"interface": ')  # (as if caught in the middle of its writing)
        time.sleep(0.2)
        path.write_text('{"interface": "tcp://127.0.0.1"}')

    writer = threading.Thread(target=controller)
    writer.start()
    app.IPEngine(str(path), 30).init_engine()
    writer.join()
    assert seen == ['{"interface": "tcp://127.0.0.1"}']
    app.IPEngine(str(tmp_path / "never.json"), 0.05).init_engine()
    assert seen[-1] is None
