"""nbdistributed 0.1.0's %%distributed round trip, in its own process (benchmarks/run.py).

Its magics share our names, so it never runs in our kernel. Shut down through its
graceful path only (by pid): its %dist_shutdown/%dist_reset call `pkill -f`.
"""

import json
import statistics
import sys
import time

from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

reps = int(sys.argv[1])
ip = start_ipython()
from nbdistributed.magic import DistributedMagic as DistributedMagics  # noqa: E402

ip.register_magics(DistributedMagics)
with capture_output():
    ip.run_line_magic("dist_init", "-n 2")
times = []
try:
    for _ in range(reps):
        t0 = time.perf_counter()
        with capture_output():
            ip.run_cell_magic("distributed", "", "pass")
        times.append(time.perf_counter() - t0)
finally:
    pm = DistributedMagics._process_manager
    pids = [p.pid for p in pm.processes] if pm else []
    with capture_output():
        DistributedMagics.shutdown_all()
    import os
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
print("RESULT " + json.dumps({"median": statistics.median(times), "times": times}))
