"""The ``compress`` command line: apply, validate, inspect, recipes.

Exit codes: 0 ok; 2 bad input (one line naming what and where); 3 a validation threshold missed;
1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from compress.core.errors import CompressError, RecipeError, ValidationFailed, storage_error
from compress.core.progress import fig

if TYPE_CHECKING:
    from compress.export.records import ValidationRecord
    from compress.report import Report

log = logging.getLogger("compress")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, exit 2, like every other bad input
        self.exit(2, f"compress: error: {message} (see '{self.prog} --help')\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="compress", description="Recipe-driven model compression for PyTorch.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for unexpected errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    a = sub.add_parser("apply", help="run a recipe end to end and write a run folder")
    a.add_argument("recipe", help="recipe YAML file (or the name of a shipped recipe, see 'compress recipes')")
    a.add_argument("--out", help="run folder (default: runs/<recipe name>)")
    a.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set train.epochs=3 (repeatable)")
    a.add_argument("--device", choices=["cpu", "cuda"], help="device (default: the recipe's train.device)")
    a.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    a.add_argument("--overwrite", action="store_true", help="replace an existing run folder")
    a.add_argument("--resume", action="store_true", help="continue a run folder from its checkpoints")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.add_argument("--trust-code", action="store_true",
                   help="let the recipe run its own code (a pkg.module:factory for the model, data, teacher "
                   "or metric); without it such a recipe is refused (docs/security.md)")
    a.add_argument("--threads", type=int, help="intra-op CPU threads per process (the recipe's train.threads; "
                   "default: torch's, shared among ranks under torchrun)")

    v = sub.add_parser("validate", help="validate an exported ONNX model in a runtime (or a run on the CUDA int8 kernels)")
    v.add_argument("model", help="ONNX model file; with --backend cuda, a run folder of `compress apply`")
    v.add_argument("--reference", help="reference model: an fp32 ONNX file (parity and speedup are measured against it)")
    v.add_argument("--data", default="digits", help="eval data source (digits | synthetic | text | pkg.module:factory)")
    v.add_argument("--data-kwargs", default="{}", help="JSON kwargs for the data source")
    v.add_argument("--runtime", action="append", choices=["onnxruntime", "openvino"], help="runtime (repeatable)")
    v.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="cpu (ONNX runtimes) or cuda (the run's quantized model on the Triton int8 kernels vs fp16)")
    v.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes for latency")
    v.add_argument("--runs", type=int, default=20, help="timed runs per batch size (median reported)")
    v.add_argument("--threads", type=int, help="intra-op threads (default: all cores)")
    v.add_argument("--json", action="store_true", help="print JSON instead of a table")
    v.add_argument("--trust-code", action="store_true",
                   help="with --backend cuda: let the run's recipe run the code it names to rebuild the model")

    i = sub.add_parser("inspect", help="describe a recipe, an ONNX model, a checkpoint or a run folder")
    i.add_argument("path", help="recipe .yaml, model .onnx (integer coverage: what ORT still runs in float), "
                   "checkpoint .pt, or a run folder (its exports' coverage)")
    i.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    r = sub.add_parser("recipes", help="list the shipped recipes")
    for sp in (a, v, i, r):  # --debug is accepted after the command too (`compress apply X --debug`)
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def shipped_recipes() -> dict[str, Path]:
    """Name -> path of the shipped recipes (compress.recipe.shipped_recipes, imported on use)."""
    from compress.recipe import shipped_recipes as shipped

    return shipped()


def _cmd_apply(args: argparse.Namespace) -> int:
    from compress.recipe import load_recipe
    from compress.runner import apply, plan

    if args.threads is not None:
        if args.threads < 1:
            raise RecipeError(f"--threads: must be >= 1, got {args.threads}")
        args.overrides.append(f"train.threads={args.threads}")
    if not args.dry_run:  # a first line at once: building the model and data can take a while
        log.info("apply %s: loading the recipe, model and data", args.recipe)
    recipe = load_recipe(args.recipe, overrides=args.overrides, trust_code=args.trust_code)
    out = args.out or f"runs/{recipe.name}"
    if args.dry_run:
        # the same checks the run makes before training: a dry run that passes does not stop on them
        print(_render_plan(plan(recipe, device=args.device), overrides=args.overrides))
        recipe.require_trust()  # what the run would refuse, the dry run refuses too (after showing it)
        return 0
    report = apply(recipe, out_dir=out, device=args.device, overwrite=args.overwrite, resume=args.resume,
                   quiet=args.quiet, trust_code=args.trust_code)
    missed = [t for t in report.thresholds if not t.passed]
    if int(os.environ.get("RANK", "0")) != 0:
        # under torchrun every rank holds rank 0's report; rank 0 alone speaks, all exit alike
        return ValidationFailed.exit_code if missed else 0
    print(summary(report, out=Path(out)))
    if missed:
        raise ValidationFailed(", ".join(f"{t.name} {fig(t.value)} vs limit {fig(t.limit)}" for t in missed))
    return 0


def summary(report: Report, *, out: Path) -> str:
    """The closing lines of ``compress apply``: accuracy, size, runtime figures, thresholds."""
    b, f = report.baseline, report.final
    name = report.recipe.get("name", "recipe")
    lines = [f"{name}: baseline {report.metric} {fig(b.accuracy)} -> final {fig(f.accuracy)}; "
             f"params {_n(b.params)} -> {_n(f.params)}; {report.seconds or 0:.1f} s"
             + (f", peak RSS {report.peak_rss_mb:,.0f} MB" if report.peak_rss_mb else "")
             + f"; report: {out / 'report.md'}"]
    for v in report.validation:
        if v.generation is not None:  # a KV-cache generation file: prefill, decode, greedy tokens
            g = v.generation
            lines.append(
                f"  {v.runtime} {v.role} {v.precision}: prefill {fig(g['prefill_ms'])} ms"
                + (f" ({fig(g['prefill_speedup'])}x)" if "prefill_speedup" in g else "")
                + f"; decode {fig(g['decode_ms_per_token'])} ms/token, {g['tokens_per_s']:.0f} tokens/s"
                + (f" ({fig(g['decode_speedup'])}x)" if "decode_speedup" in g else "")
                + f"; greedy tokens = PyTorch {fig(v.parity.get('top1_agreement'))}"
            )
            lines += _slower_warnings(v)
            continue
        lat = ", ".join(f"b{k} {fig(ms)} ms" for k, ms in v.latency_ms.items())
        spd = ", ".join(f"b{k} {fig(x)}x" for k, x in (v.speedup or {}).items())
        lines.append(f"  {v.runtime} {v.role} {v.precision}: {report.metric} {fig(v.accuracy)}"
                     + (f"; latency {lat}" if lat else "") + (f"; speedup {spd}" if spd else ""))
        lines += _slower_warnings(v)
    for t in report.thresholds:
        lines.append(f"  threshold {t.name}: {fig(t.value)} (limit {fig(t.limit)}) {'ok' if t.passed else 'MISSED'}")
    return "\n".join(lines)


#: validation notes that change what a user should do with the file: shown on the console
WARNING_NOTES = ("measured slower", "CPU without VNNI", "predicted slower")


def short_note(note: str) -> str:
    """The head of a validation note, for one console line: its clauses (split at ``: `` and ``; ``
    outside parentheses) up to the one naming what happened (a :data:`WARNING_NOTES` phrase), and the
    next where that clause is the phrase alone. ``int8 measured slower than fp32 (batch 1: 0.90x):
    at these shapes ...`` -> ``int8 measured slower than fp32 (batch 1: 0.90x)``; the whole note
    stays in report.md and report.json."""
    parts: list[str] = []
    depth = start = i = 0
    while i < len(note):
        ch = note[i]
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ":;" and note[i + 1:i + 2] == " ":
            parts.append(note[start:i])
            start, i = i + 2, i + 2
            continue
        i += 1
    parts.append(note[start:])
    hit = next((j for j, p in enumerate(parts) if any(k in p for k in WARNING_NOTES)), len(parts) - 1)
    hit += parts[hit].strip() in WARNING_NOTES and hit + 1 < len(parts)
    return ": ".join(parts[:hit + 1])


def _slower_warnings(v: ValidationRecord) -> list[str]:
    """A short warning line for each note of ``v`` that asks for action (slower than fp32,
    saturation); the full note is in the run's report.md."""
    return [f"  warning: {v.runtime} {v.role} {v.precision}: {short_note(n)} (report.md says why)" for n in v.notes
            if any(k in n for k in WARNING_NOTES)]


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _render_plan(p: dict[str, Any], *, overrides: Sequence[str] = ()) -> str:
    params = "" if p["params"] is None else f" ({p['params']:,} params)"
    lines = [f"recipe {p['recipe']}: model {p['model']}{params}"]
    if overrides:
        lines.append("  overrides applied: " + ", ".join(overrides))
    if p.get("data"):
        lines.append(f"  data: {p['data']}")
    for c in p.get("code", []):  # code the recipe names: located, never imported by a plan
        lines.append(f"  code: {c['field']}: {c['callable']} from {c['where']}; {c['runs']}")
    if p.get("code"):
        lines.append("  (the modules each modifier matches are resolved when the run builds the model)")
    for s in p["stages"]:
        length = f"{s['steps']} steps" if s["steps"] else (f"{s['epochs']} epochs" if s["epochs"] else "one-shot")
        lines.append(f"  stage {s['stage']} ({length}, {s['pipeline']} pipeline)")
        for m in s["modifiers"]:
            mods = m["modules"]
            if mods is None:
                lines.append(f"    {m['type']}")
                continue
            shown = ", ".join(mods[:8]) + (f", ... ({len(mods)} in all)" if len(mods) > 8 else "")
            lines.append(f"    {m['type']}: {shown or '(whole model)'}")
    return "\n".join(lines)


def _cmd_validate(args: argparse.Namespace) -> int:
    from compress.validation import run_validate

    sizes = _int_list(args.batch_sizes, "--batch-sizes")
    try:
        kwargs = json.loads(args.data_kwargs)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"--data-kwargs: not valid JSON ({exc.msg} at column {exc.colno})") from None
    records = run_validate(
        Path(args.model), reference=Path(args.reference) if args.reference else None, data=args.data,
        data_kwargs=kwargs, runtimes=args.runtime or ["onnxruntime"], backend=args.backend, batch_sizes=sizes,
        runs=args.runs, threads=args.threads, trust_code=args.trust_code,
    )
    if args.json:
        print(json.dumps(records, indent=2, default=str))
    elif args.backend == "cuda":
        print(cuda_table(records))
    else:
        print(_compact_table(records))
        for row in records:
            for note in str(row.get("notes") or "").split("; "):
                if any(k in note for k in WARNING_NOTES):
                    print(f"warning: {row['runtime']} {row['model']}: {short_note(note)} (--json shows the whole note)")
    return 0


def cuda_table(rows: list[dict[str, Any]]) -> str:
    """``compress validate RUN --backend cuda`` for a terminal: one line per batch size, then every
    layer the deployed model keeps float, with the converter's reason."""
    head = ["batch", "float", "float ms", "converted ms", "speedup", "metric", "fp32", "converted", "parity dB"]
    body = [[r["batch"], r["float"], f"{r['float_ms']:.3g}", f"{r['int8_ms']:.3g}", f"{r['speedup']:.2f}x",
             r.get("metric") or "-", "-" if r.get("fp32") is None else fig(r["fp32"]),
             "-" if r.get("int8") is None else fig(r["int8"]),
             "-" if r.get("parity_sqnr_db") is None else f"{r['parity_sqnr_db']:.1f}"] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    if rows:
        kept = rows[0].get("kept_float") or []
        lines.append(f"{rows[0].get('int8_layers', 0)} layers converted, {len(kept)} kept float"
                     + (":" if kept else ""))
        lines += [f"  {k}" for k in kept]
    return "\n".join(lines)


def _compact_table(rows: list[dict[str, Any]]) -> str:
    """The validate rows a person reads on a terminal: one line per file and runtime, rounded;
    ``--json`` has every column."""
    batches = sorted({int(k[1:-3]) for r in rows for k in r if k.startswith("b") and k.endswith("_ms")})
    head = ["model", "runtime", "precision", "metric", "sqnr dB", *[f"b{b} ms" for b in batches], "speedup", "MB"]
    body = []
    for r in rows:
        spd = next((r.get(f"b{b}_speedup") for b in reversed(batches) if r.get(f"b{b}_speedup")), None)
        acc = "-" if r.get("accuracy") is None else f"{r['metric']} {fig(r['accuracy'])}"
        body.append([r["model"], r["runtime"], r["precision"], acc,
                     "-" if r.get("sqnr_db") is None else "exact" if r["sqnr_db"] >= 999 else f"{r['sqnr_db']:.1f}",
                     *["-" if r.get(f"b{b}_ms") is None else f"{r[f'b{b}_ms']:.3g}" for b in batches],
                     "-" if spd is None else f"{spd:.2f}x",
                     "-" if r.get("size_bytes") is None else f"{r['size_bytes'] / 1e6:.2f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    return "\n".join("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body])


def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise RecipeError(f"{flag}: '{text}' is not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise RecipeError(f"{flag}: '{text}' needs positive integers")
    return vals


def _cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.exists():
        if path.suffix not in ("", ".yaml", ".yml"):
            raise RecipeError(f"{args.path}: file not found")
        from compress.recipe import resolve_recipe_path

        path = resolve_recipe_path(args.path)
    if path.is_dir():
        from compress.export.inspect import inspect_run

        print(inspect_run(path))
    elif path.suffix in (".yaml", ".yml"):
        from compress.recipe import load_recipe
        from compress.runner import plan

        recipe = load_recipe(path, overrides=args.overrides)
        print(recipe.to_yaml())
        print(_render_plan(plan(recipe)))
    elif path.suffix == ".onnx":
        from compress.export.inspect import inspect_onnx

        print(inspect_onnx(path))
    elif path.suffix in (".pt", ".pth"):
        from compress.core.io import safe_torch_load

        state = safe_torch_load(path)  # a corrupt, truncated or pickled-module file: one line, exit 2
        sd = state.get("model", state) if isinstance(state, dict) else {}
        sd = sd if isinstance(sd, dict) else {}
        total = sum(t.numel() for t in sd.values() if hasattr(t, "numel"))
        epoch = f", epoch {state['epoch']}" if isinstance(state, dict) and "epoch" in state else ""
        print(f"{path}: {len(sd)} tensors, {total:,} values{epoch}")
        for k, t in list(sd.items())[:40]:
            shown = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if hasattr(t, "shape") else type(t).__name__
            print(f"  {k}: {shown}")
    else:
        raise RecipeError(
            f"{path}: cannot inspect '{path.suffix}' files (recipe .yaml, model .onnx, checkpoint .pt, run folder)"
        )
    return 0


def _cmd_recipes(_args: argparse.Namespace) -> int:
    from compress.recipe import load_recipe

    for name, path in shipped_recipes().items():
        try:
            desc = _first_sentence(load_recipe(path).description)
        except CompressError as exc:
            desc = f"(does not load: {exc})"
        print(f"{name:20s} {desc}")
    return 0


def _first_sentence(text: str) -> str:
    """The description's first sentence, whole (a YAML block wraps it over several lines)."""
    flat = " ".join(text.split())
    end = flat.find(". ")
    return flat if end < 0 else flat[: end + 1]


COMMANDS = {"apply": _cmd_apply, "validate": _cmd_validate, "inspect": _cmd_inspect, "recipes": _cmd_recipes}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``compress`` console script."""
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("COMPRESS_DEBUG") == "1"
    _console_logging(quiet=bool(getattr(args, "quiet", False)), debug=debug)
    try:
        _check_package()
        return COMMANDS[args.command](args)
    except CompressError as exc:
        if debug:
            raise
        print(f"compress: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        # the reader went away (`compress inspect X | head`): stop quietly, as a SIGPIPE'd tool does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:  # disk full, no permission: the user's to fix, in one line
        storage = storage_error(exc)
        if storage is None or debug:
            raise
        print(f"compress: error: {storage}", file=sys.stderr)
        return storage.exit_code
    except KeyboardInterrupt:
        print("compress: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        lost = _lost_peers(exc)
        if lost is not None:
            print(f"compress: error: {lost}", file=sys.stderr)
            return 1
        print(f"compress: internal error: {type(exc).__name__}: {exc} "
              f"(the traceback: rerun as 'compress --debug {args.command} ...'; a run's run.log holds it too)",
              file=sys.stderr)
        return 1


def _lost_peers(exc: BaseException) -> str | None:
    """One line for a failed collective under torchrun (a rank died, hung past the timeout, or the
    network failed), else None."""
    import re

    import torch.distributed as dist

    # gloo reports a peer that went away as a plain RuntimeError ("Connection closed by peer")
    peer_lost = int(os.environ.get("WORLD_SIZE", "1")) > 1 and isinstance(exc, RuntimeError) and re.search(
        r"gloo|nccl|connection closed|connection reset|timed out", str(exc), re.IGNORECASE) is not None
    if not (isinstance(exc, getattr(dist, "DistError", ())) or peer_lost):
        return None
    rank = os.environ.get("RANK", "?")
    first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
    first = re.sub(r"^\[[^\]]*\] ", "", first).split(" This is typically")[0]  # drop gloo's source path
    return (f"rank {rank}: lost the other ranks (one died, or hung past distributed.timeout_s): "
            f"{type(exc).__name__}: {first[:200]}; the run folder is incomplete: rerun with --resume")


class _ConsoleFormatter(logging.Formatter):
    """One line per record on the console: tracebacks belong in run.log (``--debug`` shows them).
    Redirected to a file, each line starts with the time (a log read later needs it)."""

    def __init__(self, *, debug: bool) -> None:
        stamp = "" if sys.stderr.isatty() else "%(asctime)s "
        super().__init__(stamp + "%(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        self.debug = debug

    def format(self, record: logging.LogRecord) -> str:
        if self.debug:
            return super().format(record)
        plain = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None, "stack_info": None})
        return super().format(plain)


def _console_logging(*, quiet: bool, debug: bool) -> None:
    """The console handler: INFO unless --quiet; records meant for run.log only stay off it; under
    torchrun only rank 0 speaks (the other ranks' lines go to their run.log files)."""
    from compress.core.progress import LOGGERS, ConsoleHandler, show_bars

    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(ConsoleHandler())  # its lines go above the progress bars, not into them
    root.setLevel(logging.WARNING)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    show_bars(not quiet)  # the per-layer bars of GPTQ/AWQ, SmoothQuant, calibration
    for name in LOGGERS:  # the toolkit's own INFO lines reach the console from the first one
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.INFO)
    for h in root.handlers:
        h.setLevel(logging.WARNING if quiet else logging.INFO)
        h.setFormatter(_ConsoleFormatter(debug=debug))
        h.addFilter(lambda rec: not getattr(rec, "file_only", False) and (rank0 or rec.levelno >= logging.ERROR))


def _check_package() -> None:
    """Fail at once when ``compress`` resolved to a folder without ``__init__.py`` (a namespace
    package: e.g. a clone named ``compress`` whose parent is on PYTHONPATH). Submodules still load
    through the installed package's finder, so such a run trains for minutes and dies at the first
    use of a package-level name."""
    import compress

    if getattr(compress, "__file__", None) is None:
        where = ", ".join(str(p) for p in getattr(compress, "__path__", [])) or "?"
        raise CompressError(
            f"'import compress' found the folder {where}, not the installed package (a directory named "
            "'compress' on sys.path shadows it, e.g. through PYTHONPATH or the current folder); "
            "remove that folder from PYTHONPATH or run from another folder"
        )


if __name__ == "__main__":
    sys.exit(main())
