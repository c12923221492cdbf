"""Round trips of the value transfer path, and RankValues behaviour."""

import numpy as np
import pytest
import torch

from notebook_dist.errors import TransferError
from notebook_dist.values import RankValues, pack, pack_named, unpack

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


def _make(dtype, shape=(3, 5)):
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_round_trip_every_dtype(dtype):
    t = _make(dtype)
    back = unpack(pack(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensors_travel_out_of_band():
    t = torch.randn(1024, 256)
    frames = pack(t)
    assert len(frames) == 2 and len(frames[0]) < 1000
    assert memoryview(frames[1]).nbytes == t.numel() * 4


def test_frames_go_through_a_file_and_come_back_as_they_were(tmp_path):
    """Packed frames written to one file come back the same, out-of-band buffers as
    buffers (an array over the file's private mapping: writable, the file untouched); the
    file goes when the reader consumes it, stays when it does not (many readers); frames
    that do not name such a file pass as they are; packed memoryviews travel out of band."""
    from notebook_dist.values import frames_from, frames_to_file

    value = {"a": np.arange(300_000.0), "b": b"x" * 5000, "t": torch.ones(3), "n": None}
    frames = pack(value)
    filed = frames_to_file(str(tmp_path), frames)
    assert filed is not None and len(filed) == 2
    (path,) = tmp_path.iterdir()
    assert filed[1].decode() == str(path)
    read = frames_from(filed, consume=False)
    assert [bytes(f) for f in read] == [bytes(f) for f in frames] and path.exists()
    back = unpack(frames_from(filed))
    assert not path.exists()
    assert np.array_equal(back["a"], value["a"]) and back["b"] == value["b"]
    assert torch.equal(back["t"], value["t"]) and back["n"] is None
    back["a"][0] = 7.0  # (its own pages)
    assert frames_from(frames) is frames
    assert frames_from([b"x", b"y"]) == [b"x", b"y"]
    packed = pack(pack(np.arange(1000.0)))  # (a value's frames, packed again: out of band)
    assert len(packed) == 2 and memoryview(packed[1]).nbytes == 8000
    assert np.array_equal(unpack(unpack(packed)), np.arange(1000.0))


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.arange(20.0)[::3],
        torch.zeros(0, 7),
        torch.zeros(0, dtype=torch.bfloat16),
        torch.tensor(2.5),
        torch.tensor(7, dtype=torch.bfloat16),
    ],
    ids=["transposed", "strided", "empty", "empty-bf16", "scalar", "scalar-bf16"],
)
def test_odd_layouts(t):
    back = unpack(pack(t))
    assert back.shape == t.shape and back.dtype == t.dtype and torch.equal(back, t)
    assert back.is_contiguous()


def test_received_tensor_is_writable_and_independent():
    t = torch.arange(6.0)
    frames = pack(t)
    frames = [bytes(f) for f in frames]  # as received: read-only bytes
    back = unpack(frames)
    back += 1
    assert torch.equal(back, torch.arange(6.0) + 1)


def test_nested_containers_and_grad_and_parameters():
    p = torch.nn.Parameter(torch.randn(3))
    obj = {
        "a": [torch.ones(2), (torch.zeros(1, dtype=torch.bfloat16), np.arange(4))],
        "p": p,
        "g": torch.randn(2, requires_grad=True),
    }
    back = unpack(pack(obj))
    assert torch.equal(back["a"][0], torch.ones(2))
    assert back["a"][1][0].dtype == torch.bfloat16
    assert np.array_equal(back["a"][1][1], np.arange(4))
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].requires_grad
    assert back["g"].requires_grad and torch.equal(back["g"].detach(), obj["g"].detach())


def test_module_round_trip():
    m = torch.nn.Linear(4, 2)
    back = unpack(pack(m))
    assert torch.equal(back.weight, m.weight) and torch.equal(back.bias, m.bias)


def test_local_functions_and_classes_travel():
    class Point:
        def __init__(self, x):
            self.x = x

    def double(v):
        return v * 2

    back_cls, back_fn = unpack(pack((Point, double)))
    assert back_cls(3).x == 3 and back_fn(4) == 8


def test_unpicklable_names_the_variable():
    import threading

    with pytest.raises(TransferError) as info:
        pack_named("lock", threading.Lock(), "the notebook")
    assert str(info.value).startswith(
        "'lock' on the notebook: a _thread.lock cannot be pickled (TypeError: cannot pickle '_thread.lock' object)"
    )


def test_rank_values_mapping():
    rv = RankValues({1: "b", 0: "a"}, name="x")
    assert list(rv) == [0, 1] and rv[1] == "b" and len(rv) == 2 and rv.ranks == [0, 1]
    assert dict(rv) == {0: "a", 1: "b"}
    with pytest.raises(KeyError, match="no value from rank 3 \\(ranks here: 0, 1\\)"):
        rv[3]
    with pytest.raises(TypeError):
        rv[0] = "c"  # read-only
    assert repr(rv) == "RankValues({0: 'a', 1: 'b'})"
    assert "<td style='text-align:right'><b>1</b></td>" in rv._repr_html_()
    assert RankValues({0: torch.ones(2)}) == RankValues({0: torch.ones(2)})
    assert RankValues({0: torch.ones(2)}) != RankValues({0: torch.zeros(2)})


def test_many_ranks_values_that_read_the_same_are_shown_once():
    """From 9 ranks the notebook shows the ranks whose values read the same once; each rank's
    own value is still there; fewer ranks keep a line each."""
    from IPython.lib.pretty import pretty

    rv = RankValues({r: "ok" if r != 17 else "late" for r in range(32)})
    assert pretty(rv).splitlines() == [
        "RankValues (32 ranks)",
        "[ranks 0-16, 18-31] 'ok'",
        "[rank 17] 'late'",
    ]
    html = rv._repr_html_()
    assert html.count("<tr><td") == 2 and "<b>0-16, 18-31</b>" in html, html
    assert rv[5] == "ok" and len(rv) == 32 and repr(rv).count("'ok'") == 31
    tensors = pretty(RankValues({r: torch.full((2,), float(r % 2)) for r in range(16)}))
    assert tensors.splitlines()[1:] == [
        "[ranks 0, 2, 4, 6, 8, 10, 12, 14] tensor([0., 0.])",
        "[ranks 1, 3, 5, 7, 9, 11, 13, 15] tensor([1., 1.])",
    ]
    assert len(pretty(RankValues(dict.fromkeys(range(8), "ok"))).splitlines()) == 9


def test_rank_values_pretty_one_row_per_rank():
    from IPython.lib.pretty import pretty

    text = pretty(RankValues({0: torch.zeros(2), 1: torch.ones(2)}))
    assert text.splitlines() == [
        "RankValues (2 ranks)",
        "[rank 0] tensor([0., 0.])",
        "[rank 1] tensor([1., 1.])",
    ]


@pytest.fixture
def shm(tmp_path):
    import os
    import tempfile

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = tempfile.mkdtemp(dir=base, prefix="nd-test-")
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shared_memory_path_every_dtype(shm, dtype):
    import os

    t = _make(dtype, shape=(1024, 600))  # >= 1 MiB for most dtypes
    frames = pack({"t": t, "small": torch.ones(2)}, shm)
    big = t.numel() * t.element_size() >= 2**20
    assert len(frames) == (1 if big else 2) + 1  # the small tensor still travels out of band
    assert len(os.listdir(shm)) == (1 if big else 0)
    back = unpack(frames)
    assert back["t"].dtype == dtype and torch.equal(back["t"], t)
    assert os.listdir(shm) == []  # the reader removed the file
    back["t"].view(-1)[0] = 0  # ours to write


def test_shared_memory_for_several_readers(shm):
    import os

    t = torch.randn(2**19)
    files: list[str] = []
    frames = pack(t, shm, files)
    assert len(files) == 1 and os.path.exists(files[0])
    a, b = unpack(frames), unpack(frames)  # two ranks read the same push
    a += 1  # copy-on-write: the other reader's tensor is untouched
    assert torch.equal(b, t) and torch.equal(a, t + 1)


def test_shared_memory_falls_back_when_there_is_no_room(shm, monkeypatch):
    import os

    class Full:
        f_bavail, f_frsize = 10, 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    t = torch.randn(2**19)
    frames = pack(t, shm)
    assert len(frames) == 2 and os.listdir(shm) == []  # went out of band instead
    assert torch.equal(unpack(frames), t)
