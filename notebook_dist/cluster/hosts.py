"""The hosts of ``--launcher ssh``: ``--hosts`` read as Open MPI's ``--host`` is, ranks
spread over them, and this machine's address towards them."""

from __future__ import annotations

import os

from ..errors import PreflightError


def ssh_options(text: str) -> list[str]:
    """``--ssh "-i key -o Port=2222"`` as ssh's arguments."""
    from ..cmdline import split_quoted

    try:
        return split_quoted(text)
    except ValueError as exc:
        raise PreflightError(f"--ssh {text!r}: {exc}") from None


def parse_hosts(spec: str) -> dict[str, int | None]:
    """``"node1,node2:2,me@node3"`` -> engines per ssh destination (None: not given), as
    Open MPI's ``--host`` writes slots. A port goes in ssh's own settings
    (``--ssh "-o Port=2222"`` or ~/.ssh/config), which scp reads as well."""
    hosts: dict[str, int | None] = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, count = item.rpartition(":")
        if not sep:
            name = item
        if not name or any(c.isspace() for c in name) or name.startswith("-"):
            raise PreflightError(
                f"--hosts: {item!r} is not an ssh destination like node1 or me@node1"
            )
        if sep and (not count.isdigit() or int(count) < 1):
            raise PreflightError(
                f"--hosts: {item!r}: after ':' give how many ranks that host runs, e.g. node1:2"
            )
        if name in hosts:
            raise PreflightError(
                f"--hosts lists {name} twice: give it once, with a count (node1:2)"
            )
        hosts[name] = int(count) if sep else None
    return hosts


def spread_over_hosts(hosts: dict[str, int | None], n: int | None) -> dict[str, int]:
    """Engines per host: the counts given, else ``n`` spread evenly (first hosts get the
    extra ones), else one per host."""
    if not hosts:
        raise PreflightError(
            "--launcher ssh needs --hosts, the machines to start ranks on, e.g. "
            "--hosts node1,node2 (one rank each) or --hosts node1:2,node2:2"
        )
    if n is not None and n < 1:
        raise PreflightError(f"-n {n}: a cluster needs at least one rank")
    given = {h: c for h, c in hosts.items() if c is not None}
    if given and len(given) != len(hosts):
        raise PreflightError("--hosts: give a count for every host or for none (node1:2,node2:2)")
    if given:
        total = sum(given.values())
        if n is not None and n != total:
            raise PreflightError(f"-n {n} asked, but --hosts adds up to {total} ranks")
        return dict(given)
    if n is None:
        return {h: 1 for h in hosts}
    if n < len(hosts):
        raise PreflightError(f"-n {n} is fewer ranks than the {len(hosts)} hosts given")
    per, extra = divmod(n, len(hosts))
    return {h: per + (i < extra) for i, h in enumerate(hosts)}


def ssh_settings(hosts: dict[str, int], config, profile_dir: str) -> dict:
    """RankSSHEngineSetLauncher settings: the hosts, the engines' Python, and a profile
    folder of their own on each host (in /tmp: on a shared filesystem it must not be
    the notebook's own, which scp would overwrite with itself); ``config.ssh`` last."""
    settings = {
        "engines": dict(hosts),
        "remote_python": config.python,
        "remote_profile_dir": f"/tmp/{os.path.basename(profile_dir)}-remote",
        "delay": 0.0,
    }
    settings.update(config.ssh)
    for key in ("ssh_args", "scp_args"):  # after the user's: ssh takes an option's first value
        settings[key] = [*settings.get(key, ()), *SSH_BOUNDS]
    return settings


#: ssh's own waits, bounded: a host that stops answering (powered off, its network gone)
#: fails a new connection within ConnectTimeout, and ends an open one within
#: ServerAliveInterval x ServerAliveCountMax (15 s), where TCP alone waits 2 minutes for a
#: connection and for ever on one that is open (ipyparallel asks each host over ssh,
#: again and again, whether its engine still runs). A shutdown then ends, and no ssh
#: outlives it. ``--ssh "-o ConnectTimeout=60"`` sets another (these come before
#: ~/.ssh/config, as any option given to ssh does)
SSH_BOUNDS = (
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
)


def ssh_destination_address(destination: str, ssh_args: list[str]) -> str:
    """The address ssh connects to for ``destination`` (``user@host``; aliases in
    ~/.ssh/config are followed with ``ssh -G``)."""
    import socket
    import subprocess

    host = destination.rpartition("@")[2]
    try:
        shown = subprocess.run(
            ["ssh", *ssh_args, "-G", destination],
            capture_output=True,
            text=True,
            timeout=30,
            stdin=subprocess.DEVNULL,
        ).stdout
        host = next(
            (ln.split(None, 1)[1] for ln in shown.splitlines() if ln.startswith("hostname ")), host
        )
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return socket.getaddrinfo(host, 22, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError as exc:
        raise PreflightError(f"--hosts: cannot find the address of {host}: {exc}") from None


def address_towards(destination: str, config) -> str:
    """This machine's address on the route to ``destination``: the one address the
    controller listens on, so the hosts reach it and nothing else does."""
    import socket

    target = ssh_destination_address(destination, list(config.ssh.get("ssh_args", [])))
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 22))  # (no packet is sent: this only picks the route)
        return s.getsockname()[0]
