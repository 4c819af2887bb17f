"""Wheels too large for one device call, carried in parts (issue 46; docs/gpu.md, "Carrying wheels in parts").

    python3 bench/gpu_parts.py split .gpu-wheels   # here (scripts/gpu-wheels --pipeline): .gpu-parts/
    python3 bench/gpu_parts.py receive N           # there, one call a part (gpu-check --receive-part N)
    python3 bench/gpu_parts.py assemble            # there, once all are in: .gpu-staging/wheels/*.whl
    python3 bench/gpu_parts.py rehearse            # here (scripts/gpu-check --dry-run --parts)

A device call carries the working tree plus the paths named in ``carry``, 64 MiB in all, and keeps the
ignored paths a previous call left while the machine stays warm. So the wheels go as one tar archive
split into numbered parts of at most 64 MiB less the working tree less a margin, each carried by its own
call with the manifest; each part is verified on arrival and moved into ``.gpu-staging/``, which later
calls find again. A call that finds an earlier part missing is on a fresh machine: it says so in one
line and exits 3, and the caller starts over from part 1.

Standard library only: it runs on the GPU machine's image before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
CARRY_LIMIT = 64 * MiB  # what one device call carries: working tree, shared/ and the carried paths
# Room left beside the tree and the part: the manifest (a few KiB) and files the tree gains between
# scripts/gpu-wheels and the calls (results, a commit or two); `rehearse` checks the fit again.
MARGIN = 2 * MiB
PARTS = ".gpu-parts"  # written here, carried one part per call (git-ignored)
STAGING = ".gpu-staging"  # there: verified parts, then the wheels; kept between calls while warm
MANIFEST = "manifest.json"
ARCHIVE = "wheels.tar"

OK, NOT_CARRIED, FRESH, DAMAGED = 0, 2, 3, 4  # exit codes; FRESH: start over from part 1


class PartsError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def part_name(n: int) -> str:
    return f"part-{n:02d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 * MiB):
            h.update(chunk)
    return h.hexdigest()


def tree_bytes(root: Path = ROOT) -> int:
    """The working tree as the device tool carries it: tracked and untracked-not-ignored files, plus
    shared/ where the checkout has one (ignored or not)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    files = {root / p for p in out.decode().split("\0") if p}
    shared = root / "shared"
    if shared.is_dir():
        files |= {p for p in shared.rglob("*") if p.is_file() or p.is_symlink()}
    return sum(p.lstat().st_size for p in files if p.exists() or p.is_symlink())


def part_size_for(tree: int, limit: int = CARRY_LIMIT, margin: int = MARGIN) -> int:
    """The largest whole-MiB part that travels beside ``tree`` bytes of working tree."""
    size = (limit - tree - margin) // MiB * MiB
    if size < 8 * MiB:
        raise PartsError(
            f"gpu-parts: the working tree is {tree / MiB:.1f} MiB: too little of the {limit / MiB:.0f} MiB "
            f"a call carries is left for parts (ignore or remove large files)",
            NOT_CARRIED,
        )
    return size


def split(
    wheel_dir: Path, parts_dir: Path, part_size: int, *, tree: int | None = None, margin: int = MARGIN
) -> dict[str, Any]:
    """Tar ``wheel_dir``'s wheels, cut the archive into ``part_size`` parts with a manifest."""
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise PartsError(f"gpu-parts: no wheels in {wheel_dir}", NOT_CARRIED)
    if parts_dir.exists():
        shutil.rmtree(parts_dir)
    parts_dir.mkdir(parents=True)
    archive = parts_dir / ARCHIVE
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:  # the wheels are compressed
        for w in wheels:
            tar.add(w, arcname=f"wheels/{w.name}", recursive=False)
    whole = hashlib.sha256()
    parts: list[dict[str, Any]] = []
    with open(archive, "rb") as src:
        while data := src.read(part_size):
            whole.update(data)
            name = part_name(len(parts) + 1)
            (parts_dir / name).write_bytes(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "archive": ARCHIVE,
        "size": archive.stat().st_size,
        "sha256": whole.hexdigest(),
        "part_size": part_size,
        "limit": CARRY_LIMIT,
        "tree": tree,
        "margin": margin,
        "parts": parts,
        "wheels": [{"name": w.name, "size": w.stat().st_size, "sha256": _sha256(w)} for w in wheels],
    }
    archive.unlink()
    (parts_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _missing(staging: Path, manifest: dict[str, Any], upto: int) -> list[str]:
    """Parts 1..upto not in ``staging`` at their manifest size (checked by checksum when they came)."""
    return [
        p["name"]
        for p in manifest["parts"][:upto]
        if not (staging / p["name"]).is_file() or (staging / p["name"]).stat().st_size != p["size"]
    ]


def _fresh(missing: list[str], total: int) -> PartsError:
    return PartsError(
        f"gpu-parts: {', '.join(missing)} of {total} missing from {STAGING}/: this is a fresh machine "
        "(the last one went back when idle); start over from part 1",
        FRESH,
    )


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PartsError(f"gpu-parts: no {PARTS}/{MANIFEST} here: carry it with every part", NOT_CARRIED)
    return dict(json.loads(path.read_text()))


def receive(root: Path, n: int) -> str:
    """Verify part ``n`` as it arrived in ``.gpu-parts/``, stage it, and check 1..n-1 are staged."""
    manifest = _load(root / PARTS / MANIFEST)
    total = len(manifest["parts"])
    if not 1 <= n <= total:
        raise PartsError(f"gpu-parts: part {n}? the manifest lists parts 1 to {total}", NOT_CARRIED)
    staging = root / STAGING
    staged = staging / MANIFEST
    if staged.is_file() and json.loads(staged.read_text())["parts"] != manifest["parts"]:
        shutil.rmtree(staging)  # parts of another set, or the same cut another way
    staging.mkdir(exist_ok=True)
    want = manifest["parts"][n - 1]
    arrived = root / PARTS / want["name"]
    if not arrived.is_file():
        raise PartsError(f"gpu-parts: {PARTS}/{want['name']} was not carried: name it in carry", NOT_CARRIED)
    got = _sha256(arrived)
    if arrived.stat().st_size != want["size"] or got != want["sha256"]:
        raise PartsError(
            f"gpu-parts: {want['name']} arrived damaged (sha256 {got[:12]}, expected {want['sha256'][:12]}): "
            "send it again",
            DAMAGED,
        )
    os.replace(arrived, staging / want["name"])
    shutil.copyfile(root / PARTS / MANIFEST, staged)
    if missing := _missing(staging, manifest, n - 1):
        raise _fresh(missing, total)
    nxt = f"next: {part_name(n + 1)}" if n < total else "all here: assemble"
    return (
        f"gpu-parts: {want['name']} of {total} verified (sha256 {got[:12]}, {want['size'] / MiB:.1f} MiB); "
        f"{n} of {total} staged; {nxt}"
    )


def assemble(root: Path) -> tuple[Path, str]:
    """Join the staged parts, check the whole archive, extract its wheels (checked each) there."""
    staging = root / STAGING
    manifest = _load(root / PARTS / MANIFEST if (root / PARTS / MANIFEST).is_file() else staging / MANIFEST)
    total = len(manifest["parts"])
    if missing := _missing(staging, manifest, total):
        raise _fresh(missing, total)
    archive = staging / manifest["archive"]
    whole = hashlib.sha256()
    with open(archive, "wb") as dst:
        for p in manifest["parts"]:
            with open(staging / p["name"], "rb") as src:
                while chunk := src.read(4 * MiB):
                    whole.update(chunk)
                    dst.write(chunk)
    if whole.hexdigest() != manifest["sha256"]:
        archive.unlink()
        raise PartsError(
            f"gpu-parts: the joined archive's sha256 {whole.hexdigest()[:12]} is not the manifest's "
            f"{manifest['sha256'][:12]}: start over from part 1",
            DAMAGED,
        )
    wheels = staging / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        if any(not n.startswith("wheels/") or ".." in n for n in names):
            raise PartsError("gpu-parts: the archive holds paths outside wheels/", DAMAGED)
        # names checked above; the "data" filter too where this Python has it (3.11.4+, 3.12)
        safe: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(staging, **safe)
    archive.unlink()
    for w in manifest["wheels"]:
        if _sha256(wheels / w["name"]) != w["sha256"]:
            raise PartsError(f"gpu-parts: {w['name']} differs from the manifest's", DAMAGED)
    size = sum(w["size"] for w in manifest["wheels"])
    return wheels, (
        f"gpu-parts: joined {total} parts, archive sha256 {manifest['sha256'][:12]} verified; "
        f"{len(manifest['wheels'])} wheels ({size / MiB:.1f} MiB) verified in {STAGING}/wheels/"
    )


def wheel_metadata(wheel: Path) -> str:
    """'Name Version' from a wheel's METADATA: the wheel opens as a zip and names itself."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        fields = dict(line.split(": ", 1) for line in z.read(meta).decode().splitlines()[:20] if ": " in line)
    return f"{fields.get('Name')} {fields.get('Version')}"


def _carry(root: Path, device: Path, n: int) -> None:
    """One call's carry: the manifest and part ``n`` land in the device's .gpu-parts/ (a hard link here
    where it can, so rehearsing 420 MiB copies little); ignored paths already there stay."""
    (device / PARTS).mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, part_name(n)):
        dst = device / PARTS / name
        dst.unlink(missing_ok=True)
        try:
            os.link(root / PARTS / name, dst)
        except OSError:
            shutil.copyfile(root / PARTS / name, dst)


def _cli(device: Path, *args: str) -> tuple[int, str]:
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--root", str(device), *args],
        capture_output=True,
        text=True,
    )
    return out.returncode, (out.stdout + out.stderr).strip()


def rehearse(root: Path = ROOT, *, list_wheels: bool = True, say: Any = print) -> int:
    """The device side, here: every part carried into a fresh machine one call at a time, a machine
    that went back (a part missing), a damaged part, then the join and the wheels checked."""
    manifest = _load(root / PARTS / MANIFEST)
    total = len(manifest["parts"])
    tree = tree_bytes(root)
    biggest = max(p["size"] for p in manifest["parts"])
    call = tree + biggest + (root / PARTS / MANIFEST).stat().st_size
    say(
        f"rehearse: {len(manifest['wheels'])} wheels, archive {manifest['size'] / MiB:.1f} MiB in {total} "
        f"parts of at most {manifest['part_size'] / MiB:.0f} MiB; a call carries {call / MiB:.1f} MiB "
        f"(tree {tree / MiB:.1f} MiB now, {(manifest['tree'] or 0) / MiB:.1f} MiB when split) of "
        f"{CARRY_LIMIT / MiB:.0f} MiB"
    )
    if call > CARRY_LIMIT:
        say("rehearse: FAIL: a call would carry more than the limit: rerun scripts/gpu-wheels --pipeline")
        return 1
    failures = 0

    def expect(what: str, code: int, want: int, line: str) -> None:
        nonlocal failures
        ok = code == want and len(line.splitlines()) == 1
        failures += not ok
        say(f"  {'ok  ' if ok else 'FAIL'} {what}: exit {code} (want {want}): {line}")

    with tempfile.TemporaryDirectory(prefix="gpu-parts-rehearse-") as tmp:
        warm, fresh = Path(tmp) / "warm", Path(tmp) / "fresh"
        if total > 1:  # the machine went back after part 1: part 2 lands on a fresh one
            _carry(root, fresh, 2)
            code, line = _cli(fresh, "receive", "2")
            expect(f"{part_name(2)} on a fresh machine", code, FRESH, line)
        _carry(root, fresh, 1)  # a damaged part: one byte changed on the way (in a copy, not the link)
        shutil.copyfile(root / PARTS / part_name(1), fresh / PARTS / "copy")
        os.replace(fresh / PARTS / "copy", fresh / PARTS / part_name(1))
        with open(fresh / PARTS / part_name(1), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        code, line = _cli(fresh, "receive", "1")
        expect(f"{part_name(1)} damaged on the way", code, DAMAGED, line)
        for n in range(1, total + 1):
            _carry(root, warm, n)
            code, line = _cli(warm, "receive", str(n))
            expect(f"call {n} of {total}", code, OK, line)
        hold = warm / STAGING / part_name(total)  # assemble with the last part gone: a fresh machine
        os.rename(hold, hold.with_suffix(".held"))
        code, line = _cli(warm, "assemble")
        expect("assemble with a part missing", code, FRESH, line)
        os.rename(hold.with_suffix(".held"), hold)
        code, line = _cli(warm, "assemble")
        expect("assemble", code, OK, line)
        if code == OK and list_wheels:
            for w in manifest["wheels"]:
                say(f"    {w['name']}: {wheel_metadata(warm / STAGING / 'wheels' / w['name'])}")
    say(
        f"rehearse: {'every step as expected' if not failures else f'{failures} step(s) FAILED'}; "
        "installing the wheels is left to the GPU machine (scripts/gpu-check --from-parts)"
    )
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_parts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this one)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="tar a wheel directory into .gpu-parts/ (here)")
    sp.add_argument("wheel_dir", type=Path)
    sp.add_argument("--part-mib", type=int, help="part size (default: 64 MiB less the tree less 2 MiB)")
    rp = sub.add_parser("receive", help="verify and stage one arrived part (there)")
    rp.add_argument("n", type=int)
    sub.add_parser("assemble", help="join, verify and extract the wheels (there)")
    sub.add_parser("rehearse", help="the device side, here, on the parts in .gpu-parts/")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.cmd == "split":
            tree = tree_bytes(root)
            size = args.part_mib * MiB if args.part_mib else part_size_for(tree)
            m = split(args.wheel_dir, root / PARTS, size, tree=tree)
            print(
                f"gpu-parts: {len(m['wheels'])} wheels, archive {m['size'] / MiB:.1f} MiB "
                f"(sha256 {m['sha256'][:12]}) in {len(m['parts'])} parts of at most {size / MiB:.0f} MiB "
                f"(64 MiB less the tree's {tree / MiB:.1f} MiB less a {MARGIN / MiB:.0f} MiB margin) "
                f"in {PARTS}/"
            )
        elif args.cmd == "receive":
            print(receive(root, args.n))
        elif args.cmd == "assemble":
            print(assemble(root)[1])
        else:
            return rehearse(root)
    except PartsError as exc:
        print(exc)
        return exc.code
    return OK


if __name__ == "__main__":
    sys.exit(main())
