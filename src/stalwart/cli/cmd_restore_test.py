"""``stalwart restore-test RUN --build MODULE:FUNCTION``: prove a checkpoint restores into a fresh model.

``verify`` proves the bytes are intact; this proves they are *usable*: the
user's own code builds the training objects in this (fresh) process, the
checkpoint loads into them strictly, every tensor is finite, and the model runs
a forward pass (and, with ``--train-step``, one optimizer step).

Read-only and lock-free on purpose: it never opens a ``CheckpointManager``
(which takes the run's single-writer lock, writes ``events.jsonl`` and moves
bad checkpoints aside), so it runs beside a live training job. It loads with
``stalwart.pipeline.load_checkpoint``, which checks every file's size and
checksum against the manifest before anything is deserialized.

The factory contract: ``FUNCTION()`` takes no arguments and returns a dict.
``model`` is required; ``batch`` and ``loss_fn`` (``loss_fn(model, batch) ->
scalar loss tensor``) enable the forward check; every other key (``optimizer``,
``scheduler``, ``scaler``, ``data``, ``extra``, ``rng``, named stateful
objects) is passed to ``stalwart.TrainState`` as is, so it must match what the
training script gives its ``TrainState``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

import torch
from rich.text import Text

from stalwart.cli.common import (
    EXIT_BAD,
    EXIT_OK,
    UsageError,
    format_bytes,
    format_seconds,
    make_console,
    name_step,
    new_table,
    non_negative_float,
    resolve_checkpoint,
)
from stalwart.errors import StalwartError
from stalwart.pipeline import load_checkpoint
from stalwart.state import TrainState

__all__ = ["add_parser", "load_factory", "restore_test", "run"]

EPILOG = """\
FACTORY CONTRACT
  FUNCTION() takes no arguments and returns a dict:
    model      required: the nn.Module, built exactly as for training
    optimizer, scheduler, scaler, data, extra, ...
               optional: passed to stalwart.TrainState(...) as is; give what
               the training script gives its TrainState (extra={} if it saves
               extra), or the strict load reports the difference
    batch      optional: one input batch for the forward check
    loss_fn    optional: loss_fn(model, batch) -> scalar loss tensor
  MODULE is imported from the current directory (or --path DIR); a file path
  such as examples/train.py:build works too. Keep training out of import time
  (an `if __name__ == "__main__":` guard), and do not restore in FUNCTION.

checks, in order (a failed check skips the rest):
  build       the factory ran (a failure is a usage error, exit 2)
  load        every file's size and xxh3-128 checksum, then a strict load into
              the built state (tensor shapes and keys must match)
  finite      every model tensor and optimizer state tensor is finite
  forward     loss_fn(model, batch) under torch.no_grad() returns a finite
              scalar (skipped without loss_fn)
  metric      the forward loss against the manifest metric (--expect-metric
              NAME, default "loss") with --rtol/--atol; reported only, and
              enforced only with --expect-metric
  train_step  with --train-step: backward, optimizer.step(), and parameters
              and loss stay finite

Never takes the run lock and never writes to the run, so it works while
training runs. Nothing is saved: the one training step is thrown away.

exit status:
  0  every check passed
  1  the checkpoint failed: corrupt file, mismatch with the built model,
     non-finite values, the forward or training step raised, or the loss is
     not within tolerance of --expect-metric
  2  usage error: missing run, unknown step, bad --build, the factory could
     not be imported, raised, or broke the contract
"""

_RESERVED = ("batch", "loss_fn")
_SHOWN = 5


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "restore-test",
        help="restore a checkpoint into a freshly built model and run it (CI gate)",
        description=textwrap.fill(
            "Build the training objects with your own factory function in this fresh "
            "process, load a checkpoint into them strictly (after checking every file's "
            "checksum), check every tensor is finite and run one forward pass "
            "(optionally one training step).",
            width=79,
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="RUN|CKPT", help="run directory or checkpoint directory")
    parser.add_argument(
        "--build",
        required=True,
        metavar="MODULE:FUNCTION",
        help="the factory, e.g. train:build or examples/train.py:build",
    )
    parser.add_argument(
        "--step", type=int, metavar="N", help="with a run directory: the step (default: newest)"
    )
    parser.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="directory to import MODULE from (repeatable; the current directory is always searched)",
    )
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="also run one optimizer step and check the parameters stay finite",
    )
    parser.add_argument(
        "--expect-metric",
        metavar="NAME",
        help="fail unless the forward loss matches the manifest metric NAME (e.g. loss)",
    )
    parser.add_argument(
        "--rtol",
        type=non_negative_float,
        default=1e-4,
        help="relative tolerance of the metric comparison",
    )
    parser.add_argument(
        "--atol",
        type=non_negative_float,
        default=1e-6,
        help="absolute tolerance of the metric comparison",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, *, out: TextIO, err: TextIO) -> int:
    checkpoint = resolve_checkpoint(args.target, step=args.step)
    report = restore_test(
        checkpoint,
        args.build,
        paths=[Path(p) for p in args.path],
        train_step=args.train_step,
        expect_metric=args.expect_metric,
        rtol=args.rtol,
        atol=args.atol,
    )
    report["target"] = args.target
    if args.json:
        out.write(json.dumps(report, indent=2) + "\n")
    else:
        _render(report, out)
    return EXIT_OK if report["ok"] else EXIT_BAD


# ------------------------------------------------------------------- the factory


def load_factory(spec: str, *, paths: list[Path]) -> Callable[[], Any]:
    """The callable ``spec`` names (``module:function`` or ``file.py:function``), or ``UsageError``."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(
            f"--build {spec!r}: expected MODULE:FUNCTION (e.g. train:build) or "
            "FILE.py:FUNCTION (e.g. examples/train.py:build)"
        )
    for p in paths:
        if not p.is_dir():
            raise UsageError(f"--path {p}: no such directory")
    is_file = _is_file_spec(where)
    file = Path(where)
    if is_file and not file.is_file():
        raise UsageError(f"--build {spec!r}: no such file {where}")
    search = _search_dirs(where, paths)
    with _on_sys_path(search):
        try:
            module = _import_file(file) if is_file else importlib.import_module(where)
        except ModuleNotFoundError as exc:
            if not is_file and (exc.name == where or where.startswith(f"{exc.name}.")):
                raise UsageError(
                    f"--build {spec!r}: no module named {exc.name!r} in "
                    f"{', '.join(str(p) for p in search)}; run from the directory that holds it "
                    "or pass --path DIR"
                ) from None
            raise UsageError(
                f"--build {spec!r}: importing {where} failed: {_one_line(exc)}"
            ) from None
        except (Exception, SystemExit) as exc:
            raise UsageError(
                f"--build {spec!r}: importing {where} failed: {_one_line(exc)}"
            ) from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"--build {spec!r}: {where} has no attribute {attr!r}") from None
    if not callable(obj):
        raise UsageError(f"--build {spec!r}: {attr} is a {type(obj).__name__}, not a function")
    factory: Callable[[], Any] = obj
    return factory


def _is_file_spec(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where


def _search_dirs(where: str, paths: list[Path]) -> list[Path]:
    """Where the factory's module, and what it imports while loading or building, are found."""
    if _is_file_spec(where):
        return [Path(where).resolve().parent, *paths]
    return [*paths, Path.cwd()]


@contextlib.contextmanager
def _on_sys_path(dirs: list[Path]) -> Iterator[None]:
    # The factory's module may import its siblings; removing the entries again
    # keeps an in-process caller's sys.path as it was.
    added = [str(d.resolve()) for d in dirs]
    sys.path[:0] = added
    try:
        yield
    finally:
        for entry in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(entry)


def _import_file(file: Path) -> ModuleType:
    name = file.stem if file.stem.isidentifier() and file.stem not in sys.modules else "_factory"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise UsageError(f"{file}: not a python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look classes up there.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _build(spec: str, *, paths: list[Path]) -> tuple[TrainState, Mapping[str, Any]]:
    factory = load_factory(spec, paths=paths)
    with _on_sys_path(_search_dirs(spec.rpartition(":")[0], paths)):
        try:
            built = factory()
        except (Exception, SystemExit) as exc:
            raise UsageError(f"--build {spec}: the factory raised {_one_line(exc)}") from None
    if not isinstance(built, Mapping):
        raise UsageError(
            f"--build {spec}: the factory returned a {type(built).__name__}; it must return a dict "
            "with at least 'model' (see `stalwart restore-test --help`)"
        )
    if built.get("model") is None:
        raise UsageError(
            f"--build {spec}: the factory's dict has no 'model' (keys: "
            f"{', '.join(map(str, built)) or 'none'})"
        )
    kwargs = {str(k): v for k, v in built.items() if k not in _RESERVED}
    try:
        state = TrainState(**kwargs)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--build {spec}: cannot make a TrainState from its dict: {exc}") from None
    return state, built


def _one_line(exc: BaseException) -> str:
    """``Type: message (file:line)``, the line being the innermost frame that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    # stalwart's own errors are self-explanatory; a line number helps only in user code.
    at = (
        f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})"
        if frames and not isinstance(exc, StalwartError)
        else ""
    )
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}{at}" if message else f"{type(exc).__name__}{at}"


# ------------------------------------------------------------------- the checks


class _Checks:
    """The ordered list of checks of one report; ``run`` times one and records its outcome."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.failed = False

    def add(self, name: str, status: str, detail: str, seconds: float | None = None) -> None:
        self.items.append(
            {
                "name": name,
                "status": status,
                "seconds": None if seconds is None else round(seconds, 6),
                "detail": detail,
            }
        )
        if status == "fail":
            self.failed = True

    def run(self, name: str, check: Callable[[], tuple[str, str]]) -> None:
        if self.failed:
            self.add(name, "skip", "an earlier check failed")
            return
        t0 = time.perf_counter()
        try:
            status, detail = check()
        except UsageError:
            raise
        except Exception as exc:
            status, detail = "fail", _one_line(exc)
        self.add(name, status, detail, None if status == "skip" else time.perf_counter() - t0)


def restore_test(
    checkpoint: Path,
    spec: str,
    *,
    paths: list[Path],
    train_step: bool = False,
    expect_metric: str | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-6,
) -> dict[str, Any]:
    """The ``--json`` report: path, step, ok, checks, loss, metric.

    Raises ``UsageError`` when the factory cannot be used; every failure of the
    checkpoint itself is a failed check in the report (``ok`` False).
    """
    checks = _Checks()
    t0 = time.perf_counter()
    state, built = _build(spec, paths=paths)
    loss_fn = built.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"--build {spec}: 'loss_fn' is a {type(loss_fn).__name__}, not a function")
    if loss_fn is None and (train_step or expect_metric):
        flag = "--train-step" if train_step else "--expect-metric"
        raise UsageError(f"{flag} needs a forward pass: return 'loss_fn' (and 'batch') from {spec}")
    if train_step and not state.optimizers:
        raise UsageError(f"--train-step needs an optimizer: return 'optimizer' from {spec}")
    parts = ", ".join(str(k) for k in built)
    checks.add("build", "pass", f"{spec} -> {parts}", time.perf_counter() - t0)
    model = state.model
    assert model is not None
    report: dict[str, Any] = {
        "path": str(checkpoint),
        "step": name_step(checkpoint),  # the manifest's step once loaded
        "ok": False,
        "build": spec,
        "checks": checks.items,
        "loss": None,
        "metric": None,
    }
    saved_metrics: dict[str, Any] = {}  # the manifest's, once loaded

    def load() -> tuple[str, str]:
        try:
            manifest = load_checkpoint(checkpoint, state, strict=True)
        except Exception:
            if not checkpoint.exists():
                raise UsageError(
                    f"{checkpoint} was deleted while being tested (retention of the running "
                    "job?); run the test again"
                ) from None
            raise
        report["step"] = manifest.step
        saved_metrics.update(manifest.metrics)
        return "pass", (
            f"{len(manifest.files)} files ({format_bytes(manifest.total_bytes)}) checksummed, "
            "loaded strictly"
        )

    def finite() -> tuple[str, str]:
        tensors = _named_tensors(model, state.optimizers)
        bad = [name for name, t in tensors if not bool(torch.isfinite(t).all())]
        if bad:
            return "fail", f"{len(bad)} of {len(tensors)} tensors not finite: {_preview(bad)}"
        return "pass", f"{len(tensors)} tensors finite"

    losses: list[float] = []

    def forward() -> tuple[str, str]:
        if loss_fn is None:
            return "skip", "the factory returned no loss_fn"
        with torch.no_grad():
            loss = _scalar(loss_fn(model, built.get("batch")))
        losses.append(loss)
        report["loss"] = loss if math.isfinite(loss) else None
        if not math.isfinite(loss):
            return "fail", f"loss is {loss}"
        return "pass", f"loss={loss:.6g}"

    def metric() -> tuple[str, str]:
        name = expect_metric or "loss"
        saved = saved_metrics.get(name)
        if not losses:
            return "skip", "no forward loss"
        if not isinstance(saved, (int, float)) or isinstance(saved, bool):
            detail = f"the manifest records no numeric metric {name!r}"
            return ("fail" if expect_metric else "skip"), detail
        close = math.isclose(losses[0], saved, rel_tol=rtol, abs_tol=atol)
        report["metric"] = {
            "name": name,
            "saved": saved,
            "restored": losses[0],
            "close": close,
            "enforced": expect_metric is not None,
        }
        detail = (
            f"restored {losses[0]:.6g}, manifest {name}={saved:.6g} "
            f"({'within' if close else 'outside'} rtol={rtol:g}, atol={atol:g})"
        )
        if expect_metric is None:
            return "info", detail + "; not enforced without --expect-metric"
        return ("pass" if close else "fail"), detail

    def one_step() -> tuple[str, str]:
        if not train_step:
            return "skip", "pass --train-step to run one optimizer step"
        assert loss_fn is not None
        for opt in state.optimizers:
            opt.zero_grad()
        loss = loss_fn(model, built.get("batch"))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            return "fail", "loss_fn must return a scalar tensor that requires grad"
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        for opt in state.optimizers:
            opt.step()
        bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            return "fail", f"parameters not finite after one step: {_preview(bad)}"
        return "pass", f"one step from loss={float(loss.detach()):.6g}, parameters finite"

    checks.run("load", load)
    checks.run("finite", finite)
    checks.run("forward", forward)
    checks.run("metric", metric)
    checks.run("train_step", one_step)
    report["ok"] = not checks.failed
    return report


def _named_tensors(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> list[tuple[str, torch.Tensor]]:
    tensors = [
        (f"model.{n}", t)
        for n, t in model.state_dict().items()
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    ]
    names = {id(p): n for n, p in model.named_parameters()}
    for i, opt in enumerate(optimizers):
        for param, values in opt.state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    where = names.get(id(param), f"optimizer[{i}]")
                    tensors.append((f"optimizer.{key}.{where}", value))
    return tensors


def _scalar(loss: Any) -> float:
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise TypeError(f"loss_fn returned a tensor of shape {list(loss.shape)}, not a scalar")
        return float(loss.detach().float().item())
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss)
    raise TypeError(f"loss_fn returned a {type(loss).__name__}, not a scalar tensor")


def _preview(items: list[str]) -> str:
    more = f", and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return "; ".join(items[:_SHOWN]) + more


# ------------------------------------------------------------------- output

_STYLES = {"pass": "green", "fail": "bold red", "skip": "dim", "info": "yellow"}


def _render(report: dict[str, Any], out: TextIO) -> None:
    console = make_console(out)
    step = "?" if report["step"] is None else report["step"]
    console.print(f"restore-test {report['path']} (step {step})", markup=False, soft_wrap=True)
    table = new_table("check", "result", "time", "detail", right=("time",), wrap=("detail",))
    for c in report["checks"]:
        table.add_row(
            c["name"],
            Text(
                c["status"].upper() if c["status"] == "fail" else c["status"],
                style=_STYLES[c["status"]],
            ),
            format_seconds(c["seconds"]),
            Text(c["detail"]),
        )
    console.print(table)
    if report["ok"]:
        console.print(f"PASS: step {step} restores and runs", markup=False, soft_wrap=True)
    else:
        failed = next(c for c in report["checks"] if c["status"] == "fail")
        console.print(f"FAIL: {failed['name']}: {failed['detail']}", markup=False, soft_wrap=True)
