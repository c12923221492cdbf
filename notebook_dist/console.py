"""The notebook's side of ranks that ask for a line (``runtime/debugger.py``): a pdb prompt
or ``input()`` on a rank, asked of the user through the kernel's own stdin, as ``input()``
in an ordinary cell is (JupyterLab's input box), with the rank in the prompt:
``[rank 1] (Pdb) ``. The answer goes to the rank's answer file, on its host.

From ``phrases.COMPACT_FROM`` ranks, the ranks stopped alike (the same prompt at the same
line) are asked once, ``[ranks 0-15] (Pdb) ``, and the line goes to each of them (their
output folds as their lines do): at 16 ranks one prompt, not 16. Before it asks, the console
waits for the other ranks to stop too: until no further rank has stopped for ``GATHER_S``
(a busy machine brings the last ranks late), and ``GATHER_MAX_S`` at most from the first.

When several ranks are stopped at once, a line that starts with ``:`` is the console's:

- ``:ranks`` lists the stopped ranks with where each is;
- ``:rank N`` switches to rank N (asked alone until it runs on);
- ``:all CMD`` sends CMD to every stopped rank, ``:on 0,2 CMD`` to those ranks.

``q`` (or ``quit``) in a debugger ends the cell as an interrupt does: the other ranks are
stopped too, every rank keeps its variables. A front end that cannot answer input (a run
with no stdin) gets ``c`` (continue) sent for it, and one note.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable

from .phrases import COMPACT_FROM, alike, each_rank, rank_list

#: how long the console waits after the last rank that stopped for the other ranks to stop
#: too, before it asks those stopped alike (a cell on ``COMPACT_FROM`` ranks or more)
GATHER_S = 0.5
#: the longest it waits so, from the first rank's stop (a rank that never stops)
GATHER_MAX_S = 3.0
QUIT = ("q", "quit", "exit")
#: commands after which a rank runs on: the console may turn to another rank
GOES_ON = ("c", "cont", "continue", *QUIT)
HELP = (
    "notebook_dist: a line starting with ':' is for the ranks' console: :ranks (the stopped "
    "ranks), :rank N (switch), :all CMD (to every stopped rank), :on 0,2 CMD (to those)."
)


class Console:
    def __init__(self, cluster, say, ask: Callable[[str], str] | None = None, answers=()):
        self.cluster = cluster
        self.say = say  # writes a line to the cell's output
        self._ask = ask
        self.scripted = list(answers)  # --answers: given in advance, in order
        self.current: int | None = None
        #: the rank that was just sent a command it answers with another prompt (n, p x):
        #: the console waits for that prompt before it turns to another rank
        self.sticky: int | None = None
        self.answered: dict[int, int] = {}  # rank -> the last request id answered
        self.quit_by: int | None = None
        self.no_stdin = False
        self.told = False  # the note on how to answer several ranks at once was said
        #: many ranks: the ranks last asked as one, whose next prompts are gathered; since
        #: when a rank has waited unasked, and when the last of those waiting stopped
        self.group: list[int] | None = None
        self.last: tuple[int, float] = (0, 0.0)  # (how many waited, since when)
        self.since: float | None = None
        self.before: Callable[[], None] | None = None

    def waiting(self, views) -> dict[int, dict]:
        """Ranks that ask and have not been answered: rank -> what it asks."""
        out = {}
        for r, v in views.items():
            asking = v.snap.get("asking") if v.status == "running" else None
            if asking and self.answered.get(r) != asking["id"]:
                out[r] = asking
        return out

    def serve(self, views, before: Callable[[], None] | None = None) -> bool:
        """Ask the user for one rank that waits (blocking until answered); True if any rank
        waits for a line (so no hang is diagnosed meanwhile). ``before()``: called just
        before a prompt (what the ranks printed before they asked is shown first)."""
        self.before = before
        waiting = self.waiting(views)
        many = len(views) >= COMPACT_FROM
        if many and self.current not in waiting and self.sticky is None:
            return self._serve_alike(views, waiting)
        sticky = self.sticky
        if sticky is not None and sticky not in waiting and views[sticky].status == "running":
            return True  # its next prompt is coming
        self.sticky = None
        if not waiting:
            return any(v.snap.get("asking") for v in views.values() if v.status == "running")
        if self.current not in waiting:
            self.current = min(waiting)
        r = self.current
        if len(waiting) > 1 and not self.told:  # (16 ranks at input(): 16 prompts otherwise)
            self.told = True
            self.say(
                f"notebook_dist: {rank_list(waiting)} wait for a line; asking rank {r} first. "
                ":all LINE answers every one, :ranks lists them."
            )
        line = self._line(f"[rank {r}] {waiting[r]['prompt']}", waiting[r]["kind"])
        if line.startswith(":"):
            self._meta(line, waiting)
            return True
        self.send([r], waiting, line)
        if many and runs_on(waiting[r], line):
            self.current = None  # (asked alone, :rank N, until it runs on)
        return True

    def _serve_alike(self, views, waiting: dict[int, dict]) -> bool:
        """Many ranks: ask the ranks stopped alike (the lowest rank's kind) once, when the
        ranks expected to stop (those asked last, else every running rank) all have, or when
        none has stopped for ``GATHER_S`` (``GATHER_MAX_S`` at most); the line goes to each."""
        running = [r for r, v in views.items() if v.status == "running"]
        if not waiting:
            self.since = None
            return any(views[r].snap.get("asking") for r in running)
        now = time.monotonic()
        if self.since is None or len(waiting) != self.last[0]:
            self.last = (len(waiting), now)  # (a rank stopped since)
        self.since = self.since or now
        expected = [r for r in (self.group or running) if r in running]
        quiet = now - self.last[1] >= GATHER_S or now - self.since >= GATHER_MAX_S
        if any(r not in waiting for r in expected) and not quiet:
            return True  # the others may stop too: asked together
        self.since = None
        same = alike(sorted(waiting), key=lambda r: _stop(waiting[r]))
        ranks = next(iter(same.values()))
        asking = waiting[ranks[0]]
        if len(ranks) > 1 and not self.told:
            self.told = True
            self.say(
                f"notebook_dist: {rank_list(ranks)} stopped alike; each line goes to every "
                "one of them. :rank N asks one alone, :ranks lists them."
            )
        line = self._line(f"[{rank_list(ranks)}] {asking['prompt']}", asking["kind"])
        if line.startswith(":"):
            self._meta(line, waiting)
            return True
        self.send(ranks, waiting, line)
        self.sticky = None  # (their next prompts are gathered instead)
        self.group = None if runs_on(asking, line) else ranks
        return True

    def _line(self, prompt: str, kind: str) -> str:
        if self.before is not None:
            self.before()
        if self.scripted:
            line = self.scripted.pop(0)
            self.say(f"{prompt}{line}")
            return line
        if self.no_stdin:
            return "c" if kind == "pdb" else "\x04"
        try:
            return (self._ask or builtins.input)(prompt)
        except Exception as exc:  # StdinNotImplementedError: the front end cannot answer
            if type(exc).__name__ != "StdinNotImplementedError":
                raise
            self.no_stdin = True
            self.say(
                "notebook_dist: a rank asks for a line, and this front end cannot answer input "
                "(run the cell in JupyterLab, or give the lines with --answers); the debugger "
                "continues (c) and input() sees the end of its input."
            )
            return "c" if kind == "pdb" else "\x04"

    def send(self, ranks: list[int], waiting: dict[int, dict], line: str) -> None:
        """``line`` to each of ``ranks``, as the answer to what each asks (``waiting``):
        one write for each host (over ssh, 16 ranks on 2 hosts are 2 calls, not 16)."""
        self.cluster.tell_ranks([(r, "answer", f"{waiting[r]['id']}\t{line}") for r in ranks])
        for rank in ranks:
            asking = waiting[rank]
            self.answered[rank] = asking["id"]
            if asking["kind"] == "pdb" and line.strip() in QUIT:
                self.quit_by = rank if self.quit_by is None else self.quit_by  # (the first)
            if not runs_on(asking, line):
                self.sticky = rank

    def _meta(self, line: str, waiting: dict[int, dict]) -> None:
        word, _, rest = line[1:].strip().partition(" ")
        if word == "ranks":
            said = [(r, f"{a['prompt'].strip()} at {_where(a)}") for r, a in waiting.items()]
            said = [(r, words, words) for r, words in sorted(said)]  # (a prompt as it is)
            self.say("notebook_dist: stopped: " + each_rank(said, between=": "))
        elif word == "rank" and rest.strip().isdigit():
            chosen = int(rest)
            if chosen in waiting:
                self.current = chosen
            else:
                self.say(f"notebook_dist: rank {chosen} is not waiting for a line.")
        elif word in ("all", "on"):
            spec, _, cmd = ("all", " ", rest) if word == "all" else rest.partition(" ")
            try:
                chosen = self.cluster.select(spec) if spec != "all" else sorted(waiting)
            except Exception as exc:
                self.say(f"notebook_dist: {exc}")
                return
            targets = [r for r in chosen if r in waiting]
            self.send(targets, waiting, cmd.strip())
            self.say(f"notebook_dist: sent {cmd.strip()!r} to {rank_list(targets)}.")
        else:
            self.say(HELP)

    def quit_all(self, views) -> None:
        """After q: every other rank in a debugger quits too."""
        waiting = self.waiting(views)
        self.send([r for r, asking in waiting.items() if asking["kind"] == "pdb"], waiting, "q")


def runs_on(asking: dict, line: str) -> bool:
    """Whether a rank answered ``line`` runs on (input() answered, pdb's c or q), rather
    than asking again (pdb's p x, n)."""
    return asking["kind"] != "pdb" or line.strip().split(" ")[0] in GOES_ON


def _stop(asking: dict) -> tuple:
    """What makes ranks stopped alike: the kind of stop, the prompt, and where."""
    return asking["kind"], asking["prompt"], tuple(asking.get("where") or ())


def _where(asking: dict) -> str:
    where = asking.get("where")
    return f"{where[0]}, line {where[1]}" if where else "?"
