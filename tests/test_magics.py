"""%%distributed and friends on a real 2-rank Gloo cluster, driven through IPython."""

from __future__ import annotations

import pytest
import torch


def test_all_reduce_returns_rank_values(live, run, ip):
    out = run("%%distributed\nt = torch.arange(3.0) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nt")
    assert out.error is None, out.output
    rv = out.result.result
    assert type(rv).__name__ == "RankValues" and rv.ranks == [0, 1]
    for rank in (0, 1):
        assert torch.equal(rv[rank], torch.tensor([0.0, 3.0, 6.0]))
    assert ip.user_ns["_"] is rv  # `_` holds it as for any cell


def test_torchrun_environment_and_helpers(live, run):
    out = run(
        "%%distributed\nimport os\n"
        "(dist.is_initialized(), nd.rank, nd.world_size, nd.local_rank, nd.device, nd.is_main(),\n"
        " {k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR')},\n"
        " int(os.environ['MASTER_PORT']) > 0)"
    )
    assert out.error is None, out.output
    for rank, value in out.result.result.items():
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
        }
        assert value == (True, rank, 2, rank, "cpu", rank == 0, env, True)


def test_second_init_process_group_is_harmless(live, run):
    out = run(
        '%%distributed\nimport torch.distributed as dist\ndist.init_process_group("gloo")\ndist.get_world_size()'
    )
    assert out.error is None, out.output
    assert dict(out.result.result) == {0: 2, 1: 2}
    assert (
        "[rank 1] notebook_dist: the default process group is already initialised (backend gloo, rank 1 of 2); "
        "this init_process_group() call is skipped." in out.stderr
    )


def test_output_streams_tagged_by_rank_with_nothing_dropped(live, run):
    cell = (
        "%%distributed\nimport sys, threading\n"
        "print('first')\nprint()\nprint('to stderr', file=sys.stderr)\n"
        "sys.stdout.write('partial')\n"
        "th = threading.Thread(target=lambda: print('from a thread', nd.rank)); th.start(); th.join()\n"
    )
    out = run(cell)
    assert out.error is None, out.output
    for rank in (0, 1):
        assert f"[rank {rank}] first\n[rank {rank}] \n" in out.stdout
        assert f"[rank {rank}] to stderr\n" in out.stderr
        # the partial line is completed by the thread's print, as in a terminal
        assert f"[rank {rank}] partialfrom a thread {rank}\n" in out.stdout
    assert out.result.result is None  # no last expression, no value


def test_a_cell_that_ends_before_it_is_watched_keeps_its_output(live, run, monkeypatch):
    """The race a busy machine loses now and then, made certain: the cell has finished and
    ipyparallel has dropped its bookkeeping before the kernel starts to watch it."""
    from notebook_dist import watch as watch_module

    real_init = watch_module.CellWatch.__init__

    def late_init(self, cluster, ar, *args, **kwargs):
        ar.wait(30)
        ar.wait_for_output(30)
        for mid in ar.msg_ids:  # what ipyparallel's cleanup does once reply and output are in
            cluster.processes.client.metadata.pop(mid, None)
        real_init(self, cluster, ar, *args, **kwargs)

    monkeypatch.setattr(watch_module.CellWatch, "__init__", late_init)
    out = run("%%distributed\nprint('said before the watch began', nd.rank)\nnd.rank")
    assert out.error is None, out.output
    for rank in (0, 1):
        assert f"[rank {rank}] said before the watch began {rank}\n" in out.stdout


def test_exception_on_one_rank_points_at_cell_lines(live, run):
    out = run(
        "%%distributed\nx = 1\nif dist.get_rank() == 1:\n    raise ValueError('rank one is unhappy')\nprint('done', nd.rank)"
    )
    err = out.error
    assert type(err).__name__ == "RankError"
    assert str(err) == "rank 1 raised ValueError: rank one is unhappy"
    assert list(err.errors) == [1]
    assert err.errors[1].traceback.splitlines()[-3:] == [
        f'  File "Cell In[{out.result.execution_count}]", line 4, in <module>',
        "    raise ValueError('rank one is unhappy')",
        "ValueError: rank one is unhappy",
    ]
    assert "exec" not in err.errors[1].traceback and "run_cell" not in err.errors[1].traceback
    assert "[rank 0] done 0" in out.stdout  # other ranks' output is still shown
    rendered = "\n".join(err._render_traceback_())
    assert (
        rendered.count("ValueError: rank one is unhappy") == 2
    )  # the traceback's last line, and the summary
    assert "[rank 1] ValueError: rank one is unhappy" in rendered


def test_exception_in_a_function_keeps_the_call_chain(live, run):
    out = run("%%distributed\ndef f(v):\n    return 1 / v\n\nf(nd.rank - 1) if nd.rank == 1 else 0")
    tb = out.error.errors[1].traceback
    assert (
        "line 5, in <module>" in tb
        and "line 3, in f" in tb
        and tb.endswith("ZeroDivisionError: division by zero\n")
    )


def test_syntax_error_is_reported_once_before_anything_runs(live, run):
    out = run("%%distributed\nprint('ran')\nx = (1,\n")
    err = out.error
    assert type(err).__name__ == "CellSyntaxError"
    assert err.lineno == 3 and err.msg == "'(' was never closed"
    assert err._render_traceback_() == [
        f'  File "Cell In[{out.result.execution_count}]", line 3',
        "    x = (1,",
        "        ^",
        "SyntaxError: '(' was never closed (nothing ran on any rank)",
    ]
    assert "[rank" not in out.output  # no rank ran the first line


def test_unpicklable_value(live, run):
    out = run("%%distributed\nimport threading\nthreading.Lock()")
    err = out.error
    assert type(err).__name__ == "RankError" and sorted(err.errors) == [0, 1]
    assert err.errors[0].evalue == (
        "cannot send to the notebook: the cell's value: a _thread.lock cannot be pickled "
        "(TypeError: cannot pickle '_thread.lock' object)"
    )


def test_bad_ranks_spec(live, run):
    out = run("%%distributed --ranks 0-x\n1")
    assert type(out.error).__name__ == "UsageError"
    assert (
        str(out.error)
        == "bad rank specification '0-x': use 'all', a rank like '0', a list like '0,2' or a range like '1-3'"
    )


def test_rank_magic_out_of_range(live, run):
    out = run("%%rank 5\nprint('never')")
    assert type(out.error).__name__ == "UsageError"
    assert str(out.error) == "rank 5 not in this cluster: it has 2 ranks (ranks 0-1)"


def test_rank_magic_runs_on_the_named_rank_only(live, run):
    out = run("%%rank 1\nprint('here')\nnd.rank")
    assert out.error is None, out.output
    assert dict(out.result.result) == {1: 1}
    assert "[rank 1] here" in out.stdout and "[rank 0]" not in out.stdout


def test_gather_binds_rank_values(live, run, ip):
    out = run("%%distributed --gather a b\na = nd.rank + 10\nb = torch.full((2,), float(nd.rank))")
    assert out.error is None, out.output
    assert dict(ip.user_ns["a"]) == {0: 10, 1: 11}
    assert torch.equal(ip.user_ns["b"][1], torch.ones(2))
    out = run("%%distributed --gather nope\nz = 1")
    assert type(out.error).__name__ == "RankError"
    assert out.error.errors[0].evalue == "--gather 'nope': not defined on rank 0 after the cell ran"


def test_push_and_pull_functions_classes_and_tensors(live, run, ip):
    run(
        "import torch\ndef scale(v):\n    return v * 3\nclass Box:\n    def __init__(self, v):\n        self.v = v\nw = torch.ones(4)"
    )
    out = run("%dist_push scale Box w")
    assert out.error is None, out.output
    out = run("%%distributed\nbox = Box(scale(w) + nd.rank)\nres = box.v.sum().item()")
    assert out.error is None, out.output
    out = run("%dist_pull res box")
    assert out.error is None, out.output
    assert dict(ip.user_ns["res"]) == {0: 12.0, 1: 16.0}
    assert torch.equal(ip.user_ns["box"][1].v, torch.full((4,), 4.0))


def test_pull_of_a_missing_name(live, run):
    out = run("%dist_pull not_there_anywhere")
    assert type(out.error).__name__ == "TransferError"
    assert str(out.error) == "'not_there_anywhere' is not defined on ranks 0, 1"
    out = run("%%rank 1\nonly_one = 1")
    out = run("%dist_pull only_one")
    assert str(out.error) == "'only_one' is not defined on rank 0"


def test_push_of_an_unpicklable_value(live, run):
    run("import threading\nlk = threading.Lock()")
    out = run("%dist_push lk")
    assert type(out.error).__name__ == "TransferError"
    assert (
        str(out.error)
        == "'lk' on the notebook: a _thread.lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)"
    )
    out = run("%dist_push undefined_in_notebook")
    assert type(out.error).__name__ == "UsageError"
    assert str(out.error) == "not defined in the notebook: undefined_in_notebook"


def test_pull_of_an_unpicklable_value(live, run):
    run("%%distributed\nimport threading\nlock = threading.Lock()")
    out = run("%dist_pull lock --ranks 1")
    assert (
        str(out.error)
        == "'lock' on rank 1: a _thread.lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)"
    )


def test_autodist_and_local(live, run, ip):
    assert run("%autodist on").error is None
    try:
        out = run("v = nd.rank * 7\nv")
        assert out.error is None, out.output
        assert dict(out.result.result) == {0: 0, 1: 7}
        out = run("%%local\nkernel_side = 41 + 1\nkernel_side")
        assert out.error is None and out.result.result == 42
        assert ip.user_ns["kernel_side"] == 42
        out = run("x = 1\nraise KeyError('k')")  # line numbers: no magic line is shown, so line 2
        assert "line 2, in <module>" in out.error.errors[0].traceback
    finally:
        assert run("%autodist off").error is None
    out = run("plain = 5\nplain")
    assert out.result.result == 5


def test_status_and_reuse(live, run):
    out = run("%dist_status")
    assert out.error is None, out.output
    lines = out.stdout.splitlines()
    # what a bug report needs: the versions, then the world
    # the ranks' torch: the engines run the kernel's Python, so the same torch as here
    assert lines[0].startswith("notebook_dist ") and f" · torch {torch.__version__} · " in lines[0]
    assert " · ipyparallel " in lines[0] and lines[0].endswith(" · 2 ranks, gloo")
    assert lines[1].split() == [
        "rank",
        "host",
        "pid",
        "device",
        "backend",
        "state",
        "process_group",
    ]
    for rank, line in enumerate(lines[2:4]):
        cols = line.split()
        assert (
            cols[0] == str(rank)
            and cols[2] == str(live.ranks[rank].pid)
            and cols[3:] == ["cpu", "gloo", "idle", "ok"]
        )
    out = run("%dist_init -n 2 --backend gloo")
    assert out.stdout.strip() == "notebook_dist: reusing the running cluster (2 ranks, gloo)."


def test_dist_init_run_again_after_a_rank_ended_restarts_the_ranks(live, run):
    """The %dist_init cell run again after a crash gives the ranks it asks for, working:
    it says what had ended and restarts them, rather than reusing a cluster a rank of
    which is gone."""
    from notebook_dist import session

    pids = [r.pid for r in live.ranks]
    out = run("%%distributed\nimport os\nif nd.rank == 1:\n    os._exit(5)")
    assert type(out.error).__name__ == "ClusterError"
    out = run("%dist_init -n 2 --backend gloo")
    assert out.error is None, out.output
    said = out.stdout.strip().splitlines()
    assert said[0] == (
        "notebook_dist: rank 1 exited with code 5; restarting the cluster's ranks (their "
        "variables are lost)."
    ), said
    assert said[1].startswith("notebook_dist: restarted 2 ranks (gloo) in "), said
    fresh = session.current()
    assert fresh.dead_ranks() == {} and not {r.pid for r in fresh.ranks} & set(pids)
    assert dict(fresh.run("nd.rank").values) == {0: 0, 1: 1}
    out = run("%dist_init -n 2 --backend gloo")
    assert out.stdout.strip() == "notebook_dist: reusing the running cluster (2 ranks, gloo)."


def test_preflight_errors_before_anything_starts(live, run):
    out = run("%dist_init --backend nccl")
    assert type(out.error).__name__ == "UsageError"
    assert str(out.error).startswith(
        "NCCL needs one GPU per rank, and no GPU is visible to this notebook."
    )
    out = run("%dist_init --gpus 0")
    assert str(out.error) == "--gpus '0' asked, but no GPU is visible to this notebook"
    out = run("%dist_init -n two")
    assert type(out.error).__name__ == "UsageError"


def test_interrupt_of_a_python_busy_cell_keeps_state(live, run):
    from conftest import ctrl_c_after

    run("%%distributed\nkept = nd.rank + 100")
    with ctrl_c_after(3.0):
        out = run("%%distributed\nimport time\nfor _ in range(600):\n    time.sleep(0.1)")
    assert isinstance(out.error, KeyboardInterrupt)
    out = run("%%distributed\nkept")
    assert dict(out.result.result) == {0: 100, 1: 101}


def test_an_interrupted_hung_cell_ends_with_one_paragraph_and_one_line(live, run):
    """No frame of the tool in what the user sees: not the magics, the cluster, the watch,
    threading, nor the tracker's wrapper in a rank's stack."""
    from conftest import ctrl_c_after

    with ctrl_c_after(2.0):
        out = run("%%distributed\nt = torch.ones(1)\ndist.recv(t, src=1 - nd.rank)")
    assert isinstance(out.error, KeyboardInterrupt)
    assert (
        "notebook_dist: released ranks 0, 1 from collectives that could not complete" in out.stdout
    )
    shown = out.output.strip().splitlines()
    assert shown[-1] == (
        "CellInterrupted: the cell was interrupted on ranks 0, 1; every rank kept its variables"
    )
    assert "Traceback" not in out.output and 'File "' not in out.output, out.output
    stacks = run("%dist_stacks").stdout
    assert (
        "rank 0: in recv from rank 1\n  line 3, in <module>\n    dist.recv(t, src=1 - nd.rank)"
        in stacks
    )
    for shown_text in (out.output, stacks):
        assert "notebook_dist/" not in shown_text and "magics/" not in shown_text, shown_text
    assert dict(
        run("%%distributed\nt = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)").result.result
    ) == {
        0: 2.0,
        1: 2.0,
    }


def test_a_rank_traceback_through_a_collective_shows_no_frame_of_the_tool(live, run):
    out = run("%%distributed\nt = torch.ones(2)\ndist.broadcast(t, src=7)")
    assert type(out.error).__name__ == "RankError"
    rendered = "\n".join(out.error._render_traceback_())
    assert 'File "Cell In[' in rendered and "line 3, in <module>" in rendered
    assert "distributed_c10d.py" in rendered  # torch's own frames stay
    assert "notebook_dist/" not in rendered, rendered
    debug = run("%dist_debug --frame 1").stdout
    assert "notebook_dist/" not in debug and "tracked" not in debug, debug


def test_magic_help_is_available(ip):
    doc = ip.find_cell_magic("distributed").__doc__
    assert "--gather" in doc and "In [3]: %%distributed" in doc
    for name in ("dist_init", "dist_status", "dist_push", "dist_pull", "dist_shutdown", "autodist"):
        assert ip.find_line_magic(name).__doc__.strip(), name


@pytest.mark.parametrize("line", ["%dist_status extra", "%dist_shutdown now", "%autodist maybe"])
def test_magics_refuse_stray_arguments(live, run, line):
    out = run(line)
    assert type(out.error).__name__ == "UsageError"


def test_overridden_environment_is_named():
    import os

    from notebook_dist import DistCluster

    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    try:
        with DistCluster(n=1) as c:
            assert c.notes == [
                "TORCH_NCCL_ASYNC_ERROR_HANDLING was '3' in your environment; ranks use '0' (see notebook_dist.config)"
            ]
            said = c.run(
                "import os\n[os.environ[k] for k in ('TORCH_NCCL_ASYNC_ERROR_HANDLING', "
                "'TORCH_NCCL_ENABLE_MONITORING', 'TORCH_NCCL_DUMP_ON_TIMEOUT')]"
            )
            assert dict(said.values) == {0: ["0", "0", "0"]}  # the watchdog never ends a rank
    finally:
        del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]


def test_the_flight_recorder_keeps_collectives_unless_the_user_chose(live):
    from torch.torch_version import TorchVersion

    from notebook_dist.runtime.bootstrap import flight_recorder_env

    # what the doctor and --profile read: on by default, as torch 2.11 and newer have it
    said = live.run("import os\nos.environ.get('TORCH_FR_BUFFER_SIZE')")
    assert dict(said.values) == {0: "2000", 1: "2000"}
    for version, want in (
        ("2.9.1", {"TORCH_FR_BUFFER_SIZE": "2000"}),  # 2.8-2.10 keep none by default
        ("2.6.0+cu124", {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}),
    ):
        env: dict[str, str] = {}
        flight_recorder_env(2000, TorchVersion(version), env)
        assert env == want, version
    for chosen in ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}):
        env = dict(chosen)
        flight_recorder_env(2000, TorchVersion("2.6.0"), env)
        assert env == chosen  # the user's choice, under either name, is kept


def test_init_with_other_arguments_says_what_it_replaces(live, run):
    from notebook_dist import session

    out = run("%dist_init -n 1")
    assert out.error is None, out.output
    assert out.stdout.splitlines()[0] == (
        "notebook_dist: replacing the running cluster (2 ranks, gloo) with 1 ranks, gloo; its ranks' variables are lost."
    )
    assert session.current().world_size == 1 and not live.running
    # the next test that needs the shared cluster gets a fresh 2-rank one (see conftest.live)


@pytest.mark.parametrize(
    "name, message",
    [
        ("1x", "--gather '1x': not a valid Python name"),
        ("class", "--gather 'class': not a valid Python name"),
        ("_", "--gather _: IPython keeps its own values under that name; choose another"),
        ("_i3", "--gather _i3: IPython keeps its own values under that name; choose another"),
        ("Out", "--gather Out: IPython keeps its own values under that name; choose another"),
    ],
)
def test_gather_refuses_names_it_cannot_bind(live, run, ip, name, message):
    out = run(f"%%distributed --gather {name}\nx = 1")
    assert type(out.error).__name__ == "UsageError" and str(out.error) == message
    out = run("%%distributed\nnd.rank")
    assert ip.user_ns["_"] is out.result.result  # `_` is still IPython's


def test_pull_refuses_names_ipython_owns(live, run):
    out = run("%dist_pull _")
    assert str(out.error) == (
        "%dist_pull _: IPython keeps its own values under that name in the notebook; "
        "on the ranks, assign it to another name first (x = _)"
    )


def test_a_users_mistake_becomes_a_usage_error_one_way():
    """Only ``usage_errors`` raises IPython's UsageError: the library's mistakes
    (``errors.UsageMistake``) and a magic's own refusals (``refuse``) both go through it."""
    import ast
    from pathlib import Path

    raised = []
    for path in sorted((Path(__file__).resolve().parents[1] / "magics").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if getattr(call, "id", None) == "UsageError":
                    fn = next(
                        f.name
                        for f in ast.walk(ast.parse(path.read_text()))
                        if isinstance(f, ast.FunctionDef)
                        and f.lineno <= node.lineno <= f.end_lineno
                    )
                    raised.append((path.name, fn))
    assert raised == [("magics.py", "usage_errors")], raised
