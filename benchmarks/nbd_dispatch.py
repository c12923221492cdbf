"""nbdistributed 0.1.0's %%distributed round trip, in its own process (benchmarks/run.py).

Its magics share our names, so it never runs in our kernel. Shut down through its
graceful path only (by pid): its %dist_shutdown/%dist_reset call `pkill -f`.

It prints ``RESULT {...}`` only when it did the work it timed: both workers started
(each answered a first cell with its pid) and ran every timed cell (each counts them);
otherwise ``SKIPPED "why"``. Its magic prints a message and returns when it has no
workers, which would otherwise be timed as a very fast cell.
"""

import json
import re
import statistics
import sys
import time

from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

reps = int(sys.argv[1])
ip = start_ipython()
from nbdistributed.magic import DistributedMagic as DistributedMagics  # noqa: E402

ip.register_magics(DistributedMagics)


def cell(code: str) -> str:
    with capture_output() as cap:
        ip.run_cell_magic("distributed", "", code)
    return cap.stdout + cap.stderr


def skip(why: str, said: str) -> None:
    print("SKIPPED " + json.dumps(f"{why}; it said: {said.strip()[-300:]}"))


with capture_output() as cap:
    ip.run_line_magic("dist_init", "-n 2")
times = []
try:
    # its dist_init returns before the workers have imported torch, and a cell sent
    # before then times out after 30 s: ask until both answer (or give up)
    deadline = time.monotonic() + 120
    said = ""
    while time.monotonic() < deadline:
        said = cell("import os\n_nbd_n = 0\nprint('ND_CHECK', os.getpid())")
        if len(set(re.findall(r"ND_CHECK\s+(\d+)", said))) == 2:
            break
    if len(set(re.findall(r"ND_CHECK\s+(\d+)", said))) != 2:
        skip("its 2 workers did not start", cap.stdout + cap.stderr + said)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            cell("_nbd_n += 1")
            times.append(time.perf_counter() - t0)
        said = cell("print('ND_COUNT', _nbd_n)")
        counts = re.findall(r"ND_COUNT\s+(\d+)", said)  # it prints each value on a line
        if counts != [str(reps)] * 2:
            skip(f"its workers did not run the {reps} timed cells (counts {counts})", said)
            times = []
finally:
    import psutil

    # its workers are this process's children: end exactly those, by pid, whatever its
    # own shutdown leaves behind (it left them running here)
    workers = psutil.Process().children(recursive=True)
    with capture_output():
        DistributedMagics.shutdown_all()
    _, alive = psutil.wait_procs(workers, timeout=3)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=3)
if times:
    print("RESULT " + json.dumps({"median": statistics.median(times), "times": times}))
