"""Two hosts for real: network namespaces with their own addresses on a bridge, each
running Debian's sshd; ipyparallel's SSH launcher starts one engine on each, and
``%dist_init --profile ... --network`` makes them ranks that meet over 10.213.0.0/24.

Needs root (namespaces, a bridge) and openssh-server. CI has both and sets
NOTEBOOK_DIST_REQUIRE_MULTIHOST=1, so there this must run; elsewhere it skips and says why.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import DDP_IN_SYNC, ctrl_c_after, rank_table, wait_until

pytestmark = pytest.mark.slow

SSHD = "/usr/sbin/sshd"
BRIDGE, NET = "ndbr0", "10.213.0"
HOSTS = {"node1": f"{NET}.11", "node2": f"{NET}.12"}


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to make network namespaces and a bridge"
    if not os.path.exists(SSHD):
        return "needs sshd (Debian: apt-get install openssh-server)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    probe = subprocess.run(["ip", "netns", "add", "nd-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "nd-probe"], capture_output=True)
    return None


WHY = _why_not()
if WHY is not None:
    if os.environ.get("NOTEBOOK_DIST_REQUIRE_MULTIHOST") == "1":
        raise RuntimeError(f"NOTEBOOK_DIST_REQUIRE_MULTIHOST=1 but this test cannot run: {WHY}")
    pytest.skip(WHY, allow_module_level=True)


def _private_tmp(spare: Path) -> str:
    """Shell commands (for a new mount namespace) that give it an empty /tmp of its own,
    keeping visible what the engines need from this machine's /tmp: this checkout and
    its Python (a clone in /tmp, as CI may make)."""
    import notebook_dist

    needed = {Path(notebook_dist.__file__).resolve().parents[1], Path(sys.prefix).resolve()}
    needed |= {Path(sys.base_prefix).resolve()}
    keep = sorted({p for p in needed if p.is_relative_to("/tmp")})
    keep = [p for p in keep if not any(p != q and p.is_relative_to(q) for q in keep)]
    spare.mkdir(parents=True, exist_ok=True)
    steps = [f"mount --rbind /tmp {spare}", "mount -t tmpfs -o mode=1777 tmpfs /tmp"]
    for p in keep:
        inside = spare / p.relative_to("/tmp")
        steps += [f"mkdir -p {p}", f"mount --bind {inside} {p}"]
    return " && ".join(steps)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


def _end_all_in(ns: str) -> None:
    """End, by pid, every process left in the network namespace ``ns`` (one of the test's
    hosts, made by the fixture: each of its processes is the fixture's sshd's)."""
    pids = [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: not sh("ip", "netns", "pids", ns, check=False).stdout.split(), 10)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two 'hosts' on a bridge, each a network namespace with its own host name, its own
    /tmp (a tmpfs: what one host writes there the others and the notebook do not see, as
    between real machines) and sshd; the kernel side is 10.213.0.1."""
    tmp = tmp_path_factory.mktemp("hosts")
    key = tmp / "id_ed25519"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    etc = Path(tempfile.mkdtemp(prefix="nd-hosts-", dir="/run"))  # sshd's files, not in /tmp
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(etc / "host_key"))
    (etc / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
    os.chmod(etc / "authorized_keys", 0o600)
    os.makedirs("/run/sshd", exist_ok=True)
    sshds: list[subprocess.Popen] = []
    made: list[str] = []
    sh("ip", "link", "del", BRIDGE, check=False)  # left by a run that was killed
    for i, name in enumerate(HOSTS, 1):
        sh("ip", "netns", "del", f"nd-{name}", check=False)
        sh("ip", "link", "del", f"ndv{i}", check=False)
    try:
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        made.append("bridge")
        sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for i, (name, addr) in enumerate(HOSTS.items(), 1):
            ns = f"nd-{name}"
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "link", "add", f"ndv{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "link", "set", f"ndv{i}", "master", BRIDGE, "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{NET}.1")
            cfg = etc / f"sshd_{name}.conf"
            cfg.write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {etc / 'host_key'}\n"
                f"AuthorizedKeysFile {etc / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile none\n"
                "AcceptEnv *\nPermitUserEnvironment yes\n"
                "Subsystem sftp /usr/lib/openssh/sftp-server\n"
            )
            sshds.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--uts",
                        "--mount",
                        "sh",
                        "-c",
                        f"hostname {name} && {_private_tmp(etc / name)} && "
                        f"exec {SSHD} -D -e -f {cfg}",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=open(tmp / f"sshd_{name}.log", "w"),  # noqa: SIM115
                    start_new_session=True,
                )
            )
        ssh_opts = [
            "-i",
            str(key),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
        ]
        for addr in HOSTS.values():
            if not wait_until(
                lambda addr=addr: (
                    sh("ssh", *ssh_opts, f"root@{addr}", "hostname", check=False).returncode == 0
                ),
                30,
            ):
                raise RuntimeError(f"sshd on {addr} did not answer")
                time.sleep(0.3)

        def exists_on(addr: str, path: str) -> bool:
            return (
                sh("ssh", *ssh_opts, f"root@{addr}", "test", "-e", path, check=False).returncode
                == 0
            )

        yield {"tmp": tmp, "ssh_opts": ssh_opts, "exists_on": exists_on}
    finally:
        for p in sshds:  # each sshd leads its own session: end it and its children
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        # what sshd started for each connection leads a session of its own, so the group's
        # end leaves it: a connection still open (ipyparallel's ssh launcher asks each host
        # in a thread whether its engine still runs) would hold its ssh client for ever.
        # Every process in a host's namespace was started by its sshd, here
        for ns in (m for m in made if m != "bridge"):
            _end_all_in(ns)
        for thing in reversed(made):
            if thing == "bridge":
                sh("ip", "link", "del", BRIDGE, check=False)
            else:
                sh("ip", "netns", "del", thing, check=False)
        shutil.rmtree(etc, ignore_errors=True)


@pytest.fixture
def ssh_cluster(hosts, ip):
    """ipcluster with ipyparallel's SSH launcher: one engine on each host."""
    from IPython.paths import get_ipython_dir

    profile, cluster_id = "ndssh", "m" + uuid.uuid4().hex[:8]
    profile_dir = os.path.join(get_ipython_dir(), f"profile_{profile}")
    os.makedirs(profile_dir, exist_ok=True)
    engines = {f"root@{addr}": 1 for addr in HOSTS.values()}
    remote = hosts["tmp"] / "remote_profile"
    with open(os.path.join(profile_dir, "ipcluster_config.py"), "w") as f:
        f.write(
            f"c.SSHEngineSetLauncher.engines = {engines!r}\n"
            f"c.SSHLauncher.ssh_args = {hosts['ssh_opts']!r}\n"
            f"c.SSHLauncher.scp_args = {['-O', *hosts['ssh_opts']]!r}\n"  # no sftp-server
            f"c.SSHLauncher.remote_python = {sys.executable!r}\n"
            f"c.SSHEngineSetLauncher.remote_profile_dir = {str(remote)!r}\n"
        )
    cmd = [sys.executable, "-m", "ipyparallel.cluster"]
    log = hosts["tmp"] / f"ipcluster-{cluster_id}.log"
    try:  # stopped even when the start fails half way (a daemonized controller is left)
        with open(log, "w") as f:  # not a pipe: the ssh children it leaves would hold it open
            subprocess.run(
                [
                    *cmd,
                    "start",
                    "--profile",
                    profile,
                    "--cluster-id",
                    cluster_id,
                    "--engines",
                    "ssh",
                    "--ip",
                    f"{NET}.1",
                    "-n",
                    "2",
                    "--daemonize",
                ],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
        assert "Leaving cluster running" in log.read_text(), log.read_text()[-3000:]
        import ipyparallel as ipp

        client = ipp.Client(profile=profile, cluster_id=cluster_id, timeout=30)
        wait_until(lambda: len(client.ids) >= 2, 60)  # --daemonize returns before they register
        client.close()
        yield profile, cluster_id
    finally:
        with open(log, "a") as f:
            subprocess.run(
                [*cmd, "stop", "--profile", profile, "--cluster-id", cluster_id],
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=120,
            )


def ranks_on_both_hosts(hosts, each: int):
    """A cluster (the Python API) of ``each`` ranks on each host, started over ssh."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig

    opts = list(hosts["ssh_opts"])
    config = DistConfig(loopback_only=False, ssh={"ssh_args": opts, "scp_args": opts})
    a, b = HOSTS.values()
    return DistCluster(
        launcher="ssh", ssh_hosts={f"root@{a}": each, f"root@{b}": each}, config=config
    ).start()


def test_control_files_on_other_hosts_are_written_and_read_side_by_side():
    """A release or a rebuild's steps wait on ssh once per host: those hosts side by side
    (two remote calls meet at a barrier that one after another never would), this machine's
    in turn, and each call's result or error in the order asked."""
    import threading

    from notebook_dist.cluster.engines import on_hosts

    meet, order = threading.Barrier(2, timeout=20), []

    def remote(el, text):
        meet.wait()
        return f"{el}:{text}"

    def local(el, text):
        order.append(text)
        if text == "bad":
            raise OSError("no such file")
        return text

    done = on_hosts(
        [("node1", remote, "a"), (None, local, "b"), ("node2", remote, "c"), (None, local, "bad")]
    )
    assert done[:3] == ["node1:a", "b", "node2:c"] and order == ["b", "bad"]
    assert isinstance(done[3], OSError) and str(done[3]) == "no such file"


def test_reads_and_writes_are_grouped_by_host_one_call_each():
    """Files on other hosts are read and written with one call for each host: each host's
    call gets its items in the order asked, and each item its own answer back (or its host's
    error)."""
    from types import SimpleNamespace

    from notebook_dist.cluster.engines import per_host

    node1, node2 = SimpleNamespace(location="node1"), SimpleNamespace(location="node2")
    calls = []

    def call(el, parts):
        calls.append((el and el.location, parts))
        if el is node2:
            raise OSError("node2 does not answer")
        return [f"{el and el.location}:{part[0]}" for part in parts]

    items = [(node1, "a"), (None, "b"), (node2, "c"), (node1, "d"), (None, "e"), (node2, "f")]
    done = per_host(items, call)
    assert sorted(calls, key=str) == sorted(
        [("node1", [["a"], ["d"]]), (None, [["b"], ["e"]]), ("node2", [["c"], ["f"]])], key=str
    )
    assert [done[i] for i in (0, 1, 3, 4)] == ["node1:a", "None:b", "node1:d", "None:e"]
    assert all(isinstance(done[i], OSError) for i in (2, 5)), done


def test_two_hosts_meet_over_the_network(ssh_cluster, no_current, run):
    profile, cluster_id = ssh_cluster
    out = run(f"%dist_init --profile {profile} --cluster-id {cluster_id}")
    assert type(out.error).__name__ == "UsageError"
    assert str(out.error).startswith(
        "the engines run on 2 hosts (node1, node2), so the ranks must meet over the network: "
        "add --network to let rank 0's rendezvous store and Gloo listen on 10.213.0.1"
    ), str(out.error)  # .11 or .12: rank 0's address
    out = run(f"%dist_init --profile {profile} --cluster-id {cluster_id} --network")
    assert out.error is None, out.output
    hosts_shown = [ln.split()[1] for ln in rank_table(out.stdout)[1:3]]
    assert sorted(hosts_shown) == ["node1", "node2"]
    out = run(
        "%%distributed\nimport os, socket\nt = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
        "(float(t), socket.gethostname(), os.environ['LOCAL_RANK'], os.environ['GROUP_RANK'], "
        "os.environ['MASTER_ADDR'])"
    )
    assert out.error is None, out.output
    values = dict(out.result.result)
    master = values[0][4]
    assert master in HOSTS.values() and HOSTS[values[0][1]] == master  # rank 0's own address
    assert {v[0] for v in values.values()} == {3.0}
    assert {v[1] for v in values.values()} == {"node1", "node2"}
    assert [v[2] for v in values.values()] == ["0", "0"]  # one rank per host
    assert sorted(v[3] for v in values.values()) == ["0", "1"]
    out = run("%%distributed\n" + DDP_IN_SYNC)
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: True, 1: True}
    listening = run(
        "%%distributed\nimport psutil, os\n"
        "sorted({c.laddr.ip for c in psutil.Process(os.getpid()).net_connections('inet') "
        "if c.status == 'LISTEN'})"
    )
    for rank, addrs in dict(listening.result.result).items():
        assert "0.0.0.0" not in addrs and "::" not in addrs, (rank, addrs)
    out = run("%dist_shutdown")
    assert "the engines keep running" in out.stdout


def test_launcher_ssh_starts_ranks_on_two_hosts(hosts, no_current, run):
    """%dist_init --launcher ssh: ipyparallel's SSH launcher, started by notebook_dist."""
    import shlex

    import psutil

    from notebook_dist import session

    a, b = HOSTS.values()
    line = (
        f"%dist_init --launcher ssh --hosts root@{a}:2,root@{b}:1 "
        f"--ssh {shlex.quote(' '.join(hosts['ssh_opts']))}"
    )
    out = run(line)
    assert type(out.error).__name__ == "UsageError"
    assert "add --network" in str(out.error) and "HMAC-signed" in str(out.error)
    out = run(line + " --network")
    assert out.error is None, out.output
    rows = [ln.split() for ln in rank_table(out.stdout)[1:4]]
    assert [r[1] for r in rows] == ["node1", "node1", "node2"], out.stdout
    cluster = session.current()
    print(f"--launcher ssh: 3 ranks on 2 hosts started in {cluster.startup_s:.1f} s")
    engine_set = cluster.processes.ipp.engines[next(iter(cluster.processes.ipp.engines))]
    remote_dirs = {(el.hostname, el.remote_profile_dir) for el in engine_set.launchers.values()}
    remote_dirs |= {
        (addr, cluster.processes.profile_dir) for addr in (a, b)
    }  # the ranks' control files
    assert len(remote_dirs) == 4
    assert all(hosts["exists_on"](*where) for where in remote_dirs), remote_dirs
    assert not any(os.path.exists(d) for _, d in remote_dirs if d != cluster.processes.profile_dir)

    # the controller listens on the bridge address (and loopback, for its own schedulers),
    # not on every interface
    controller = psutil.Process(cluster.processes.ipp.controller.pid)
    listening = {
        c.laddr.ip
        for p in [controller, *controller.children(recursive=True)]
        for c in p.net_connections("inet")
        if c.status == "LISTEN"
    }
    assert listening == {f"{NET}.1", "127.0.0.1"}, listening
    # and so does the notebook's lane, which the ranks on the hosts reach there
    ours = {c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
    assert f"{NET}.1" in ours and ours <= {f"{NET}.1", "127.0.0.1"}, ours

    out = run(
        "%%distributed\nimport os, socket\nt = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\n"
        "(float(t), socket.gethostname(), os.environ['LOCAL_RANK'], "
        "os.environ['LOCAL_WORLD_SIZE'], os.environ['GROUP_RANK'], os.environ['MASTER_ADDR'], "
        "os.environ['GLOO_SOCKET_IFNAME'], os.getpid())"
    )
    assert out.error is None, out.output
    values = dict(out.result.result)
    assert {v[0] for v in values.values()} == {6.0}
    assert [v[1:5] for v in values.values()] == [
        ("node1", "0", "2", "0"),
        ("node1", "1", "2", "0"),
        ("node2", "0", "1", "1"),
    ]
    assert {v[5] for v in values.values()} == {a}  # rank 0's own address, not 127.0.0.1
    assert {v[6] for v in values.values()} == {"eth0"}
    pids = [v[7] for v in values.values()]
    # what ipyparallel started on the hosts is each rank's witness, the engine its child
    witnesses = [el.pid for el in engine_set.launchers.values()]
    assert [psutil.Process(p).ppid() for p in pids] == witnesses
    pids += witnesses

    out = run("%%distributed\n" + DDP_IN_SYNC)
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: True, 1: True, 2: True}

    # ranks on other hosts left waiting in a collective by a rank that raised are released
    # (their control file is written on their host, over ssh) and keep their state
    t0 = time.monotonic()
    out = run(
        "%%distributed\nx = 7\nif nd.rank == 2:\n    raise ValueError('rank 2 broke')\n"
        "dist.all_reduce(torch.ones(1))"
    )
    took = time.monotonic() - t0
    assert "rank 2 broke" in out.output
    assert "released ranks 0, 1 from collectives that could not complete" in out.output, out.output
    out = run("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\n(x, float(t))")
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: (7, 3.0), 1: (7, 3.0), 2: (7, 3.0)}
    print(f"release over ssh: the failed cell ended in {took:.1f} s")

    # a rank on another host is interrupted through the controller
    run("%%distributed\nkept = nd.rank + 100")
    with ctrl_c_after(3.0):
        out = run(
            "%%distributed --ranks 2\nimport time\nfor _ in range(600):\n    time.sleep(0.05)"
        )
    assert isinstance(out.error, KeyboardInterrupt), out.output
    out = run("%%distributed\nkept")
    assert dict(out.result.result) == {0: 100, 1: 101, 2: 102}

    # a rank on another host that died of a fatal signal: its peers raise and are released
    # before the controller's heartbeat finds it gone; it is named, with the signal and the
    # line its fault file (read there, with its collective's record: one ssh call) names
    out = run(
        "%%distributed\nimport signal\nt = torch.ones(1)\nif nd.rank == 2:\n"
        "    signal.raise_signal(signal.SIGSEGV)\ndist.all_reduce(t)"
    )
    assert type(out.error).__name__ == "ClusterError", out.output
    assert str(out.error).startswith("rank 2 was killed by SIGSEGV at line 5."), str(out.error)
    assert "%dist_heal" not in str(out.error)  # (only engines started here can be healed)

    out = run("%dist_shutdown")
    assert out.error is None, out.output
    wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 15)
    assert not [p for p in pids if psutil.pid_exists(p)], "engines left running on the hosts"
    left = [where for where in remote_dirs if hosts["exists_on"](*where)]
    assert not left, f"folders left on the hosts: {left}"


def test_two_hosts_of_eight_ranks_each(hosts, caplog):
    """2 hosts x 8 ranks (issue "Scale"), each engine a fresh Python started over ssh: the
    ranks in host order, a collective over all 16, their cells by the lane over the
    network (not the controller's queue), the doctor naming the one rank (on the second
    host) that skipped a collective, and nothing left on the hosts."""
    import statistics

    import psutil
    from conftest import until_verdict

    from notebook_dist.errors import ClusterError

    t0 = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="notebook_dist"):
        cluster = ranks_on_both_hosts(hosts, 8)
    started = time.monotonic() - t0
    try:
        # ssh and scp calls (ipyparallel's launchers log each; the watches' aside): a
        # host's first engine checks the host and sends the connection files (8 calls),
        # each other engine is one call. ipyparallel's start made 4 an engine (72 here)
        calls = [
            r
            for r in caplog.records
            if r.msg.startswith(("check_output", "Checking if", "sending", "fetching"))
            and not r.threadName.startswith("wait(")
        ]
        assert len(calls) <= 2 * 10 + 14, len(calls)
        caplog.clear()
        assert [r.host for r in cluster.ranks] == ["node1"] * 8 + ["node2"] * 8
        r = cluster.run("t = torch.ones(1) * (nd.rank + 1)\ndist.all_reduce(t)\nfloat(t)")
        assert set(r.values.values()) == {136.0}  # 1 + 2 + ... + 16
        cells = []
        for _ in range(20):
            t1 = time.perf_counter()
            cluster.run("pass")
            cells.append(time.perf_counter() - t1)
        # the cells took the lane, by the network: each host's own /tmp has none of the
        # notebook's pipes, so every rank is on the express route's socket
        lane = cluster.processes.lane
        assert lane is not None and not lane.refused, "ranks on other hosts are not on the lane"
        assert {cluster.processes.client._engines[r.engine_id] for r in cluster.ranks} <= (
            lane.route.ready
        )
        assert not lane.route.pipes.to, "a rank on another host took a pipe of this machine"
        # every rank at one breakpoint: one prompt, and each line the user types reaches
        # the 16 ranks with one ssh call a host (16 calls one after another before: 6 s a
        # line here)
        caplog.clear()
        said = io.StringIO()
        with caplog.at_level(logging.DEBUG, logger="notebook_dist"):
            r = cluster.run("breakpoint()\ny = 1", out=said, answers=["p nd.rank * 2", "c"])
        r.raise_for_errors()
        said = said.getvalue()
        assert "[ranks 0-15] (Pdb) p nd.rank * 2" in said, said[-3000:]
        assert all(f"[rank {k}] {2 * k}\n" in said for k in range(16)), said[-3000:]
        calls = [
            r
            for r in caplog.records
            if r.msg.startswith("check_output") and not r.threadName.startswith("wait(")
        ]
        assert len(calls) <= 2 * 2 + 2, len(calls)  # 2 lines, 2 hosts
        diag, out, verdict_s, _ = until_verdict(
            cluster, "t = torch.ones(1)\nif nd.rank != 11:\n    dist.all_reduce(t)\n", 3.0, 90
        )
        assert diag is not None, out[-3000:]
        assert diag.kind == "conditional" and diag.culprits == [k for k in range(16) if k != 11]
        assert "but rank 11 finished the cell without calling it" in diag.verdict, diag.verdict
        r = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)")
        assert set(r.values.values()) == {16.0}  # released, and the group rebuilt
        print(
            f"2 hosts x 8 ranks: started in {started:.1f} s, an empty cell "
            f"{statistics.median(cells) * 1e3:.0f} ms, the verdict {verdict_s:.1f} s after "
            "the cell began (hang-after 3 s)"
        )
        # a rank on another host killed from outside (as the OOM killer kills: SIGKILL,
        # no stack left): its witness there wrote its exit status, and the verdict says it
        with pytest.raises(ClusterError) as info:
            cluster.run(
                "import os, signal\nt = torch.ones(1)\nif nd.rank == 12:\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\ndist.all_reduce(t)"
            )
        assert str(info.value).startswith("rank 12 was killed by SIGKILL."), str(info.value)
        # and so it is said from then on, as the verdict read it (no ssh call again)
        assert cluster.dead_ranks() == {12: "was killed by SIGKILL"}
        pids = [r.pid for r in cluster.ranks]
        # the processes ipyparallel started on the hosts: each rank's witness
        witnesses = [el.pid for el in cluster.processes.all_launchers()]
        assert len(witnesses) == 16 and not set(witnesses) & set(pids)
        pids += witnesses
        # each host's engines stopped by one ssh call: ipyparallel's four round trips an
        # engine, one engine after another, ran past the stop's bound and were given up on
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="notebook_dist"):
            cluster.shutdown()
        print(f"the shutdown took {time.monotonic() - t0:.1f} s")
        given_up = [r.getMessage() for r in caplog.records if "did not end within" in r.msg]
        assert not given_up, given_up
    finally:
        cluster.shutdown()
    wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 30)
    assert not [p for p in pids if psutil.pid_exists(p)], "engines left running on the hosts"


def test_ssh_ranks_end_when_their_controller_dies(hosts):
    """A kernel that dies takes its controller with it (the reaper); the engines on the
    hosts, which no local pid reaches, must then end by themselves (heartbeat lost)."""
    import psutil

    from notebook_dist.cluster.engines import REMOTE_HEARTBEAT_MISSES

    cluster = ranks_on_both_hosts(hosts, 1)
    try:
        pids = [r.pid for r in cluster.ranks]
        assert [r.host for r in cluster.ranks] == ["node1", "node2"]
        # a cell busier than the heartbeat allowance does not end them: pings queue up
        r = cluster.run("import time\ntime.sleep(18)\nnd.rank")
        assert not r.errors and dict(r.values) == {0: 0, 1: 1}
        assert dict(cluster.run("nd.rank").values) == {0: 0, 1: 1} and not cluster.dead_ranks()
        # they were told to give up after 15 missed heartbeat checks (ipyparallel: 50)
        flag = f"--IPEngine.max_heartbeat_misses={REMOTE_HEARTBEAT_MISSES}"
        assert all(flag in psutil.Process(p).cmdline() for p in pids)
        os.kill(cluster.processes.ipp.controller.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 90, every_s=0.2)
        took = time.monotonic() - t0
        assert not [p for p in pids if psutil.pid_exists(p)], "engines outlived their controller"
        print(f"engines on the hosts ended {took:.1f} s after their controller")
    finally:
        cluster.shutdown()


def test_after_every_ssh_rank_died_restart_and_shutdown_signal_only_their_own(
    hosts, no_current, run, signal_spy, bystanders
):
    import shlex

    from conftest import every_rank_dies_twice

    from notebook_dist import session

    a, b = HOSTS.values()
    out = run(
        f"%dist_init --launcher ssh --hosts root@{a}:1,root@{b}:1 --network "
        f"--ssh {shlex.quote(' '.join(hosts['ssh_opts']))}"
    )
    assert out.error is None, out.output
    every_rank_dies_twice(run, signal_spy, bystanders)  # restart --replay over ssh, shutdown
    assert session.current() is None


def test_a_host_that_cannot_be_reached_is_named_and_nothing_is_left_on_the_others(hosts):
    """One of the hosts asked for is not there (no machine has its address): the start
    fails within ssh's own bound, says which host, and leaves nothing running on the
    host that was there."""
    from notebook_dist import DistCluster
    from notebook_dist.config import DistConfig
    from notebook_dist.errors import ClusterError

    def engines_on_node1() -> list[int]:
        pids = sh("ip", "netns", "pids", "nd-node1").stdout.split()
        return [int(p) for p in pids if "runtime.engine" in Path(f"/proc/{p}/cmdline").read_text()]

    a, absent = HOSTS["node1"], f"{NET}.99"
    opts = list(hosts["ssh_opts"])
    config = DistConfig(loopback_only=False, ssh={"ssh_args": opts, "scp_args": opts})
    cluster = DistCluster(
        launcher="ssh", ssh_hosts={f"root@{a}": 1, f"root@{absent}": 1}, config=config
    )
    with pytest.raises(ClusterError) as info:
        cluster.start()
    said = str(info.value)
    assert f"could not start the engines on root@{absent} over ssh" in said, said
    assert f"root@{a}" not in said, said
    wait_until(lambda: not engines_on_node1(), 5)
    assert not engines_on_node1(), "an engine was left on the host that was there"
    print(f"a host not there: {said[:120]}")


def test_a_host_that_stops_answering_leaves_no_ssh_behind_the_shutdown(hosts, caplog):
    """A host that goes dark (powered off, its network gone: here its link is down and the
    bridge still sends to its address, so nothing answers, not even a refusal). ipyparallel's
    watch on its engine (an ssh call open to the host) outlasts it without a traceback in
    the notebook; the shutdown ends, and every ssh it or the watches had under way ends
    with it. Before, ssh waited for TCP's own timeouts, 2 minutes for a connection and for
    ever on one that was open, and ipyparallel's clean-up ran again at exit."""
    import threading

    import psutil

    def ssh_children(to: str = "") -> list[int]:
        def to_host(p) -> bool:
            try:
                return p.name() == "ssh" and f"@{to}" in " ".join(p.cmdline())
            except (psutil.Error, OSError):
                return False  # (ended meanwhile)

        return [p.pid for p in psutil.Process().children(recursive=True) if to_host(p)]

    b = HOSTS["node2"]
    cluster = ranks_on_both_hosts(hosts, 1)
    mac = sh("ip", "-n", "nd-node2", "-br", "link", "show", "eth0").stdout.split()[2]
    try:
        assert dict(cluster.run("nd.rank").values) == {0: 0, 1: 1}
        # (ipyparallel's watch, on the process it started there: the rank's witness)
        watch = f"wait(host=root@{b}, pid={cluster.processes.host_launcher(1).pid})"
        assert watch in {t.name for t in threading.enumerate()}
        failed: list[str] = []
        hook = threading.excepthook
        threading.excepthook = lambda args: failed.append(f"{args.thread.name}: {args.exc_value}")
        try:
            open_before = set(ssh_children(b))  # the watch's ssh call under way
            assert open_before
            sh("ip", "neigh", "replace", b, "lladdr", mac, "dev", BRIDGE, "nud", "permanent")
            sh("ip", "-n", "nd-node2", "link", "set", "eth0", "down")
            # ended by ssh's own bound (15 s without an answer)
            wait_until(lambda: not open_before & set(ssh_children(b)), 40)
            assert not open_before & set(ssh_children(b)), "ssh waits on a silent host"
            time.sleep(1)
            assert not failed, failed
            assert watch in {t.name for t in threading.enumerate()}, "the watch ended"
        finally:
            threading.excepthook = hook
        # the stop passes the dark host over: no signal, wait, output or folder asked
        # of it over ssh (each waited out ssh's bound, 10 s, before); the watch's call
        # under way ends by its bound (and one more may have begun as the stop began)
        seen, stopping = set(ssh_children(b)), threading.Event()

        def look():
            while not stopping.wait(0.05):
                seen.update(ssh_children(b))

        looking = threading.Thread(target=look, daemon=True)
        looking.start()
        before = set(seen)
        t0 = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger="notebook_dist"):
            cluster.shutdown()
        took = time.monotonic() - t0
        stopping.set()
        looking.join()
        assert len(seen - before) <= 1, f"the stop asked the dark host: {seen - before}"
        # the watch's ssh to the dark host was ended by the stop, which waited for it to
        # reach ssh's own bound before (10-15 s of the shutdown's time)
        ended = [r.getMessage() for r in caplog.records if "ssh calls to hosts not" in r.msg]
        assert ended and ended[0].startswith("ended "), ended
        left = ssh_children()
        assert not left, f"ssh still running as the shutdown returned: {left}"
        watching = [t.name for t in threading.enumerate() if t.name.startswith("wait(host=")]
        assert not watching, f"ipyparallel still watches engines over ssh: {watching}"
        assert not cluster.processes.ipp.shutdown_atexit  # (it would ask the hosts again)
        print(f"a host gone dark: the shutdown took {took:.1f} s, ssh left at its end {left}")
    finally:
        cluster.shutdown()  # (once only: a second call finds it stopped)
        sh("ip", "neigh", "del", b, "dev", BRIDGE, check=False)
        sh("ip", "-n", "nd-node2", "link", "set", "eth0", "up", check=False)
