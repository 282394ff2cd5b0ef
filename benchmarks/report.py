"""Ratios, targets, markdown and the plot for ``run.py``'s results (plain data in, text out)."""

from __future__ import annotations

import math
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
TRAIN_REGIME_TORCH_SAVE = 0.30


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
        nbytes = entry["bytes"]
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
                r["restore_cold_x_raw_read"][name] = _div(refs["raw_read_cold_s"], rs["restore_cold_s"])
                r["restore_warm_x_raw_read"][name] = _div(refs["raw_read_warm_s"], rs["restore_warm_s"])
        sa, ss = methods.get("stalwart_async"), methods.get("stalwart_sync")
        for peer in STALL_PEERS:
            if _ok(sa) and _ok(methods.get(peer)):
                r["stalwart_async_stall_over_peer"][peer] = _div(sa["stall_s"], methods[peer]["stall_s"])
        for peer in SYNC_PEERS:
            if _ok(ss) and _ok(methods.get(peer)):
                r["stalwart_sync_save_over_peer"][peer] = _div(ss["e2e_s"], methods[peer]["e2e_s"])
        for peer in ASYNC_PEERS:
            if _ok(sa) and _ok(methods.get(peer)):
                r["stalwart_async_save_over_peer"][peer] = _div(sa["e2e_s"], methods[peer]["e2e_s"])
        for peer in RESTORE_PEERS:
            if _ok(ss) and _ok(methods.get(peer)) and "restore" in methods[peer]:
                mine, theirs = ss["restore"], methods[peer]["restore"]
                r["stalwart_restore_cold_over_peer"][peer] = _div(mine["restore_cold_s"], theirs["restore_cold_s"])
                r["stalwart_restore_warm_over_peer"][peer] = _div(mine["restore_warm_s"], theirs["restore_warm_s"])

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
                    f"stall {_ms(sa['stall_s'])}: TrainState.state_dict {_ms(b.get('trainstate_state_dict_s'))} "
                    f"(get_state_dict {_ms(b.get('get_state_dict_s'))}) + stage copy "
                    f"{_ms(b.get('stage_copy_s'))}; memcpy {_ms(refs['memcpy_s'])}, "
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
                        "stalwart async ÷ " + ", ".join(f"{NAMES[p]} {v:.2f}x" for p, v in peers.items()),
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
                    f"raw write {_ms(refs['raw_write_s'])}",
                )
            )
            if _ok(ss.get("restore")):
                cold = r["restore_cold_x_raw_read"]["stalwart_sync"]
                warm = r["restore_warm_x_raw_read"]["stalwart_sync"]
                drop = ss["restore"].get("page_cache_drop") and refs.get("page_cache_drop")
                targets.append(
                    _target(
                        "restore (verified) >= 0.8x raw read",
                        size,
                        cold,
                        f">= {TARGET_RESTORE_X_RAW}x (cold cache)",
                        cold >= TARGET_RESTORE_X_RAW,
                        f"cold {_ms(ss['restore']['restore_cold_s'])} vs raw {_ms(refs['raw_read_cold_s'])}; "
                        f"warm {warm:.2f}x ({_ms(ss['restore']['restore_warm_s'])} vs "
                        f"{_ms(refs['raw_read_warm_s'])})"
                        + ("" if drop else "; page-cache drop did not work, cold = warm"),
                    )
                )

    training = results.get("training")
    if training:
        variants = training["variants"]
        ta, tt = variants.get("stalwart_async"), variants.get("torch_save")
        if _ok(ta) and _ok(tt):
            regime = tt["overhead"] > TRAIN_REGIME_TORCH_SAVE
            ts = variants.get("stalwart_sync", {})
            targets.append(
                _target(
                    "training overhead, async every few steps <= 5% (where torch.save > 30%)",
                    _size_of(ta["bytes"]),
                    ta["overhead"],
                    f"<= {TARGET_TRAIN_OVERHEAD:.0%}",
                    ta["overhead"] <= TARGET_TRAIN_OVERHEAD if regime else None,
                    f"every {ta['every']} steps of {_ms(ta['step_s'])}: stalwart async "
                    f"{ta['overhead']:+.1%}, stalwart sync "
                    f"{ts.get('overhead', math.nan):+.1%}, torch.save {tt['overhead']:+.1%}"
                    + ("" if regime else " (torch.save is not above 30%: outside the target's regime)"),
                    percent=True,
                )
            )
    results["targets"] = targets


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
        f"{meta['cpus']} CPUs ({meta['torch_threads']} torch threads), {meta['platform']}"
    )
    add(f"- checkpoints written to {meta['filesystem']}")
    add(
        f"- each number is the median of {meta['repeats']} timed repeat(s) after one warm-up, "
        "each method in its own fresh process; compare ratios within this run, not absolute "
        "times across runs (a shared, noisy machine)\n"
    )

    add("## Targets\n")
    add("| target | state | measured | goal | result | how it splits |")
    add("|---|---|---|---|---|---|")
    for t in results.get("targets", []):
        add(f"| {t['target']} | {t['size']} | {t['shown']} | {t['goal']} | **{t['status']}** | {t['detail']} |")
    add("")

    for entry in results["sizes"]:
        _size_section(entry, meta, add)

    _peer_section(results, add)
    _training_section(results, add)
    return "\n".join(out) + "\n"


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
    add("| method | stall | stall ÷ memcpy | save until durable | MiB/s | ÷ raw write | peak RSS + | notes |")
    add("|---|---|---|---|---|---|---|---|")
    mibs = nbytes / MiB
    add(f"| *ref: memcpy into preallocated buffers* | {_ms(refs['memcpy_s'])} | 1.00x | | | | | floor of a staged stall |")
    add(
        f"| *ref: clone into fresh memory* | {_ms(refs['clone_s'])} | "
        f"{_num(refs['clone_s'] / refs['memcpy_s'])}x | | | | | same copy, pages faulted in on first touch |"
    )
    add(
        f"| *ref: xxh3-128 of the bytes in memory* | | | {_ms(refs['xxh3_s'])} | {mibs / refs['xxh3_s']:,.0f} | "
        f"{_num(refs['raw_write_s'] / refs['xxh3_s'])} | | checksum cost alone |"
    )
    add(
        f"| *ref: raw sequential write + fsync* | | | {_ms(refs['raw_write_s'])} | "
        f"{mibs / refs['raw_write_s']:,.0f} | 1.00 | | floor of persist (a new file) |"
    )
    r = entry["ratios"]
    for name, m in methods.items():
        if not _ok(m):
            add(f"| {NAMES[name]} | error | | | | | | {m.get('error', '?') if m else '?'} |")
            continue
        notes = []
        if name == "stalwart_sync":
            ev = m["events"]
            notes.append(
                f"events: write {_ms(ev['write_s'])}, checksum {_ms(ev['checksum_s'])}, commit {_ms(ev['commit_s'])}"
            )
        if name == "stalwart_async":
            b = m["breakdown"]
            notes.append(
                f"stall = TrainState.state_dict {_ms(b['trainstate_state_dict_s'])} (get_state_dict "
                f"{_ms(b['get_state_dict_s'])}) + stage copy {_ms(b['stage_copy_s'])}"
            )
        if "worker_peak_rss_growth_mib" in m:
            notes.append(f"+ worker process {m['worker_peak_rss_growth_mib']:.0f} MiB")
        for n in m.get("notes", []):
            if n.startswith("needs"):
                notes.append(n)
        add(
            f"| {NAMES[name]} | {_ms(m['stall_s'])} | {_num(r['stall_x_memcpy'].get(name))}x | "
            f"{_ms(m['e2e_s'])} | {mibs / m['e2e_s']:,.0f} | {_num(r['persist_x_raw_write'].get(name))} | "
            f"{m['peak_rss_mib']:.0f} MiB | {'; '.join(notes)} |"
        )
    add(f"| Lightning TorchCheckpointIO / AsyncCheckpointIO | {meta['lightning']} | | | | | | |")
    add("")

    add(f"## Restore, state ~{entry['label']}\n")
    add("| method | cold cache | warm cache | cold MiB/s | cold ÷ raw read | warm ÷ raw read | peak RSS + |")
    add("|---|---|---|---|---|---|---|")
    cache_note = "" if refs.get("page_cache_drop") else " (page-cache drop failed: cold = warm)"
    add(
        f"| *ref: raw sequential read{cache_note}* | {_ms(refs['raw_read_cold_s'])} | "
        f"{_ms(refs['raw_read_warm_s'])} | {mibs / refs['raw_read_cold_s']:,.0f} | 1.00 | 1.00 | |"
    )
    for name, label in RESTORE_NAMES.items():
        m = methods.get(name)
        if not _ok(m) or not _ok(m.get("restore")):
            add(f"| {label} | error | | | | | |")
            continue
        rs = m["restore"]
        add(
            f"| {label} | {_ms(rs['restore_cold_s'])} | {_ms(rs['restore_warm_s'])} | "
            f"{mibs / rs['restore_cold_s']:,.0f} | {_num(r['restore_cold_x_raw_read'].get(name))} | "
            f"{_num(r['restore_warm_x_raw_read'].get(name))} | {rs['restore_peak_rss_mib']:.0f} MiB |"
        )
    add("")


def _peer_section(results: dict[str, Any], add: Any) -> None:
    add("## stalwart ÷ peers (time ratios; below 1 means stalwart is faster)\n")
    cols = (
        [("async stall ÷ " + NAMES[p], "stalwart_async_stall_over_peer", p) for p in STALL_PEERS]
        + [("sync save ÷ " + NAMES[p], "stalwart_sync_save_over_peer", p) for p in SYNC_PEERS]
        + [("async save ÷ " + NAMES[p], "stalwart_async_save_over_peer", p) for p in ASYNC_PEERS]
        + [("restore cold ÷ " + RESTORE_NAMES[p], "stalwart_restore_cold_over_peer", p) for p in RESTORE_PEERS]
        + [("restore warm ÷ " + RESTORE_NAMES[p], "stalwart_restore_warm_over_peer", p) for p in RESTORE_PEERS]
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
    variants = training["variants"]
    any_ok = next((v for v in variants.values() if _ok(v)), None)
    if any_ok is None:
        add("## Training loop: failed\n")
        return
    add(
        f"## Training loop overhead (~{_size_of(any_ok['bytes'])} state, batch {any_ok['batch']}, "
        f"{any_ok['threads']} torch thread(s), checkpoint every {training['every']} steps; "
        f"{any_ok['rounds']} pairs of {any_ok['segment_steps']}-step segments without and with "
        "checkpoints, alternating; medians compared)\n"
    )
    add("| checkpointing | step (no checkpoints) | saves | wall with ÷ without | overhead |")
    add("|---|---|---|---|---|")
    for name, v in variants.items():
        if not _ok(v):
            add(f"| {NAMES[name]} | error | | | {v.get('error', '?')} |")
            continue
        add(
            f"| {NAMES[name]} | {_ms(v['step_s'])} | {v['saves']} | {v['ckpt_s'] / v['base_s']:.3f} | "
            f"{v['overhead']:+.1%} |"
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
        ("stall ÷ memcpy (log; lower is better)", "stall_x_memcpy", list(NAMES), True, TARGET_STALL_X_MEMCPY),
        ("save throughput ÷ raw write+fsync (higher is better)", "persist_x_raw_write", list(NAMES), False, TARGET_PERSIST_X_RAW),
        ("restore throughput ÷ raw read, cold cache", "restore_cold_x_raw_read", list(RESTORE_NAMES), False, TARGET_RESTORE_X_RAW),
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
    fig.suptitle(f"stalwart benchmark ({meta['mode']}), torch {meta['torch']}, {meta['cpus']} CPUs, {meta['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
