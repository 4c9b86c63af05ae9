"""JAX's persistent compilation cache carried from one lent GPU's device call to the next.

Compiling is most of a GPU benchmark call's time (the embedded pair's decode programs take 7-11 s
each on an H200 against well under a second of timed decoding), and every lent machine starts bare.
A call can hand its cache back in parts that fit what a device call returns (`pack`), and a later
call carries them and unpacks them first (`unpack`): JAX's cache key names the program (its HLO
without debug information), the jax version, the XLA flags, the platform and the devices, so an
entry is read only where it is the same program for the same kind of machine; anything else
misses and is compiled as before. The key also holds the cache's own path (JAX hands XLA a folder
inside it for GPU autotuning results, and that compile option is hashed), so a part is unpacked at
the path it was packed from (gpu_adaptive.sh's default, the same on every machine); `unpack` warns
where the paths differ. Measured on the 2-core CPU (sd:1:1, one prompt, 8 tokens): the spec's
programs compiled in 58 s, loaded in 14 s (AR's 3.96 s -> 0.41 s, "auto"'s 28.4 s -> 3.0 s); at
another path, every entry missed.

    python benchmarks/jit_cache_parts.py pack CACHE_DIR OUT_DIR [--mb 15] [--part-mb 15]
    python benchmarks/jit_cache_parts.py unpack PARTS_DIR CACHE_DIR

`pack` writes OUT_DIR/jit_cache_N.tgz, at most --mb MiB of entries in all (the carried working
tree is limited to 64 MiB with the repository in it), oldest entries first: the call's first specs
are its priority ones. Entries are already compressed by JAX, so a part's size is near its
entries'. Only regular files whose names look like cache entries are packed: JAX's executables, and
XLA's GPU autotuning results in the cache's AUTOTUNE_DIR (which spare a changed program's fusions
their timing runs where its executable misses).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tarfile

MIB = 1 << 20
PART_NAME = "jit_cache_{}.tgz"
SOURCE_HEADER = "ssd_jax.cache_dir"   # a part's PAX header: the path its entries were packed from
# JAX names an entry "<module name>-<sha256 hex>" with "-cache" (and "-atime" for its LRU) appended.
ENTRY = re.compile(r"^[\w.]+-[0-9a-f]{64}(-cache|-atime)?$")
AUTOTUNE_DIR = "xla_gpu_per_fusion_autotune_cache_dir"
AUTOTUNE_ENTRY = re.compile(r"^[\w.=+-]+$")


def is_entry(relative_path: str) -> bool:
    """Whether a path relative to the cache directory names an entry (no other path is packed or
    unpacked: a part cannot write outside the cache or over anything else)."""
    head, _, name = relative_path.rpartition("/")
    if head == "":
        return bool(ENTRY.match(name))
    return head == AUTOTUNE_DIR and bool(AUTOTUNE_ENTRY.match(name)) and name not in (".", "..")


def cache_entries(cache_dir: str) -> list[str]:
    """The entry files of `cache_dir` (relative paths), oldest first (by modification time, then name)."""
    names = os.listdir(cache_dir)
    autotune = os.path.join(cache_dir, AUTOTUNE_DIR)
    if os.path.isdir(autotune):
        names += [f"{AUTOTUNE_DIR}/{n}" for n in os.listdir(autotune)]
    names = [n for n in names if is_entry(n) and os.path.isfile(os.path.join(cache_dir, n))]
    return sorted(names, key=lambda n: (os.path.getmtime(os.path.join(cache_dir, n)), n))


def plan_parts(sizes: list[tuple[str, int]], budget: int, part_size: int) -> tuple[list[list[str]], int]:
    """Names grouped into parts of at most `part_size` bytes, `budget` bytes in all, in the given
    order; an entry that does not fit the budget's rest is skipped (a later smaller one may fit).
    Returns (parts, bytes left out)."""
    parts: list[list[str]] = [[]]
    part_bytes = used = left_out = 0
    for name, size in sizes:
        if size > part_size or used + size > budget:
            left_out += size
            continue
        if part_bytes + size > part_size:
            parts.append([])
            part_bytes = 0
        parts[-1].append(name)
        part_bytes += size
        used += size
    return [p for p in parts if p], left_out


def pack(cache_dir: str, out_dir: str, budget_mb: float, part_mb: float) -> list[str]:
    """Writes the parts; returns their paths. A part is written under a temporary name and renamed."""
    if not os.path.isdir(cache_dir):
        print(f"jit_cache_parts: no cache directory {cache_dir!r}: nothing packed")
        return []
    names = cache_entries(cache_dir)
    sizes = [(n, os.path.getsize(os.path.join(cache_dir, n))) for n in names]
    parts, left_out = plan_parts(sizes, int(budget_mb * MIB), int(part_mb * MIB))
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, part in enumerate(parts):
        path = os.path.join(out_dir, PART_NAME.format(i))
        with tarfile.open(path + ".tmp", "w:gz", compresslevel=1, format=tarfile.PAX_FORMAT,
                          pax_headers={SOURCE_HEADER: os.path.abspath(cache_dir)}) as tar:
            for name in part:
                tar.add(os.path.join(cache_dir, name), arcname=name)
        os.replace(path + ".tmp", path)
        paths.append(path)
    kept = sum(len(p) for p in parts)
    print(f"jit_cache_parts: {kept} of {len(names)} entries in {len(paths)} part(s)"
          f" ({sum(os.path.getsize(p) for p in paths) / MIB:.1f} MiB), {left_out / MIB:.1f} MiB left out")
    return paths


def unpack(parts_dir: str, cache_dir: str) -> int:
    """Extracts every part of `parts_dir` into `cache_dir` (entries only: a link, or a member whose
    path is not an entry's, is skipped). Returns the entries extracted."""
    os.makedirs(os.path.join(cache_dir, AUTOTUNE_DIR), exist_ok=True)
    count = 0
    for path in sorted(glob.glob(os.path.join(parts_dir, PART_NAME.format("*")))):
        with tarfile.open(path, "r:gz") as tar:
            members = tar.getmembers()   # reads the global header too
            source = tar.pax_headers.get(SOURCE_HEADER)
            if source and source != os.path.abspath(cache_dir):
                print(f"jit_cache_parts: warning: {path} was packed from {source}, not {cache_dir}:"
                      " JAX's keys hold the cache's path, so its entries will miss", file=sys.stderr)
            for member in members:
                if not (member.isfile() and is_entry(member.name)):
                    print(f"jit_cache_parts: skipped {member.name!r} in {path}", file=sys.stderr)
                    continue
                target = os.path.join(cache_dir, member.name)
                with open(target + ".tmp", "wb") as f:
                    f.write(tar.extractfile(member).read())
                os.replace(target + ".tmp", target)
                count += 1
    print(f"jit_cache_parts: {count} entries from {parts_dir} into {cache_dir}")
    return count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("pack", help="cache directory -> parts")
    p.add_argument("cache_dir")
    p.add_argument("out_dir")
    p.add_argument("--mb", type=float, default=15.0, help="MiB of entries in all (default 15)")
    p.add_argument("--part-mb", type=float, default=15.0, help="MiB of entries a part (default 15)")
    u = verbs.add_parser("unpack", help="parts -> cache directory")
    u.add_argument("parts_dir")
    u.add_argument("cache_dir")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        pack(args.cache_dir, args.out_dir, args.mb, args.part_mb)
    else:
        unpack(args.parts_dir, args.cache_dir)


if __name__ == "__main__":
    main()
