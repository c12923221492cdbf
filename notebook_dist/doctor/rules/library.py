"""Collectives torch issues inside a library call (DTensor, state dicts, DCP) that only
some ranks make."""

from __future__ import annotations

from ..stacks import library_call
from ..words import each_rank, plural, verb
from .base import Diagnosis, Facts, cap, make, registrar

RULES: list = []
rule = registrar(RULES)


# what to say for the library calls that run collectives people meet most
LIBRARY_ADVICE = {
    "full_tensor": "call it on every rank (it gathers the shards), then use the result where "
    "you need it: `full = t.full_tensor()` on every rank, `if nd.rank == 0: print(full)`",
    "redistribute": "call it on every rank: it moves shards between them",
    "state_dict": "gather the state dict on every rank (it runs collectives), then save on "
    "rank 0 only: `sd = get_model_state_dict(model, options=StateDictOptions("
    "full_state_dict=True, cpu_offload=True))` on every rank, `if nd.rank == 0: "
    "torch.save(sd, path)`",
    "save": "torch.distributed.checkpoint's save and load are collective: every rank calls "
    "them with the same checkpoint_id and writes its own shards (no rank condition)",
    "load": "torch.distributed.checkpoint's save and load are collective: every rank calls "
    "them with the same checkpoint_id and reads its own shards (no rank condition)",
}
LIBRARY_ADVICE["get_model_state_dict"] = LIBRARY_ADVICE["state_dict"]
LIBRARY_ADVICE["get_state_dict"] = LIBRARY_ADVICE["state_dict"]
LIBRARY_ADVICE["get_optimizer_state_dict"] = LIBRARY_ADVICE["state_dict"]


@rule("ND401", "a collective torch issued inside a library call")
def library(f: Facts) -> Diagnosis | None:
    inside = f.in_kind("internal")
    if not inside:
        return None
    others = [r for r in f.info if r not in inside and r not in f.busy]
    if not others:
        if len({f.waits[r].op for r in inside}) > 1:
            calls = each_rank((r, f"in {f.wait_text(r)}") for r in inside)
            return make(
                f,
                "mismatch",
                f"The ranks wait in different collectives that torch issued: {calls}. Every rank "
                "must make the same library calls in the same order.",
                inside,
                f.wait_line(inside[0]),
            )
        return None  # every rank in the same one: the stalled rule
    r0 = inside[0]
    call = library_call(f.snaps[r0].get("stack")) or {}
    func = call.get("func", "")
    line = f.wait_line(r0)
    op = f.waits[r0].op
    what = f"{op}, a collective torch issued" if op else "a collective torch issued"
    issued = (
        f"{what} inside {func}() ({call.get('file')}), called at line {line}"
        if func
        else f"{what}, at {f.stack_at(r0)}"
    )
    if call.get("code"):
        issued += f" (`{call['code']}`)"
    never = each_rank((r, f.elsewhere(r)) for r in sorted(others))
    text = f"{cap(plural(inside))} {verb(inside, 'waits', 'wait')} in {issued}, while {never} without calling it."
    cond = f.condition(line)
    if cond:
        text += (
            f" Line {line} is inside `if {cond[1]}:` (line {cond[0]}), so only some ranks reach it."
        )
    advice = LIBRARY_ADVICE.get(func, f"call {func or 'it'}() on every rank: it runs a collective")
    text += f" {cap(advice)}."
    return make(f, "library", text, inside if cond else others, line)
