"""Ratios, targets, markdown and the plot for ``run.py``'s results (plain data in, text out)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 2**20

NAMES = {
    "stalwart_sync": "stalwart sync",
    "stalwart_async": "stalwart async",
    "torch_save": "torch.save + fsync + rename",
    "dcp_save": "dcp.save + fsync",
    "dcp_async_thread": "dcp.async_save (thread)",
    "dcp_async_process": "dcp.async_save (process)",
}
TRAIN_NAMES = {
    **NAMES,
    "floor_async": "*ref: memcpy + raw write in a thread (async floor)*",
    "floor_async_xxh3": "*ref: the same, hashing every byte as it writes (floor with checksum)*",
}
RESTORE_NAMES = {
    "stalwart_sync": "stalwart restore (verified)",
    "torch_save": "torch.load(weights_only=True)",
    "dcp_save": "dcp.load",
}
STALL_PEERS = ("torch_save", "dcp_save", "dcp_async_thread", "dcp_async_process")
SYNC_PEERS = ("torch_save", "dcp_save")
ASYNC_PEERS = ("dcp_async_thread", "dcp_async_process")
RESTORE_PEERS = ("torch_save", "dcp_save")

TARGET_STALL_X_MEMCPY = 1.5
TARGET_PERSIST_X_RAW = 0.8
TARGET_RESTORE_X_RAW = 0.8
TARGET_TRAIN_OVERHEAD = 0.05
TARGET_WRITER_CPU_X_RAW = 1.5
"""The CPU time of one save (the writer's work: collect, write, hash, fsync, commit) over a raw write's."""
TARGET_TRAIN_X_FLOOR = 2.0
"""Training overhead of async saves over the overhead of the physical floor (memcpy + raw write thread)."""
TRAIN_REGIME_TORCH_SAVE = 0.30
TRAIN_FLOOR_EVERY = 5
"""The checkpoint interval (steps) the goal against the physical floor is stated for; the
rows of other intervals are shown, not judged (at every 20 steps the floor's overhead is a
few percent, within the loop's noise, and a ratio to it says nothing)."""


def _ok(m: dict[str, Any] | None) -> bool:
    return bool(m) and "error" not in m


def _div(a: float | None, b: float | None) -> float:
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


# ------------------------------------------------------------------- analysis


def analyze(results: dict[str, Any]) -> None:
    """Add ``ratios`` to every size and a ``targets`` list to ``results`` (in place)."""
    targets: list[dict[str, Any]] = []
    for entry in results["sizes"]:
        refs, methods = entry["references"], entry["methods"]
        r: dict[str, Any] = {
            "stall_x_memcpy": {},
            "persist_x_raw_write": {},
            "restore_cold_x_raw_read": {},
            "restore_warm_x_raw_read": {},
            "stalwart_async_stall_over_peer": {},
            "stalwart_sync_save_over_peer": {},
            "stalwart_async_save_over_peer": {},
            "stalwart_restore_cold_over_peer": {},
            "stalwart_restore_warm_over_peer": {},
        }
        entry["ratios"] = r
        if "error" in refs:
            continue
        for name, m in methods.items():
            if not _ok(m):
                continue
            r["stall_x_memcpy"][name] = _div(m["stall_s"], refs["memcpy_s"])
            # Both sides move the same state bytes, so the time ratio is the throughput ratio.
            r["persist_x_raw_write"][name] = _div(refs["raw_write_s"], m["e2e_s"])
            if _ok(m.get("restore")):
                rs = m["restore"]
                r["restore_cold_x_raw_read"][name] = _div(
                    refs["raw_read_cold_s"], rs["restore_cold_s"]
                )
                r["restore_warm_x_raw_read"][name] = _div(
                    refs["raw_read_warm_s"], rs["restore_warm_s"]
                )
        sa, ss = methods.get("stalwart_async"), methods.get("stalwart_sync")
        for peer in STALL_PEERS:
            if _ok(sa) and _ok(methods.get(peer)):
                r["stalwart_async_stall_over_peer"][peer] = _div(
                    sa["stall_s"], methods[peer]["stall_s"]
                )
        for peer in SYNC_PEERS:
            if _ok(ss) and _ok(methods.get(peer)):
                r["stalwart_sync_save_over_peer"][peer] = _div(ss["e2e_s"], methods[peer]["e2e_s"])
        for peer in ASYNC_PEERS:
            if _ok(sa) and _ok(methods.get(peer)):
                r["stalwart_async_save_over_peer"][peer] = _div(sa["e2e_s"], methods[peer]["e2e_s"])
        for peer in RESTORE_PEERS:
            if _ok(ss) and _ok(methods.get(peer)) and "restore" in methods[peer]:
                mine, theirs = ss["restore"], methods[peer]["restore"]
                r["stalwart_restore_cold_over_peer"][peer] = _div(
                    mine["restore_cold_s"], theirs["restore_cold_s"]
                )
                r["stalwart_restore_warm_over_peer"][peer] = _div(
                    mine["restore_warm_s"], theirs["restore_warm_s"]
                )

        size = entry["label"]
        if _ok(sa):
            x = r["stall_x_memcpy"]["stalwart_async"]
            b = sa.get("breakdown", {})
            targets.append(
                _target(
                    "async stall <= 1.5x memcpy",
                    size,
                    x,
                    f"<= {TARGET_STALL_X_MEMCPY}x",
                    x <= TARGET_STALL_X_MEMCPY,
                    f"stall {_ms(sa['stall_s'])}; its parts timed alone: {_stall_parts(b)}; "
                    f"memcpy {_ms(refs['memcpy_s'])}, "
                    f"clone into fresh memory {_ms(refs['clone_s'])}",
                )
            )
            peers = {p: v for p, v in r["stalwart_async_stall_over_peer"].items()}
            if peers:
                worst = max(peers, key=lambda p: peers[p])
                targets.append(
                    _target(
                        "async stall below every peer's stall",
                        size,
                        peers[worst],
                        "< 1x the fastest peer",
                        all(v < 1 for v in peers.values()),
                        "stalwart async ÷ "
                        + ", ".join(f"{NAMES[p]} {v:.2f}x" for p, v in peers.items()),
                    )
                )
        if _ok(ss):
            x = r["persist_x_raw_write"]["stalwart_sync"]
            ev = ss["events"]
            targets.append(
                _target(
                    "persist throughput >= 0.8x raw fsync'd write",
                    size,
                    x,
                    f">= {TARGET_PERSIST_X_RAW}x",
                    x >= TARGET_PERSIST_X_RAW,
                    f"sync save {_ms(ss['e2e_s'])} = write {_ms(ev['write_s'])} + checksum "
                    f"{_ms(ev['checksum_s'])} + commit {_ms(ev['commit_s'])} + state_dict/other "
                    f"{_ms(ss['e2e_s'] - ev['write_s'] - ev['checksum_s'] - ev['commit_s'])}; "
                    f"raw write{_among(refs, 'raw_write_edge_s')} {_ms(refs['raw_write_s'])}"
                    + _against(ss, refs, "raw_write_edge_s", _EDGE_WRITE)
                    + _against(ss, refs, "raw_write_direct_s", _DIRECT_WRITE),
                )
            )
            cpu_x = _div(ss.get("cpu_s"), refs.get("raw_write_cpu_s"))
            targets.append(
                _target(
                    "writer CPU time <= 1.5x a raw write's",
                    size,
                    cpu_x,
                    f"<= {TARGET_WRITER_CPU_X_RAW}x",
                    cpu_x <= TARGET_WRITER_CPU_X_RAW if math.isfinite(cpu_x) else None,
                    f"one sync save {_ms(ss.get('cpu_s'))} of CPU (every thread of the process) vs "
                    f"raw write + fsync {_ms(refs.get('raw_write_cpu_s'))}"
                    + _checksummed_floor(refs)
                    + _per_call_cpu(results, "stalwart_sync", ss.get("cpu_s"), refs),
                )
            )
            if _ok(sa):
                # What a training job pays per checkpoint: the async save, whose writer sends
                # the page-aligned staging buffers past the page cache (O_DIRECT).
                acpu_x = _div(sa.get("cpu_s"), refs.get("raw_write_cpu_s"))
                targets.append(
                    _target(
                        "async save's CPU time (staging copy included) <= 1.5x a raw write's",
                        size,
                        acpu_x,
                        f"<= {TARGET_WRITER_CPU_X_RAW}x",
                        acpu_x <= TARGET_WRITER_CPU_X_RAW if math.isfinite(acpu_x) else None,
                        f"one async save {_ms(sa.get('cpu_s'))} of CPU (the training thread's "
                        f"staging copy and the background writer) vs raw write + fsync "
                        f"{_ms(refs.get('raw_write_cpu_s'))}"
                        + _async_cpu_split(sa, refs)
                        + _staged_floor(refs)
                        + _per_call_cpu(results, "stalwart_async", sa.get("cpu_s"), refs),
                    )
                )
            if _ok(ss.get("restore")):
                rs = ss["restore"]
                cold = r["restore_cold_x_raw_read"]["stalwart_sync"]
                warm = r["restore_warm_x_raw_read"]["stalwart_sync"]
                # The goal holds for every case: cold and warm, into live objects and
                # into fresh ones; the row shows the worst and passes only if it does.
                cases = {"cold": cold, "warm": warm}
                if rs.get("restore_fresh_cold_s"):
                    cases["fresh objects, cold"] = _div(
                        refs["raw_read_cold_s"], rs["restore_fresh_cold_s"]
                    )
                    cases["fresh objects, warm"] = _div(
                        refs["raw_read_warm_s"], rs["restore_fresh_warm_s"]
                    )
                worst = min(cases, key=lambda k: cases[k])
                drop = rs.get("page_cache_drop") and refs.get("page_cache_drop")
                targets.append(
                    _target(
                        "restore (verified) >= 0.8x raw read",
                        size,
                        cases[worst],
                        f">= {TARGET_RESTORE_X_RAW}x (cold and warm, live and fresh objects)",
                        cases[worst] >= TARGET_RESTORE_X_RAW,
                        f"worst case {worst}; cold {cold:.2f}x ({_ms(rs['restore_cold_s'])} vs raw "
                        f"{_ms(refs['raw_read_cold_s'])}); "
                        f"warm {warm:.2f}x ({_ms(rs['restore_warm_s'])} vs "
                        f"{_ms(refs['raw_read_warm_s'])})"
                        + _floor_note(refs, rs)
                        + _per_call_restore(results, worst, rs, refs)
                        + ("" if drop else "; page-cache drop did not work, cold = warm"),
                    )
                )
                peak = rs.get("restore_peak_rss_mib")
                if peak is not None:
                    state_mib = entry["bytes"] / MiB
                    targets.append(
                        _target(
                            "restore's peak extra memory <= one checkpoint's size",
                            size,
                            _div(peak, state_mib),
                            "<= 1x",
                            peak <= state_mib,
                            f"peak RSS growth {peak:.0f} MiB while restoring into live objects, "
                            f"in a process of its own; the checkpoint holds {state_mib:.0f} MiB",
                        )
                    )

    training = results.get("training")
    for every in sorted({r["every"] for r in training["runs"]} if training else ()):
        by = {r["variant"]: r for r in training["runs"] if r["every"] == every}
        ta, tt, ts = by.get("stalwart_async"), by.get("torch_save"), by.get("stalwart_sync")
        tf = by.get("floor_async")
        th = by.get("floor_async_xxh3")
        if not (_ok(ta) and _ok(tt)):
            continue
        regime = tt["overhead"] > TRAIN_REGIME_TORCH_SAVE
        targets.append(
            _target(
                "training overhead, async every few steps <= 5% (where torch.save > 30%)",
                f"{_size_of(ta['bytes'])}, every {every}",
                ta["overhead"],
                f"<= {TARGET_TRAIN_OVERHEAD:.0%}",
                ta["overhead"] <= TARGET_TRAIN_OVERHEAD if regime else None,
                f"steps of {_ms(ta['step_s'])}: stalwart async {ta['overhead']:+.1%} "
                f"(blocked in save {ta['blocked_share']:+.1%}, slower steps beside the "
                f"background save {ta['background_share']:+.1%}), stalwart sync "
                f"{ts['overhead'] if _ok(ts) else math.nan:+.1%}, torch.save {tt['overhead']:+.1%}"
                + (
                    f", async floor (memcpy + raw write thread) {tf['overhead']:+.1%}"
                    if _ok(tf)
                    else ""
                )
                + ("" if regime else "; torch.save is not above 30%: outside the target's regime"),
                percent=True,
            )
        )
        side = training.get("side_by_side")
        apart = ""
        if _ok(side) and side.get("every") == every:
            # Side by side in one process (measure.job_train_side_by_side): the target's
            # two overheads from the same moments of the host. From here on ta, tf and th
            # are that run's; the separate runs' figures are told in the note only.
            sv = side["variants"]
            if _ok(sv.get("stalwart_async")) and _ok(sv.get("floor_async")):
                apart = (
                    f"; measured side by side in one process, their segments taking turns "
                    f"({sv['stalwart_async']['rounds']} pairs each); in processes of their own "
                    f"at other times (the table below): stalwart async {ta['overhead']:+.1%}"
                    + (f", floor {tf['overhead']:+.1%}" if _ok(tf) else "")
                )
                ta, tf, th = sv["stalwart_async"], sv["floor_async"], sv.get("floor_async_xxh3")
        if _ok(tf):
            # The floor's writer thread cannot make the training steps beside it faster:
            # when they measured faster (noise), the floor is at least its blocked time
            # (its memcpy in the training thread), and the ratio is taken against that.
            floor, floor_note = tf["overhead"], ""
            blocked = tf.get("blocked_share")
            if isinstance(blocked, float) and blocked > floor:
                floor = blocked
                floor_note = (
                    f"; the floor's steps beside its writer measured "
                    f"{tf['overhead'] - blocked:+.1%} (faster than without it: noise), so the "
                    f"floor is taken as its blocked time alone, {blocked:+.1%}"
                )
            # A floor at or below zero overhead (within noise) gives no ratio: the row
            # stays, unjudged, rather than vanishing from the report.
            x = ta["overhead"] / floor if floor > 0 else math.nan
            judged = math.isfinite(x) and every == TRAIN_FLOOR_EVERY
            targets.append(
                _target(
                    "training overhead, async every few steps <= 2x the physical floor's",
                    f"{_size_of(ta['bytes'])}, every {every}",
                    x,
                    f"<= {TARGET_TRAIN_X_FLOOR:.0f}x",
                    x <= TARGET_TRAIN_X_FLOOR if judged else None,
                    f"stalwart async {ta['overhead']:+.1%} vs floor (memcpy + raw write thread) "
                    f"{tf['overhead']:+.1%}"
                    + floor_note
                    + apart
                    + ("" if math.isfinite(x) else "; floor overhead <= 0: no ratio")
                    + (
                        ""
                        if every == TRAIN_FLOOR_EVERY
                        else f"; shown, not judged: the goal is stated for saves every "
                        f"{TRAIN_FLOOR_EVERY} steps"
                    )
                    + (
                        f"; the floor that also hashes every byte (as a checksummed save must) "
                        f"{th['overhead']:+.1%}, {_num(_div(ta['overhead'], th['overhead']))}x "
                        f"of it"
                        if _ok(th) and th["overhead"] > 0
                        else ""
                    ),
                )
            )
    results["targets"] = targets


def _checksummed_floor(refs: dict[str, Any]) -> str:
    """The note's part on the least CPU a checksummed write can take: raw write + xxh3 pass."""
    raw, xxh3 = refs.get("raw_write_cpu_s"), refs.get("xxh3_s")
    if not raw or not xxh3:
        return ""
    return (
        f"; raw write + an xxh3-128 pass over the bytes (the floor of a checksummed write) "
        f"{_ms(raw + xxh3)}, {(raw + xxh3) / raw:.2f}x"
    )


def _async_cpu_split(sa: dict[str, Any], refs: dict[str, Any]) -> str:
    """The note's part on where an async save's CPU time went: the training thread (the
    staging copy, which the stall target bounds) and the background writer."""
    caller, background = sa.get("caller_cpu_s"), sa.get("background_cpu_s")
    raw = refs.get("raw_write_cpu_s")
    if caller is None or background is None or not raw:
        return ""
    return (
        f"; of it, the training thread {_ms(caller)} (the staging copy and the save's "
        f"bookkeeping) and the background writer {_ms(background)}, {background / raw:.2f}x "
        f"the raw write's"
    )


def _staged_floor(refs: dict[str, Any]) -> str:
    """The note's part on the least CPU a staged, checksummed save can take: a memcpy into
    the staging buffers, an xxh3 pass and a raw write of them (direct, as an async save's
    page-aligned buffers go, and through the page cache)."""
    raw, copy, xxh3 = refs.get("raw_write_cpu_s"), refs.get("memcpy_s"), refs.get("xxh3_s")
    direct = refs.get("raw_write_direct_cpu_s")
    if not raw or not copy or not xxh3 or not direct:
        return ""
    return (
        f"; memcpy + an xxh3-128 pass + a raw write (the floor of a staged, checksummed "
        f"save): {_ms(copy + xxh3 + direct)} ({(copy + xxh3 + direct) / raw:.2f}x) with the "
        f"write direct (O_DIRECT, as the staging buffers go), {_ms(copy + xxh3 + raw)} "
        f"({(copy + xxh3 + raw) / raw:.2f}x) through the page cache"
    )


def _per_call(results: dict[str, Any]) -> dict[str, Any] | None:
    per_call = results.get("per_call")
    return per_call if per_call and "error" not in per_call else None


def _edge_row(
    row: Callable[..., None], refs: dict[str, Any], key: str, what: str, mibs: float
) -> None:
    """The table row of a raw write timed at the rounds' edges, if the results have it."""
    if not (edge := refs.get(key)):
        return
    row(
        f"*ref: the same {what} at the rounds' edges*",
        "",
        "",
        _ms(edge),
        f"{mibs / edge:,.0f}",
        _num(refs["raw_write_s"] / edge),
        *[""] * 3,
        "after the round's reads and copies, not after another write: not a save's place",
    )


def _among(refs: dict[str, Any], edge_key: str, text: str = " among the saves") -> str:
    """``text`` where the run also timed the write at the rounds' edges (its reference
    then is the write among the saves); nothing for a run from before that."""
    return text if edge_key in refs else ""


_EDGE_WRITE = " (at the rounds' edges {ref}, after reads, not after a write: {x}x of that)"
_DIRECT_WRITE = (
    "; raw direct write (O_DIRECT, how stalwart writes large tensors) {ref}: "
    "the sync save is {x}x its throughput"
)


def _against(sync: dict[str, Any], refs: dict[str, Any], key: str, text: str) -> str:
    """The persist row's note comparing the sync save with the reference ``key``
    (``text`` with the reference's time and the throughput ratio), if measured."""
    ref = refs.get(key)
    if not ref:
        return ""
    return text.format(ref=_ms(ref), x=_num(ref / sync["e2e_s"]))


def _per_call_cpu(
    results: dict[str, Any], method: str, cpu: float | None, refs: dict[str, Any]
) -> str:
    """The CPU target's part on the cost per save apart from the bytes (``job_per_call``)."""
    per_call = _per_call(results)
    raw = refs.get("raw_write_cpu_s")
    if per_call is None or cpu is None or not raw:
        return ""
    m = per_call["methods"]
    fixed = m[method]["cpu_s"]
    return (
        f"; of it, {_ms(fixed)} is what every save of these {per_call['tensors']} tensors costs "
        f"(measured on the same tensors holding {per_call['bytes'] / 1024:.0f} KiB; torch.save "
        f"{_ms(m['torch_save']['cpu_s'])}, dcp.save {_ms(m['dcp_save']['cpu_s'])}); the rest, "
        f"{_ms(cpu - fixed)}, is {_div(cpu - fixed, raw):.2f}x the raw write's"
    )


def _per_call_restore(
    results: dict[str, Any], worst: str, rs: dict[str, Any], refs: dict[str, Any]
) -> str:
    """The restore target's part on the cost per restore apart from the bytes."""
    per_call = _per_call(results)
    if per_call is None:
        return ""
    m = per_call["methods"]
    fresh = worst.startswith("fresh")
    warm = worst.endswith("warm")
    fixed = m["stalwart_sync"]["restore_fresh_warm_s" if fresh else "restore_warm_s"]
    took = rs[f"restore_{'fresh_' if fresh else ''}{'warm' if warm else 'cold'}_s"]
    raw = refs["raw_read_warm_s" if warm else "raw_read_cold_s"]
    floor = refs.get("check_place_warm_s" if warm else "check_place_cold_s")
    rest = (
        f"the rest, {_ms(took - fixed)}, is {_div(took - fixed, floor):.2f}x the floor's time "
        f"(a raw read {_div(raw, took - fixed):.2f}x of it)"
        if took > fixed
        else "nothing is left above it"
    )
    return (
        f"; {_ms(fixed)} of the worst case's {_ms(took)} is what every restore of these "
        f"{per_call['tensors']} tensors costs (measured warm on the same tensors holding "
        f"{per_call['bytes'] / 1024:.0f} KiB; torch.load + load_state_dict "
        f"{_ms(m['torch_save']['restore_warm_s'])}, dcp.load "
        f"{_ms(m['dcp_save']['restore_warm_s'])}); {rest}"
    )


def _target(
    name: str,
    size: str,
    value: float,
    goal: str,
    passed: bool | None,
    detail: str,
    *,
    percent: bool = False,
) -> dict[str, Any]:
    return {
        "target": name,
        "size": size,
        "value": value,
        "shown": f"{value:+.1%}" if percent else f"{value:.2f}x",
        "goal": goal,
        "status": "N/A" if passed is None else "PASS" if passed else "MISS",
        "detail": detail,
    }


def _size_of(nbytes: int) -> str:
    return f"{nbytes / MiB:.0f} MiB"


def _stall_parts(b: dict[str, Any]) -> str:
    """The async stall's parts, each timed alone after the rounds (``_stalwart_stall_breakdown``).

    A run from before ``stage_copy_fresh_s`` timed its staging copy into fresh
    memory every time (buffers allocated, pages faulted in), which only a run's
    first save pays: named so.
    """
    parts = (
        f"TrainState.state_dict {_ms(b.get('trainstate_state_dict_s'))} "
        f"(DCP's get_state_dict alone {_ms(b.get('get_state_dict_s'))}) + "
    )
    if "stage_copy_fresh_s" not in b:
        return parts + f"stage copy into fresh memory {_ms(b.get('stage_copy_s'))}"
    return (
        parts + f"stage copy into the reused buffers {_ms(b['stage_copy_s'])} "
        f"(a run's first save, into fresh memory: {_ms(b['stage_copy_fresh_s'])})"
    )


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


# ------------------------------------------------------------------- markdown


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    out: list[str] = []
    add = out.append
    add(f"# stalwart checkpoint benchmark ({meta['mode']})\n")
    add(f"- command: `{meta['command']}` (in `{meta['cwd']}`)")
    add(f"- date: {meta['date']}; took {meta.get('elapsed_s', '?')} s")
    add(
        f"- torch {meta['torch']}, stalwart {meta['stalwart']}, python {meta['python']}, "
        f"{meta['cpus']} CPUs (torch intra-op threads per measurement: {meta['torch_threads']}, see --threads), {meta['platform']}"
    )
    add(f"- checkpoints written to {meta['filesystem']}")
    add(
        f"- load average (1 min) at start {meta.get('loadavg_start', '?')}, at end "
        f"{meta.get('loadavg_end', '?')}: other work on the machine shares its cores and disk"
    )
    add(
        f"- save and restore times are the best of {meta['repeats']} rounds (medians and samples "
        "are in the JSON) in one process that runs every method and reference once per round, "
        "interleaved, so a neighbour's burst hits them alike; a tiny warm-up save first pays "
        "lazy imports. Peak RSS comes from each method in a fresh process of its own. The "
        "training loop takes the median of back-to-back pairs of segments without and with "
        "checkpoints, pooled over each variant's processes (--passes). Compare ratios within this "
        "run, not absolute times across runs (a shared, noisy machine)\n"
    )

    add("## Targets\n")
    add("| target | state | measured | goal | result | how it splits |")
    add("|---|---|---|---|---|---|")
    for t in results.get("targets", []):
        add(
            f"| {t['target']} | {t['size']} | {t['shown']} | {t['goal']} | **{t['status']}** | {t['detail']} |"
        )
    add("")

    for entry in results["sizes"]:
        _size_section(entry, meta, add)

    _per_call_section(results, add)
    _peer_section(results, add)
    _training_section(results, add)
    _certificate_section(results, add)
    _restart_section(results, add)
    return "\n".join(out) + "\n"


PER_CALL_NAMES = {
    "stalwart_sync": "stalwart sync (a verified restore)",
    "stalwart_async": "stalwart async",
    "torch_save": "torch.save + fsync + rename; torch.load(weights_only=True) + load_state_dict",
    "dcp_save": "get_state_dict + dcp.save + fsync; dcp.load + set_state_dict",
}


def _section(results: dict[str, Any], key: str, heading: str, add: Any) -> dict[str, Any] | None:
    """The heading of a section on ``results[key]``; its data, or None when there is
    nothing (more) to show: not run, or its error shown instead."""
    data = results.get(key)
    if not data:
        return None
    add(f"## {heading}\n")
    if "error" in data:
        add(f"not measured: {data['error']}\n")
        return None
    return data


def _per_call_section(results: dict[str, Any], add: Any) -> None:
    per_call = _section(results, "per_call", "Cost per call apart from the bytes", add)
    if per_call is None:
        return
    add(
        f"The benchmark's state with its {per_call['tensors']} tensors holding "
        f"{per_call['bytes'] / 1024:.0f} KiB in all, saved and restored (warm) by each method, "
        f"interleaved, best of {per_call['repeats']} rounds: the per-tensor work every call pays "
        "at any size (planning, metadata, one record per tensor, the state-dict calls). At the "
        "sizes above, the rest is the part that grows with the bytes, which the physical "
        "floors bound; the targets' notes split each miss this way.\n"
    )
    add("| method | save CPU time | restore, warm | restore into fresh objects, warm |")
    add("|---|---|---|---|")
    for name, m in per_call["methods"].items():
        add(
            f"| {PER_CALL_NAMES.get(name, name)} | {_ms(m.get('cpu_s'))} | {_ms(m.get('restore_warm_s'))} "
            f"| {_ms(m.get('restore_fresh_warm_s'))} |"
        )
    add("")
    many = per_call.get("many")
    if many:
        _per_tensor_table(per_call, many, add)


_PER_CALL_KEYS = ("cpu_s", "restore_warm_s", "restore_fresh_warm_s")


def _per_tensor_table(base: dict[str, Any], many: dict[str, Any], add: Any) -> None:
    """The same calls on a state of many more tensors, and each one's cost per tensor."""
    extra = many["tensors"] - base["tensors"]
    add(
        f"The same on {many['tensors']:,} tensors ({many['bytes'] / 1024:.0f} KiB in all, best of "
        f"{many['repeats']} rounds), and what each of the {extra:,} more tensors costs (the "
        "difference, divided): what a model of thousands of tensors pays on every call.\n"
    )
    add(
        "| method | save CPU time | per tensor | restore, warm | per tensor "
        "| restore into fresh objects, warm | per tensor |"
    )
    add("|---|---|---|---|---|---|---|")
    for name, m in many["methods"].items():
        b = base["methods"].get(name, {})
        cells = []
        for key in _PER_CALL_KEYS:
            value, before = m.get(key), b.get(key)
            each = (value - before) / extra if value is not None and before is not None else None
            cells += [_ms(value), "-" if each is None else f"{each * 1e6:.1f} µs"]
        add(f"| {PER_CALL_NAMES.get(name, name)} | " + " | ".join(cells) + " |")
    add("")


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f} µs"


def _certificate_section(results: dict[str, Any], add: Any) -> None:
    cert = _section(results, "certificate", "Exact-resume certificate: cost per step", add)
    if cert is None:
        return
    add(
        "Every `save()` call fingerprints the step that ended (loss, RNG digest, batch digest "
        "when the data comes through `ResumableDataLoader`) and appends it to the run's "
        "per-attempt log. Against the cheapest real step there is (a 4-8-2 MLP on 16 samples, "
        "AdamW), so the ratio is an upper bound for any real model:\n"
    )
    add("| per step | time | x tiny step |")
    add("|---|---|---|")
    add(f"| tiny training step | {_us(cert['tiny_step_s'])} | 1 |")
    add(
        f"| fingerprint (RNG digest, loss, log append) | {_us(cert['fingerprint_s'])} | "
        f"{_num(cert['fingerprint_x_tiny_step'], '{:.3f}')} |"
    )
    add(
        f"| fingerprint with a ResumableDataLoader batch | {_us(cert['fingerprint_data_s'])} | "
        f"{_num(cert['fingerprint_data_x_tiny_step'], '{:.3f}')} |"
    )
    add(
        f"| whole `save()` call that does not write | {_us(cert['save_not_due_s'])} | "
        f"{_num(cert['save_not_due_x_tiny_step'], '{:.3f}')} |"
    )
    add("")


RESTART_NAMES = {
    "raw_read": "*ref: raw read of the checkpoint's files*",
    "stalwart": "stalwart: `CheckpointManager(run).restore(state)` (verified)",
    "torch_load": "torch.load(weights_only=True) + load_state_dict",
}


def _restart_section(results: dict[str, Any], add: Any) -> None:
    restart = results.get("restart")
    label = (
        f" (~{_size_of(restart['state']['bytes'])} state)" if restart and "state" in restart else ""
    )
    data = _section(results, "restart", f"A restart's wait: a new interpreter{label}", add)
    if data is None:
        return
    methods = data["methods"]
    add(
        "After a failure every rank starts a new interpreter: it imports torch and its "
        "checkpoint library, builds its model and optimizer (timed, left out: the user's own, "
        "the same for every method), and restores. Each cell is the best of "
        f"{data['repeats']} new processes per method; cold: the checkpoint's pages dropped from "
        "the cache first (a new host), warm: cached (the same host).\n"
    )
    add(
        "| method | start + imports | restore, cold | restore, warm | restart, cold | "
        "restore's share of it | restore's throughput ÷ a raw read's, cold | warm |"
    )
    add("|---|---|---|---|---|---|---|---|")
    raw = methods.get("raw_read", {})
    for name, title in RESTART_NAMES.items():
        m = methods.get(name)
        if m is None:
            continue
        cold, warm = m["cold"], m["warm"]
        imports = cold["startup_s"] + cold["imports_s"]
        add(
            f"| {title} | {_ms(imports)} | {_ms(cold['restore_s'])} | {_ms(warm['restore_s'])} | "
            f"{_ms(cold['restart_s'])} | {_num(_div(cold['restore_s'], cold['restart_s']), '{:.0%}')} | "
            f"{_num(_div(raw.get('cold', {}).get('restore_s'), cold['restore_s']))} | "
            f"{_num(_div(raw.get('warm', {}).get('restore_s'), warm['restore_s']))} |"
        )
    add("")
    st, tl = methods.get("stalwart"), methods.get("torch_load")
    if st and tl:
        c = st["cold"]
        add(
            f"stalwart ÷ torch.load: restore {_num(_div(c['restore_s'], tl['cold']['restore_s']))} "
            f"cold, {_num(_div(st['warm']['restore_s'], tl['warm']['restore_s']))} warm; the whole "
            f"restart {_num(_div(c['restart_s'], tl['cold']['restart_s']))} cold. stalwart's "
            f"imports: torch {_ms(c['import_torch_s'])}, torch.distributed.checkpoint "
            f"{_ms(c['import_dcp_s'])} (which imports torch.distributed.tensor), stalwart itself "
            f"{_ms(c['import_stalwart_s'])}.\n"
        )
    if not all(m.get("cold_dropped", False) for m in methods.values()):
        add("The page cache could not be dropped here: the cold column is not cold.\n")


def _size_section(entry: dict[str, Any], meta: dict[str, Any], add: Any) -> None:
    refs, methods = entry["references"], entry["methods"]
    if "error" in refs:
        add(f"## State ~{entry['label']}: references failed: {refs['error']}\n")
        return
    st = refs["state"]
    nbytes = entry["bytes"]
    add(
        f"## Save, state ~{entry['label']} ({nbytes:,} bytes: {st['params']:,} fp32 params + "
        f"AdamW exp_avg/exp_avg_sq/step, {st['tensors']} tensors, {st['blocks']} blocks of width {st['width']})\n"
    )
    add(
        "| method | stall | stall ÷ memcpy | save until durable | MiB/s | ÷ raw write | CPU time "
        "| CPU ÷ raw write's | peak RSS + | notes |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|")
    mibs = nbytes / MiB

    def row(*cells: str) -> None:
        cells = cells + ("",) * (10 - len(cells))
        add("| " + " | ".join(cells) + " |")

    wcpu = refs.get("raw_write_cpu_s")
    row(
        "*ref: memcpy into preallocated buffers*",
        _ms(refs["memcpy_s"]),
        "1.00x",
        *[""] * 6,
        "floor of a staged stall",
    )
    row(
        "*ref: clone into fresh memory*",
        _ms(refs["clone_s"]),
        f"{_num(refs['clone_s'] / refs['memcpy_s'])}x",
        *[""] * 6,
        "the same copy, pages faulted in on first touch",
    )
    row(
        "*ref: xxh3-128 of the bytes in memory*",
        "",
        "",
        _ms(refs["xxh3_s"]),
        f"{mibs / refs['xxh3_s']:,.0f}",
        _num(refs["raw_write_s"] / refs["xxh3_s"]),
        *[""] * 3,
        "the checksum's own cost",
    )
    row(
        "*ref: raw sequential write + fsync*",
        "",
        "",
        _ms(refs["raw_write_s"]),
        f"{mibs / refs['raw_write_s']:,.0f}",
        "1.00",
        _ms(wcpu),
        "1.00",
        "",
        "floor of persist (a new file)"
        + _among(refs, "raw_write_edge_s", ", timed among the saves of each round"),
    )
    _edge_row(row, refs, "raw_write_edge_s", "raw write", mibs)
    if direct := refs.get("raw_write_direct_s"):
        row(
            "*ref: raw sequential direct write (O_DIRECT) + fsync*",
            "",
            "",
            _ms(direct),
            f"{mibs / direct:,.0f}",
            _num(refs["raw_write_s"] / direct),
            _ms(refs.get("raw_write_direct_cpu_s")),
            _num(_div(refs.get("raw_write_direct_cpu_s"), wcpu)),
            "",
            "the same bytes past the page cache, as stalwart writes large tensors"
            + _among(refs, "raw_write_direct_edge_s", "; timed among the saves"),
        )
        _edge_row(row, refs, "raw_write_direct_edge_s", "direct write", mibs)
    r = entry["ratios"]
    for name, m in methods.items():
        if not _ok(m):
            row(NAMES[name], "error", *[""] * 7, m.get("error", "?") if m else "?")
            continue
        notes = []
        if name == "stalwart_sync":
            ev = m["events"]
            notes.append(
                f"events: write {_ms(ev['write_s'])}, checksum {_ms(ev['checksum_s'])}, "
                f"commit {_ms(ev['commit_s'])}"
            )
        if name == "stalwart_async":
            b = m["breakdown"]
            notes.append(f"the stall's parts timed alone: {_stall_parts(b)}")
        if "worker_peak_rss_growth_mib" in m:
            notes.append(f"+ worker process {m['worker_peak_rss_growth_mib']:.0f} MiB")
        notes.extend(m.get("notes", []))
        row(
            NAMES[name],
            _ms(m["stall_s"]),
            f"{_num(r['stall_x_memcpy'].get(name))}x",
            _ms(m["e2e_s"]),
            f"{mibs / m['e2e_s']:,.0f}",
            _num(r["persist_x_raw_write"].get(name)),
            _ms(m.get("cpu_s")),
            _num(_div(m.get("cpu_s"), wcpu)),
            f"{m['peak_rss_mib']:.0f} MiB",
            "; ".join(notes),
        )
    row("Lightning TorchCheckpointIO / AsyncCheckpointIO", meta["lightning"])

    add("")

    add(f"## Restore, state ~{entry['label']}\n")
    add(
        "| method | cold cache | warm cache | cold MiB/s | cold ÷ raw read | warm ÷ raw read | peak RSS + | notes |"
    )
    add("|---|---|---|---|---|---|---|---|")
    cache_note = "" if refs.get("page_cache_drop") else " (page-cache drop failed: cold = warm)"
    add(
        f"| *ref: raw sequential read{cache_note}* | {_ms(refs['raw_read_cold_s'])} | "
        f"{_ms(refs['raw_read_warm_s'])} | {mibs / refs['raw_read_cold_s']:,.0f} | 1.00 | 1.00 | | |"
    )

    def timed_row(label: str, cold: float, warm: float, note: str) -> None:
        """A restore row without peak RSS, its ratios to the raw read of the same run."""
        add(
            f"| {label} | {_ms(cold)} | {_ms(warm)} | {mibs / cold:,.0f} | "
            f"{_num(_div(refs['raw_read_cold_s'], cold))} | "
            f"{_num(_div(refs['raw_read_warm_s'], warm))} | | {note} |"
        )

    if refs.get("place_cold_s"):
        timed_row(
            "*ref: read into the tensors (no check)*",
            refs["place_cold_s"],
            refs["place_warm_s"],
            "floor of any restore: the bytes land in the state's memory, not in one reused "
            "8 MiB buffer that stays in the CPU's cache as the raw read's do",
        )
    if refs.get("check_place_cold_s"):
        timed_row(
            "*ref: check, then place (read + xxh3, then read into the tensors)*",
            refs["check_place_cold_s"],
            refs["check_place_warm_s"],
            "floor of a restore that checks every byte before it writes a live tensor",
        )
    if refs.get("check_place_fresh_cold_s"):
        timed_row(
            "*ref: check, then place into fresh objects*",
            refs["check_place_fresh_cold_s"],
            refs["check_place_fresh_warm_s"],
            "the same, the optimizer's state allocated anew inside the timing, as a restore "
            "into fresh objects allocates it: floor of a restore into fresh objects",
        )
    for name, label in RESTORE_NAMES.items():
        m = methods.get(name)
        if not _ok(m) or not _ok(m.get("restore")):
            add(f"| {label} | error | | | | | | |")
            continue
        rs = m["restore"]
        note = ""
        if "breakdown" in rs:
            b = rs["breakdown"]
            note = (
                f"its check pass alone (read + xxh3 of every file, as `stalwart verify`) "
                f"{_ms(b['verify_cold_s'])} cold, {_ms(b['verify_warm_s'])} warm; "
                f"its metadata read from .metadata.json (best of 3) "
                f"{_ms(b.get('read_json_s'))}, against "
                f"{_ms(b['read_metadata_s'])} from the .metadata pickle"
            )
        elif name == "dcp_save":
            note = "runs pickle.load on .metadata: a crafted checkpoint runs code"
        add(
            f"| {label} | {_ms(rs['restore_cold_s'])} | {_ms(rs['restore_warm_s'])} | "
            f"{mibs / rs['restore_cold_s']:,.0f} | {_num(r['restore_cold_x_raw_read'].get(name))} | "
            f"{_num(r['restore_warm_x_raw_read'].get(name))} | {rs['restore_peak_rss_mib']:.0f} MiB | {note} |"
        )
        if rs.get("restore_fresh_cold_s"):
            timed_row(
                f"{label}, into fresh objects",
                rs["restore_fresh_cold_s"],
                rs["restore_fresh_warm_s"],
                "a newly built model and an optimizer with no state yet (built before the "
                "clock starts)",
            )
    add("")


def _floor_note(refs: dict[str, Any], restore: dict[str, Any]) -> str:
    """Where a verified restore stands against the floor of checking before use."""
    cold, warm = refs.get("check_place_cold_s"), refs.get("check_place_warm_s")
    if not (cold and warm):
        return ""
    place = (
        f"; reading the files into the tensors alone, with no check, is "
        f"{_num(_div(refs['raw_read_cold_s'], refs['place_cold_s']))}x cold, "
        f"{_num(_div(refs['raw_read_warm_s'], refs['place_warm_s']))}x warm (the bytes land in "
        "the state's memory, the raw read's in one reused 8 MiB buffer)"
        if refs.get("place_cold_s") and refs.get("place_warm_s")
        else ""
    )
    return (
        place + f"; the floor of any restore that checks every byte before it writes a live tensor "
        f"(read + xxh3, then read into place) is {_num(_div(refs['raw_read_cold_s'], cold))}x "
        f"cold, {_num(_div(refs['raw_read_warm_s'], warm))}x warm, and this restore takes "
        f"{_num(_div(restore['restore_cold_s'], cold))}x / "
        f"{_num(_div(restore['restore_warm_s'], warm))}x the floor's time"
        + (
            f"; into fresh objects {_num(_div(refs['raw_read_cold_s'], restore['restore_fresh_cold_s']))}x "
            f"cold, {_num(_div(refs['raw_read_warm_s'], restore['restore_fresh_warm_s']))}x warm "
            "(the restore allocates their optimizer's state, new memory: this run's clone of "
            f"the state into fresh memory took {_ms(refs.get('clone_s'))}, its memcpy into ready "
            f"memory {_ms(refs.get('memcpy_s'))})" + _fresh_floor_note(refs, restore)
            if restore.get("restore_fresh_cold_s")
            else ""
        )
    )


def _fresh_floor_note(refs: dict[str, Any], restore: dict[str, Any]) -> str:
    """Where a verified restore into fresh objects stands against its own floor."""
    cold, warm = refs.get("check_place_fresh_cold_s"), refs.get("check_place_fresh_warm_s")
    if not (cold and warm):
        return ""
    return (
        f"; the floor of a checked restore into fresh objects (that memory allocated anew "
        f"inside the timing) is {_num(_div(refs['raw_read_cold_s'], cold))}x cold, "
        f"{_num(_div(refs['raw_read_warm_s'], warm))}x warm, and this restore takes "
        f"{_num(_div(restore['restore_fresh_cold_s'], cold))}x / "
        f"{_num(_div(restore['restore_fresh_warm_s'], warm))}x its time"
    )


def _peer_section(results: dict[str, Any], add: Any) -> None:
    add("## stalwart ÷ peers (time ratios; below 1 means stalwart is faster)\n")
    cols = (
        [("async stall ÷ " + NAMES[p], "stalwart_async_stall_over_peer", p) for p in STALL_PEERS]
        + [("sync save ÷ " + NAMES[p], "stalwart_sync_save_over_peer", p) for p in SYNC_PEERS]
        + [("async save ÷ " + NAMES[p], "stalwart_async_save_over_peer", p) for p in ASYNC_PEERS]
        + [
            ("restore cold ÷ " + RESTORE_NAMES[p], "stalwart_restore_cold_over_peer", p)
            for p in RESTORE_PEERS
        ]
        + [
            ("restore warm ÷ " + RESTORE_NAMES[p], "stalwart_restore_warm_over_peer", p)
            for p in RESTORE_PEERS
        ]
    )
    add("| ratio | " + " | ".join(e["label"] for e in results["sizes"]) + " |")
    add("|---|" + "---|" * len(results["sizes"]))
    for title, key, peer in cols:
        cells = [_num(e["ratios"].get(key, {}).get(peer)) for e in results["sizes"]]
        add(f"| {title} | " + " | ".join(cells) + " |")
    add("")


def _training_section(results: dict[str, Any], add: Any) -> None:
    training = results.get("training")
    if not training:
        return
    runs = training["runs"]
    any_ok = next((v for v in runs if _ok(v)), None)
    if any_ok is None:
        add("## Training loop: failed\n")
        return
    add(
        f"## Training loop overhead (~{_size_of(any_ok['bytes'])} state, batch {any_ok['batch']}, "
        f"{any_ok['threads']} torch thread(s); {any_ok['rounds']} pairs of segments without and "
        f"with checkpoints, back to back, from {any_ok.get('processes', 1)} process(es) per "
        "variant run at different times; the overhead is the median of the pairs' ratios)\n"
    )
    add(
        "| checkpointing | every | step (no checkpoints) | saves | wall with ÷ without | overhead "
        "| of which blocked in save() | of which slower steps beside a background save "
        "| one save() call, median (max) | stall_s in events.jsonl, median |"
    )
    add("|---|---|---|---|---|---|---|---|---|---|")
    for v in runs:
        if not _ok(v):
            add(
                f"| {TRAIN_NAMES[v['variant']]} | {v['every']} | error | | | {v.get('error', '?')} | | | | |"
            )
            continue
        add(
            f"| {TRAIN_NAMES[v['variant']]} | {v['every']} | {_ms(v['step_s'])} | {v['saves']} | "
            f"{1 + v['overhead']:.3f} | {v['overhead']:+.1%} | {v['blocked_share']:+.1%} | "
            f"{v['background_share']:+.1%} | {_ms(v['save_call_s'])} ({_ms(v['save_call_max_s'])}) | "
            f"{_ms(v['logged_stall_s'])} |"
        )
    add("")
    side = training.get("side_by_side")
    if side is None:
        return  # a run from before this measurement
    if not _ok(side):
        add(f"Side by side in one process: failed ({side.get('error', '?')})\n")
        return
    add(
        f"Side by side in one process, checkpoint every {side['every']} steps: stalwart async "
        "and the floors, each round a pair of segments (without, then with checkpoints) of "
        "each in turn, the order reversed every round; the target against the physical floor "
        "is judged on these.\n"
    )
    add(
        "| checkpointing | step (no checkpoints) | saves | overhead | of which blocked in save() "
        "| of which slower steps beside a background save | pairs |"
    )
    add("|---|---|---|---|---|---|---|")
    for name, v in side["variants"].items():
        if not _ok(v):
            add(f"| {TRAIN_NAMES[name]} | error | | {v.get('error', '?')} | | | |")
            continue
        add(
            f"| {TRAIN_NAMES[name]} | {_ms(v['step_s'])} | {v['saves']} | {v['overhead']:+.1%} | "
            f"{v['blocked_share']:+.1%} | {v['background_share']:+.1%} | {v['rounds']} |"
        )
    add("")


# ----------------------------------------------------------------------- plot


def plot(results: dict[str, Any], path: Path) -> str:
    """Write the summary plot; returns a line saying what happened (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            f"skipped {path.name}: matplotlib is not installed "
            "(pip install matplotlib==3.11.2 to get the plot)"
        )
    sizes = [e for e in results["sizes"] if "ratios" in e]
    labels = [e["label"] for e in sizes]
    panels = [
        (
            "stall ÷ memcpy (log; lower is better)",
            "stall_x_memcpy",
            list(NAMES),
            True,
            TARGET_STALL_X_MEMCPY,
        ),
        (
            "save throughput ÷ raw write+fsync (higher is better)",
            "persist_x_raw_write",
            list(NAMES),
            False,
            TARGET_PERSIST_X_RAW,
        ),
        (
            "restore throughput ÷ raw read, cold cache",
            "restore_cold_x_raw_read",
            list(RESTORE_NAMES),
            False,
            TARGET_RESTORE_X_RAW,
        ),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8))
    for ax, (title, key, names, log, goal) in zip(axes, panels, strict=True):
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            values = [e["ratios"][key].get(name, math.nan) for e in sizes]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(sizes))]
            label = (RESTORE_NAMES if key.startswith("restore") else NAMES)[name]
            ax.bar(xs, values, width, label=label)
        ax.axhline(goal, color="black", linestyle="--", linewidth=1, label=f"target {goal}x")
        ax.set_xticks(range(len(sizes)), labels)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    meta = results["meta"]
    fig.suptitle(
        f"stalwart benchmark ({meta['mode']}), torch {meta['torch']}, {meta['cpus']} CPUs, {meta['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
