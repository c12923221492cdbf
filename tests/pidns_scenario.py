"""Scenarios that end every rank, run in one notebook kernel as pid 1 of a fresh PID namespace.

``unshare --pid --fork --mount-proc python pidns_scenario.py HOW:THEN [HOW:THEN ...]``:
this process is init of the namespace, so a signal sent to pid -1 from inside (every
process the sender may signal) reaches every other process of the namespace and nothing
outside it. Beside the notebook kernel runs a sentinel that nothing may signal; it is
checked after each step. Prints one JSON object: what each step of each scenario printed,
and whether the sentinel and the kernel lived.

HOW ends every rank: ``os_exit`` (``os._exit(1)``), ``sigkill``, or ``exit`` and
``sys_exit`` (which must end the cell, not the rank). THEN: ``shutdown``, ``restart``,
``replay`` (``%dist_restart --replay``), ``kernel_shutdown`` (the kernel ends without
either) or ``kernel_kill`` (the kernel is SIGKILLed: the reaper ends the cluster); a
``kernel_*`` scenario comes last. The scenarios share the kernel (each cluster start costs
seconds): one after a restart goes on with the restarted ranks, one after a shutdown starts
a cluster; the last one's cluster is shut down (its ``shutdown`` step) unless the kernel ended.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

#: (every rank meets the others before it ends itself: a rank that is late to the cell on a
#: busy machine is otherwise interrupted, 2 s after the first one died, before it ends)
ENDINGS = {
    "os_exit": "dist.barrier()\nimport os\nos._exit(1)",
    "sigkill": "dist.barrier()\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "exit": "print('before')\nexit()\nprint('after')",
    "sys_exit": "import sys\nprint('before')\nsys.exit(3)\nprint('after')",
}


def main(scenarios: list[tuple[str, str]]) -> dict:
    report: dict = {"scenarios": []}
    sentinel = subprocess.Popen(["sleep", "600"], start_new_session=True)
    folder = tempfile.mkdtemp(prefix="nd-pidns-")
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, IPYTHONDIR=os.path.join(folder, "ipython"))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=folder)
    steps: list[dict] = []

    def step(name: str, code: str, timeout: float = 120.0) -> None:
        texts: list[str] = []

        def hook(msg):
            c = msg["content"]
            if msg["msg_type"] == "stream":
                texts.append(c["text"])
            elif msg["msg_type"] == "error":
                texts.append(f"{c['ename']}: {c['evalue']}\n")
            elif msg["msg_type"] in ("display_data", "execute_result"):
                texts.append(c["data"].get("text/plain", "") + "\n")

        try:
            kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        except Exception as exc:  # a kernel that was killed does not answer
            texts.append(f"no reply: {type(exc).__name__}")
        steps.append({"step": name, "text": "".join(texts), "sentinel": sentinel.poll() is None})

    running = False  # a cluster is up
    try:
        for i, (how, then) in enumerate(scenarios):
            steps = []
            report["scenarios"].append({"how": how, "then": then, "steps": steps})
            if not running:
                step(
                    "init",
                    ("%load_ext notebook_dist\n" if i == 0 else "") + "%dist_init -n 2\nx = 1",
                )
            step("setup", "%%distributed\nkept = nd.rank + 10")
            step("end ranks", "%%distributed\n" + ENDINGS[how])
            time.sleep(1.0)  # the engines' exits are seen
            step("next cell", "%%distributed\nkept")
            step("status", "%dist_status")
            running = True
            if then == "shutdown":
                step(then, "%dist_shutdown")
                running = False
            elif then in ("restart", "replay"):
                step(then, "%dist_restart" + (" --replay" if then == "replay" else ""))
                step(
                    "after restart", "%%distributed\n" + ("kept" if then == "replay" else "nd.rank")
                )
            elif then == "kernel_shutdown":
                km.shutdown_kernel(now=False)
                running = False
            elif then == "kernel_kill":
                km.provisioner.process.kill()  # SIGKILL: no atexit runs, only the reaper
                km.provisioner.process.wait()
                running = False
        if running:
            step("shutdown", "%dist_shutdown")
        report["kernel_alive"] = km.is_alive()
        time.sleep(1.0 if scenarios[-1][1].startswith("kernel") else 0.0)  # the reaper's turn
    finally:
        report["sentinel"] = sentinel.poll() is None
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        sentinel.kill()
        sentinel.wait()
        shutil.rmtree(folder, ignore_errors=True)
    # what is left in the namespace besides this process (its unreaped children excluded)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = _others()
        if not left:
            break
        time.sleep(0.2)
    report["left"] = _others()
    return report


def _others() -> list[str]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] != "Z":
            out.append(f"{name} {cmd}")
    return out


if __name__ == "__main__":
    if os.getpid() != 1:
        sys.exit("run me as pid 1 of a fresh PID namespace (unshare --pid --fork --mount-proc)")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    pairs = [tuple(arg.split(":", 1)) for arg in sys.argv[1:]]
    print("RESULT " + json.dumps(main(pairs)), flush=True)
