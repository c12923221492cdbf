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
print("RESULT " + json.dumps({"median": statistics.median(times), "times": times}))
