"""benchmarks/jit_cache_parts.py: a compilation cache handed back in parts and unpacked elsewhere."""

import io
import os
import tarfile

from benchmarks import jit_cache_parts as parts

KEY = "0123456789abcdef" * 4


def _entry(directory, name, size, mtime):
    path = os.path.join(directory, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    os.utime(path, (mtime, mtime))
    return path


def test_plan_parts_keeps_order_part_size_and_budget():
    sizes = [("a", 6), ("b", 6), ("c", 9), ("d", 3), ("e", 20)]
    planned, left_out = parts.plan_parts(sizes, budget=16, part_size=10)
    assert planned == [["a"], ["b", "d"]]  # c would pass the budget, e is larger than a part
    assert left_out == 9 + 20


def test_round_trip_oldest_first_within_the_budget(tmp_path, capsys):
    cache, out, other = tmp_path / "cache", tmp_path / "out", tmp_path / "other"
    old = _entry(cache, f"jit_decode-{KEY}-cache", 3000, mtime=1000)
    tuned = _entry(cache, f"{parts.AUTOTUNE_DIR}/fusion_1.textproto", 200, mtime=1500)
    _entry(cache, f"jit_step-{KEY}-cache", 3000, mtime=2000)  # newest: past the budget
    _entry(cache, "notes.txt", 10, mtime=500)  # not an entry
    written = parts.pack(str(cache), str(out), budget_mb=4000 / parts.MIB, part_mb=1)
    assert [os.path.basename(p) for p in written] == ["jit_cache_0.tgz"]
    assert parts.unpack(str(out), str(other)) == 2
    for path in (old, tuned):
        name = os.path.relpath(path, cache)
        assert (other / name).read_bytes() == open(path, "rb").read()
    assert sorted(os.listdir(other)) == sorted([f"jit_decode-{KEY}-cache", parts.AUTOTUNE_DIR])
    assert "entries will miss" in capsys.readouterr().err  # unpacked at another path than packed from
    parts.unpack(str(out), str(cache))
    assert "entries will miss" not in capsys.readouterr().err


def test_unpack_skips_members_that_are_not_entries(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    with tarfile.open(out / "jit_cache_0.tgz", "w:gz") as tar:
        for name in (f"../jit_x-{KEY}-cache", f"sub/jit_x-{KEY}-cache", "evil", f"jit_ok-{KEY}-cache"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"data"))
        link = tarfile.TarInfo(f"jit_link-{KEY}-cache")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    assert parts.unpack(str(out), str(cache)) == 1
    assert sorted(os.listdir(cache)) == sorted([f"jit_ok-{KEY}-cache", parts.AUTOTUNE_DIR])
    assert not (tmp_path / f"jit_x-{KEY}-cache").exists()
