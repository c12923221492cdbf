"""Two hosts for real: network namespaces with their own addresses on a bridge, each
running Debian's sshd; ipyparallel's SSH launcher starts one engine on each, and
``%dist_init --profile ... --network`` makes them ranks that meet over 10.213.0.0/24.

Needs root (namespaces, a bridge) and openssh-server. CI has both and sets
NOTEBOOK_DIST_REQUIRE_MULTIHOST=1, so there this must run; elsewhere it skips and says why.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from conftest import DDP_IN_SYNC

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


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=60)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Two 'hosts' (netns + own UTS name + sshd) on a bridge; the kernel side is 10.213.0.1."""
    tmp = tmp_path_factory.mktemp("hosts")
    key = tmp / "id_ed25519"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key"))
    (tmp / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
    os.chmod(tmp / "authorized_keys", 0o600)
    os.makedirs("/run/sshd", exist_ok=True)
    sshds: list[subprocess.Popen] = []
    made: list[str] = []
    sh("ip", "link", "del", BRIDGE, check=False)  # left by a run that was killed
    for name in HOSTS:
        sh("ip", "netns", "del", f"nd-{name}", check=False)
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
            cfg = tmp / f"sshd_{name}.conf"
            cfg.write_text(
                f"ListenAddress {addr}\nPort 22\nHostKey {tmp / 'host_key'}\n"
                f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile none\n"
                "AcceptEnv *\nPermitUserEnvironment yes\n"
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
                        "sh",
                        "-c",
                        f"hostname {name} && exec {SSHD} -D -e -f {cfg}",
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
        deadline = time.monotonic() + 30
        for addr in HOSTS.values():
            while True:
                r = sh("ssh", *ssh_opts, f"root@{addr}", "hostname", check=False)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {addr} did not answer: {r.stderr}")
                time.sleep(0.3)
        yield {"tmp": tmp, "ssh_opts": ssh_opts}
    finally:
        for p in sshds:  # each sshd leads its own session: end it and its children
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        for thing in reversed(made):
            if thing == "bridge":
                sh("ip", "link", "del", BRIDGE, check=False)
            else:
                sh("ip", "netns", "del", thing, check=False)


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
    deadline = time.monotonic() + 60  # --daemonize returns before the engines register
    while len(client.ids) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    client.close()
    yield profile, cluster_id
    with open(log, "a") as f:
        subprocess.run(
            [*cmd, "stop", "--profile", profile, "--cluster-id", cluster_id],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=120,
        )


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
    hosts_shown = [ln.split()[1] for ln in out.stdout.strip().splitlines()[1:3]]
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
