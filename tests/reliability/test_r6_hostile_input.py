"""R6 hostile input: every bad file is refused at submit with its reason, or — when it turns bad after
submit or breaks only when decoded — its job fails as an input error after exactly one attempt. Valid
odd formats succeed, the worker keeps going (the same child throughout), and its memory stays bounded
(a 30000x30000 decompression bomb is refused by its header, never decoded)."""

from __future__ import annotations

import contextlib
import io
import re
import struct
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageDraw
from reliability_harness import FAST_JOB, check_invariants, record, rss_kib

BOMB_SIDE = 30_000


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def decompression_bomb() -> bytes:
    """A complete, valid 30000x30000 1-bit PNG of ~100 KiB that decodes to 900 megapixels."""
    header = struct.pack(">IIBBBBB", BOMB_SIDE, BOMB_SIDE, 1, 0, 0, 0, 0)
    packer = zlib.compressobj(9)
    row = b"\x00" * (1 + BOMB_SIDE // 8)
    data = b"".join(packer.compress(row) for _ in range(BOMB_SIDE)) + packer.flush()
    return (
        b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")
    )


def page(size=(160, 200), mode="RGB") -> Image.Image:
    im = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(im)
    for y in range(0, size[1], 7):  # enough texture that a truncated file really misses data
        draw.line((0, y, size[0], (y * 3) % size[1]), fill=(y % 256, 40, 200))
    return im.convert(mode) if mode != "RGB" else im


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt, **kw)
    return out.getvalue()


def hostile_root(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "images"
    root.mkdir()
    png, jpeg = encoded(page(), "PNG"), encoded(page((400, 400)), "JPEG", quality=95)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90° to display
    palette = page().convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 0
    files = {
        # refused at submit
        "empty.png": b"",
        "text.png": b"this is not an image\n",
        "notes.txt": b"plain text with the wrong extension\n",
        "header-only.png": png[:20],
        "bomb.png": decompression_bomb(),
        "vector.eps": b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
        # accepted at submit (the header is fine), refused by the worker when decoded
        "truncated.png": png[: len(png) * 6 // 10],
        "truncated.jpg": jpeg[: len(jpeg) // 2],
        # valid at submit, then replaced or removed before a worker runs them
        "later-missing.png": png,
        "later-bomb.png": png,
        "later-text.png": png,
        # valid odd formats: these must succeed
        "one-pixel.png": encoded(Image.new("RGB", (1, 1), "black"), "PNG"),
        "cmyk.jpg": encoded(page(mode="CMYK"), "JPEG"),
        "gray16.png": encoded(Image.new("I;16", (120, 90), 40000), "PNG"),
        "palette-alpha.png": encoded(palette, "PNG"),
        "exif-rotated.jpg": encoded(page((200, 120)), "JPEG", exif=exif.tobytes()),
        "png-named.jpg": png,
        "päge ünï 名前 1.png": png,
        "anim.gif": encoded(page(), "GIF"),
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (tmp_path / "outside.png").write_bytes(png)
    (root / "escape.png").symlink_to(tmp_path / "outside.png")
    return root, files


REFUSED_AT_SUBMIT = {
    "empty.png": "empty",
    "text.png": "not an image",
    "notes.txt": "not an image",
    "header-only.png": "",
    "bomb.png": "decompression bomb",
    "vector.eps": "format EPS is not allowed",
    "../outside.png": "outside the root",
    "escape.png": "through a symlink",
    "missing.png": "no such file",
}
FAILED_IN_WORKER = {
    "truncated.png": "truncated",
    "truncated.jpg": "truncated",
    "later-missing.png": "no such file",
    "later-bomb.png": "decompression bomb",
    "later-text.png": "not an image",
}
VALID = ["one-pixel.png", "cmyk.jpg", "gray16.png", "palette-alpha.png", "exif-rotated.jpg", "png-named.jpg",
         "päge ünï 名前 1.png", "anim.gif"]  # fmt: skip


@pytest.mark.parametrize("concurrency", [1, 3], ids=["batch-1", "batched"])
def test_r6_hostile_input(new_farm, tmp_path, concurrency):
    """At concurrency 3 the pages are prepared in the batch's page processes: a page that breaks there fails its
    job alone, the batch and the child go on."""
    root, _ = hostile_root(tmp_path)
    listing = tmp_path / "hostile.txt"
    lines = [*REFUSED_AT_SUBMIT, *FAILED_IN_WORKER, *VALID]
    listing.write_text("\n".join(lines) + "\n", encoding="utf-8")
    farm = new_farm()

    refused = farm.dsocr("submit", str(listing), "--root", str(root), *FAST_JOB)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    for number, line in enumerate(lines, start=1):
        if line in REFUSED_AT_SUBMIT:
            reported = next((r for r in refused.stderr.splitlines() if f":{number}: {line}: " in r), None)
            assert reported is not None and REFUSED_AT_SUBMIT[line] in reported, (line, refused.stderr)
        else:
            assert f":{number}: " not in refused.stderr, (line, refused.stderr)
    assert farm.backlog() == (0, 0)  # nothing enqueued

    run_id = farm.submit(listing, "--root", str(root), "--skip-invalid", *FAST_JOB, "--concurrency", str(concurrency))
    (root / "later-missing.png").unlink()
    (root / "later-bomb.png").write_bytes(decompression_bomb())
    (root / "later-text.png").write_bytes(b"no longer an image")

    worker = farm.start_worker()
    children: set[int] = set()
    peak_kib = [0]

    def watch(_jobs) -> None:
        for pid in worker.child_pids():
            children.add(pid)
            with contextlib.suppress(OSError, LookupError):
                peak_kib[0] = max(peak_kib[0], rss_kib(pid, "VmHWM"))

    farm.wait_until_final(run_id, timeout=240, tick=watch, poll=0.2)
    watch(None)
    tally = check_invariants(farm, run_id, max_attempts=3)

    jobs = {j.image: j for j in farm.jobs(run_id)}
    assert set(jobs) == set(FAILED_IN_WORKER) | set(VALID)
    for name, reason in FAILED_IN_WORKER.items():
        job = jobs[name]
        assert (job.state, job.attempts, job.last_error_class) == ("failed", 1, "InputError"), (
            name,
            job.state,
        )
        assert reason in job.last_error_message, (name, job.last_error_message)
    for name in VALID:
        assert (jobs[name].state, jobs[name].attempts) == ("done", 1), (name, jobs[name].last_error_message)
    # The worker kept going: one child did every job, no child was lost. Children are counted from their
    # start lines: the parent's process list also shows short-lived helpers it spawns (e.g. `uname -p`).
    started = set(re.findall(r"child \d+ \(pid (\d+)\) on cpu", farm.logs()))
    assert len(started) == 1 and worker.alive(), (started, children)
    assert "WorkerLostError" not in farm.logs()
    # Bounded memory: the bomb would need ~2.7 GB as RGB; the child peaks at what the model needs.
    assert 0 < peak_kib[0] < 1_500_000, peak_kib
    if concurrency > 1:  # the valid pages decoded in the batch
        assert farm.logs().count("decoded in the batch") == len(VALID)
    record(f"R6 hostile input (concurrency {concurrency})", workers=1, faults=f"{len(REFUSED_AT_SUBMIT)} refused at submit, "
           f"{len(FAILED_IN_WORKER)} failing in the worker, {len(VALID)} valid odd files",
           lost=len(VALID) - tally.done, duplicated=tally.duplicates, child_peak_rss_mib=peak_kib[0] // 1024,
           tally=tally)  # fmt: skip
