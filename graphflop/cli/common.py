"""What every ``graphflop`` subcommand shares: the model arguments, loading the model they name,
the constructor-argument parser, the stdout console, and the one error path.

The error path (:func:`run_command`): an error the user can fix (bad spec, shape, dtype, data or
option, untraceable model, op without a rule, unexportable op, unusable device) prints one line,
``graphflop: error: ...``, to stderr and exits with status 2, with no traceback. Output files are
written atomically (:func:`graphflop.io.atomic_write`), only after the work succeeded, and a
command's files all together (:func:`graphflop.io.atomic_group`), so an error leaves no partial
output.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from graphflop.frontend.loss import NO_FLOAT_OUTPUT, differentiable, output_tensors
from graphflop.passes.optimizer import OPTIMIZERS

if TYPE_CHECKING:
    from graphflop.analysis import AnalyzeOptions

EXIT_USAGE = 2
EXIT_VERIFY_FAILED = 1
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130
#: a reader closed standard output's pipe before the command finished writing to it: the
#: status a shell gives a process that SIGPIPE ends (128 + 13)
EXIT_READER_GONE = 141
OPTIMIZER_CHOICES = list(OPTIMIZERS)


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that are the user's to fix (reported in one line, exit 2)."""
    from graphflop.devices import NoPeak, UnknownDevice
    from graphflop.export.graphviz import RenderError
    from graphflop.export.onnx import OnnxExportError
    from graphflop.frontend.trace import TraceError
    from graphflop.load import SpecError
    from graphflop.ops import MissingRuleError
    from graphflop.parallel import PlanError
    from graphflop.passes.checkpoint import CheckpointPatternError
    from graphflop.passes.selective_recompute import RecomputePolicyError
    from graphflop.passes.time_profile import ProfileError
    from graphflop.runtime.bench import BenchError
    from graphflop.runtime.onnxrt import DeviceError
    from graphflop.train.config import TrainError
    from graphflop.train.data import DataError

    return (
        SpecError,
        TraceError,
        MissingRuleError,
        OnnxExportError,
        RenderError,
        DataError,
        TrainError,
        DeviceError,
        BenchError,
        CheckpointPatternError,
        RecomputePolicyError,
        UnknownDevice,
        NoPeak,
        ProfileError,
        PlanError,
    )


def one_line(e: BaseException | str) -> str:
    """An exception's (or a warning's) message (its first argument) on one line."""
    args = getattr(e, "args", None)
    text = str(args[0]) if args else str(e)
    return " ".join(text.split())


def run_command(
    command: Callable[[argparse.Namespace, Console], int],
    args: argparse.Namespace,
    err: Console | None = None,
) -> int:
    """Run one subcommand and return its exit status.

    A user error (:func:`user_errors`, or an ``OSError`` naming a file: a path that cannot be
    read or written) is one stderr line and status 2; Ctrl-C one line and 130; the model's
    ``sys.exit`` one line and 2, and so is a ``BaseException`` of another kind (raised by the
    model's code: :func:`model_base_exception`); any other exception (a bug) one line and
    status 1; each with the traceback too under ``--debug``.

    Python warnings raised while the command runs (PyTorch's, the model's) are held back:
    after a command that ran, each distinct one is one ``warning:`` line on standard error;
    after an error they are dropped, so the error stays the only line (Python would print
    each over two lines, the second its source line). So are the command's notes
    (:func:`note_after_success`: the folders its outputs will make), printed after its
    warnings; each run has notes of its own.
    """
    err = err or Console(stderr=True)
    # the command returned (its status may still be 1: a failed --verify check)
    ran: list[bool] = []
    with warnings.catch_warnings(record=True) as caught, _command_notes() as notes:
        status = _run(command, args, err, ran)
    if ran:
        for line in dict.fromkeys(_warning_line(w) for w in caught):
            print(line, file=sys.stderr)
        for note in notes:  # the folders its outputs made
            print(note, file=sys.stderr)
    return status


#: the notes of the command running in this context (:func:`run_command` gives each command a
#: list of its own, and prints it after the command ran); None outside a command
_NOTES: ContextVar[list[str] | None] = ContextVar("graphflop_command_notes", default=None)


@contextmanager
def _command_notes() -> Iterator[list[str]]:
    """A list of notes of its own for the command run within: :func:`note_after_success`
    appends to it, and nothing is left of it after the command (a command run after it, or one
    running beside it in another thread, sees only its own)."""
    notes: list[str] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def note_after_success(line: str) -> None:
    """Say ``line`` on standard error after the running command (:func:`run_command`) has run;
    nothing after an error (the error stays the only line), nor outside a command."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append(line)


def _warning_line(w: warnings.WarningMessage) -> str:
    """``warning: Category: message (package/file.py:line)``."""
    where = w.filename.replace(os.sep, "/").rpartition("site-packages/")[2]
    return f"warning: {w.category.__name__}: {one_line(w.message)} ({where}:{w.lineno})"


def _run(
    command: Callable[[argparse.Namespace, Console], int],
    args: argparse.Namespace,
    err: Console,
    ran: list[bool],
) -> int:
    debug = bool(getattr(args, "debug", False))
    try:
        status = command(args, err)
        ran.append(True)
        return status
    except user_errors() as e:
        _debug_traceback(debug)
        print(f"graphflop: error: {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError as e:
        if e.filename is not None:
            raise
        # a plain print to standard output after its reader left (``| head``): nothing more
        # goes there, and the rest of the command is not done
        drop_stdout()
        return EXIT_READER_GONE
    except OSError as e:
        _debug_traceback(debug)
        if e.filename is None:
            # e.g. standard output on a full disk: OSError(28, ...) whose first argument is the
            # number, not the message
            why = e.strerror or one_line(e)
            print(f"graphflop: error: {why}", file=sys.stderr)
            return EXIT_USAGE
        print(
            f"graphflop: error: cannot use {e.filename}: {e.strerror or e}; "
            "choose another path or fix its permissions",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("graphflop: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit as e:
        # graphflop's commands return their status; an exit from inside one is the model's
        # code (sys.exit in forward): it must not end graphflop silently with the model's code
        _debug_traceback(debug)
        print(
            f"graphflop: error: the model exited while graphflop ran it (SystemExit({e.code!r})):"
            " remove the sys.exit call from its forward, or put it under "
            "if __name__ == '__main__':",
            file=sys.stderr,
        )
        return EXIT_USAGE
    except Exception as e:
        _debug_traceback(debug)
        print(
            f"graphflop: internal error: {type(e).__name__}: {one_line(e)} (a bug in graphflop; "
            "rerun with --debug for the traceback and report it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    except BaseException as e:
        # neither an Exception nor Ctrl-C nor an exit (caught above): graphflop raises none,
        # PyTorch neither, so the model's code raised it (a class of its own deriving from
        # BaseException, a GeneratorExit; a tester's finding: an 86-line traceback, exit 1).
        # _run is no generator: a GeneratorExit met here is no generator's close
        _debug_traceback(debug)
        print(f"graphflop: error: {model_base_exception(e)}", file=sys.stderr)
        return EXIT_USAGE


def model_base_exception(e: BaseException) -> str:
    """The one-line message for ``e``, a ``BaseException`` that is not an ``Exception`` (nor a
    ``KeyboardInterrupt`` or ``SystemExit``) raised while a command ran: the model's own, with
    the model's line where its traceback shows one."""
    from graphflop.frontend.libraries import model_source_line

    where = model_source_line(e)
    at = f" (at {where})" if where else ""
    text = one_line(e)
    said = f": {text}" if text else ""
    return (
        f"the model raised {type(e).__name__}{said}, a BaseException that is not an "
        f"Exception{at}; fix the model's code so that it does not raise it"
    )


def _debug_traceback(debug: bool) -> None:
    if debug:
        import traceback

        traceback.print_exc(file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE; see PROG --help``,
    and exit status 2 (argparse prints the whole usage first); its subparsers are one too.

    An option is taken only as spelled in full (``allow_abbrev=False``): argparse would read a
    prefix as the one option it starts (``--eval`` as ``--eval-every`` in a command without
    ``--eval``), so a mistyped or missing option ran as another."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        #: the subcommands' parsers by name (``graphflop.cli.build_parser`` fills it), so that
        #: an argument no parser takes is the subcommand's error (``see graphflop plan
        #: --help``), not the top-level parser's
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            owner = self.commands.get(getattr(parsed, "command", None) or "", self)
            owner.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def error(self, message: str):
        text = " ".join(message.split())
        opt = re.match(r"argument (--[\w-]+)(?:/\S+)?: expected one argument$", text)
        if opt:
            # argparse reads a value that starts with '-' (--input-shape -1,784) as an option
            text += f" (give it a value; one that starts with '-' is written {opt[1]}=VALUE)"
        self.exit(EXIT_USAGE, f"{self.prog}: error: {text}; see {self.prog} --help\n")


def add_debug_arg(p: argparse.ArgumentParser) -> None:
    """``--debug``: print the traceback of an error as well (every subcommand has it)."""
    p.add_argument(
        "--debug",
        action="store_true",
        help="on an error, print the Python traceback too (to report a bug)",
    )


def parse_ctor_kwargs(items: Sequence[str] | None, example: str = "middle_layers=10") -> dict:
    """``--arg NAME=VALUE`` items → constructor keywords; a VALUE that is a Python literal
    (``10``, ``0.5``, ``True``, ``(3, 4)``) is parsed, ``true``/``false`` in any case are the
    booleans (as JSON and YAML write them), anything else stays a string.

    Raises:
        SpecError: an item without ``=`` or without a name (the message shows ``example``), or
            a name given twice.
    """
    from graphflop.load import SpecError

    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"bad --arg {item!r}: write NAME=VALUE, e.g. {example}")
        if key in out:
            raise SpecError(f"--arg {key} is given twice: give each name once")
        if value.strip().lower() in ("true", "false"):
            out[key] = value.strip().lower() == "true"
            continue
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def add_model_args(
    p: argparse.ArgumentParser, *, inputs_and_loss: bool = True, outline_note: str = ""
) -> None:
    """The model arguments of ``inspect``, ``export``, ``bench``, ``render`` and ``sweep``;
    without ``inputs_and_loss`` (``sweep``, which traces each point from the file's
    ``example_inputs()`` in train mode with the default loss) no ``--input-shape``,
    ``--dtype``, ``--eval`` or ``--loss``; ``outline_note`` ends ``--no-outline``'s help (what
    it means for the subcommand's output)."""
    p.add_argument(
        "spec",
        help="model: path/to/file.py[:Name], package.module:attr, torchvision:NAME, timm:NAME, "
        "hf:PRESET (a published configuration graphflop ships, e.g. hf:llama-3.1-8b; "
        "graphflop models lists them), hf:ORG/NAME[@REV] (a Hub model's config.json, from "
        "the Hugging Face cache or the Hub, e.g. hf:meta-llama/Llama-3.1-8B), hf:MODEL_TYPE "
        "(transformers' default config, e.g. hf:llama) or hf:PATH (folder with config.json)",
    )
    if inputs_and_loss:
        p.add_argument(
            "--input-shape",
            action="append",
            metavar="N,C,H,W",
            help="shape of one input (repeat once per input); default: the file's example_inputs()",
        )
        p.add_argument(
            "--dtype",
            default=None,
            help="dtype of floating inputs and parameters "
            "(float32, float64, float16, bfloat16); default float32; int64 or int32 with "
            "--input-shape: integer inputs (token ids for an nn.Embedding), float32 parameters",
        )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="set the batch to N: the first dimension of every input whose first dimension is "
        "the example's batch (the first input's) becomes N; other inputs (a (T,) positions "
        "tensor) keep their shape",
    )
    p.add_argument(
        "--arg",
        action="append",
        metavar="NAME=VALUE",
        help="constructor argument for the model (repeatable), e.g. middle_layers=10",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length of an hf: model's token inputs (default 128)",
    )
    if inputs_and_loss:
        p.add_argument(
            "--eval",
            action="store_true",
            help="trace in eval mode (batch norm uses running statistics)",
        )
    p.add_argument(
        "--no-outline",
        dest="outline",
        action="store_false",
        help="trace every call of a repeated block (default: each distinct block once, copied "
        "at its other calls, its forward's Python code run at the first call only); for "
        "blocks whose forward depends on Python state outside them (a global counter, a "
        "class attribute set between calls)" + outline_note,
    )
    if inputs_and_loss:
        p.add_argument(
            "--loss",
            default="auto",
            choices=["auto", "cross_entropy", "mse", "sum"],
            help="loss the backward starts from (default: cross-entropy against random "
            "integer targets for (N, C) logits and a language model's (B, T, V) token logits, "
            "the mean over the B·T tokens; sum otherwise; the sum of a complex output adds "
            "its real and imaginary parts)",
        )


def load_model(args: argparse.Namespace, *, note_eval: bool = True):
    """The model named by the model arguments, on the meta device, and its example inputs.
    ``note_eval``: note on stderr the modules the model left in eval mode (off for the
    commands that print the report's assumptions, which name them).

    Returns:
        ``(LoadedModel, inputs)``: the model in ``--dtype`` and train mode (eval with
        ``--eval``); one FakeTensor or meta tensor per input.

    Raises:
        SpecError: see :func:`graphflop.load.load` and :func:`graphflop.load.make_inputs`.
    """
    from graphflop.load import load, make_inputs, parse_dtype, parse_shape, set_training_mode

    shapes = [parse_shape(s) for s in args.input_shape] if args.input_shape else None
    dtype = parse_dtype(args.dtype) if args.dtype else None
    loaded = load(
        args.spec,
        ctor_kwargs=parse_ctor_kwargs(args.arg),
        meta=True,
        seq=getattr(args, "seq", None),
    )
    check_seq_used(args, loaded)
    for note in loaded.notes:
        print(f"note: {note}", file=sys.stderr)
    check_dtype(args, loaded, shapes)
    if dtype is not None and dtype.is_floating_point:
        loaded.model.to(dtype)
    kept = set_training_mode(loaded.model, args.eval)
    if kept and note_eval:
        shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
        print(
            f"note: {shown} kept in eval mode, as the model's code left "
            f"{'it' if len(kept) == 1 else 'them'} (--eval puts every module in eval mode)",
            file=sys.stderr,
        )
    inputs = make_inputs(loaded, shapes=shapes, dtype=dtype, batch=args.batch)
    return loaded, inputs


def check_seq_used(args: argparse.Namespace, loaded: Any) -> None:
    """Refuse ``--seq`` for a model none of whose inputs has a sequence length (an ``hf:``
    vision model: its image size is the configuration's), which would ignore it.

    Raises:
        SpecError: ``--seq`` given and ``loaded.seq_inputs`` empty.
    """
    from graphflop.load import SpecError

    seq = getattr(args, "seq", None)
    if seq is not None and loaded.seq_inputs == ():
        raise SpecError(
            f"--seq {seq} sets the length of token inputs, and {loaded.name} takes none (its "
            "inputs' shapes come from its configuration, e.g. --arg image_size=N): drop --seq"
        )


def load_real_model(args: argparse.Namespace, *, dtype: bool = False):
    """The model named by ``args`` with real (randomly initialised) weights, in train mode
    (eval with ``--eval``), and in ``--dtype`` when ``dtype`` is set.

    Raises:
        SpecError: see :func:`graphflop.load.load`.
    """
    from graphflop.load import load, parse_dtype, set_training_mode

    real = load(args.spec, ctor_kwargs=parse_ctor_kwargs(args.arg), seq=getattr(args, "seq", None))
    check_seq_used(args, real)
    set_training_mode(real.model, args.eval)
    # an integer --dtype is the inputs' (token ids): the parameters stay floating point
    if dtype and args.dtype and parse_dtype(args.dtype).is_floating_point:
        real.model.to(parse_dtype(args.dtype))
    return real


def print_warnings(err: Console, analysis: Any, extra: Sequence[str] = ()) -> None:
    """The analysis's warnings (ops it could not count or differentiate, no trainable
    parameter: :func:`graphflop.export.report.warning_lines`), then ``extra``, on stderr."""
    from graphflop.export.report import warning_lines

    for line in [*warning_lines(analysis.report), *outline_notes(analysis), *extra]:
        err.print(line, markup=False, highlight=False, soft_wrap=True)


def outline_notes(analysis: Any) -> list[str]:
    """One line naming the repeated blocks traced in full, each copy on its own, and why
    (:attr:`graphflop.analysis.Analysis.outlined`); none where every repeated block was traced
    once."""
    in_full = analysis.outlined.in_full
    if not in_full:
        return []
    return [
        "note: repeated blocks traced in full, each copy on its own (the figures are the same, "
        "the analysis slower): " + "; ".join(in_full)
    ]


def analyze_model(
    args: argparse.Namespace,
    loaded,
    inputs,
    status,
    *,
    err: Console | None = None,
    why: str | None = None,
    options: AnalyzeOptions | None = None,
):
    """:func:`graphflop.analysis.analyze` of a loaded model with ``options`` (default
    ``AnalyzeOptions()``) and the ``--loss`` and ``--optimizer`` arguments, reporting its
    stages on ``status`` (a rich status spinner).

    A model whose output has nothing to differentiate is analysed forward only, with a note on
    ``err`` (:func:`check_backward_possible` refuses it before the analysis where something
    needs the backward; this catches what that check could not run).

    Raises:
        SpecError: the output has nothing to differentiate and :func:`backward_reason` names
            something that needs the backward (``why``, or an explicit ``--loss``).
    """
    from graphflop.analysis import AnalyzeOptions, analyze

    options = replace(
        options or AnalyzeOptions(),
        loss=args.loss,
        optimizer=args.optimizer,
        outline=getattr(args, "outline", True),
    )
    with shape_hint(args):
        analysis = analyze(
            loaded.model, inputs, options, name=loaded.name, progress=lambda m: status.update(m)
        )
    asked = options.backward or options.jvp
    if asked and analysis.report.loss == "none":
        # nothing to differentiate (the trace saw an integer output; the analysis is forward
        # only): a note, or, where the command needs the backward, an error
        _forward_only(args, err, why)
    return analysis


#: the start of the message of a trace that the model's own code stopped
_TRACE_FAILED = "tracing the model on the example inputs failed: "

#: PyTorch's messages for operands whose shapes do not fit (a matrix product's reduction dim,
#: a convolution's channels, broadcasting, a view's size, an input's number of dimensions)
_SHAPE_MISMATCH = re.compile(
    r"reduction dim|shapes cannot be multiplied|size mismatch|must match the size|"
    r"to have \d+ channels|broadcast|is invalid for input of size|normalized_shape|"
    r"\d+D \(unbatched\)|dimension out of range|expected .*input.*(?:size|shape|dim)",
    re.IGNORECASE,
)


@contextmanager
def shape_hint(args: argparse.Namespace) -> Iterator[None]:
    """Add, to a trace error that is a shape mismatch (:data:`_SHAPE_MISMATCH`, PyTorch's
    bare message: ``a and b must have same reduction dim``), where the inputs' shapes came
    from: ``--input-shape`` (as given), or the model file's ``example_inputs()``; and
    ``--batch`` where it set their first dimension. Inputs graphflop makes itself (``hf:``,
    ``torchvision:``, ``timm:`` specs) get no hint; other errors pass unchanged.

    Raises:
        TraceError: the trace's, with the hint appended (still one line).
    """
    from graphflop.frontend.trace import TraceError

    try:
        yield
    except TraceError as e:
        text = one_line(e)
        if not text.startswith(_TRACE_FAILED) or not _SHAPE_MISMATCH.search(text):
            raise
        hint = _inputs_origin(args)
        if hint is None:
            raise
        raise TraceError(f"{text.removesuffix('.')}; {hint}") from e


def _inputs_origin(args: argparse.Namespace) -> str | None:
    """Where the inputs' shapes came from and what to check, or None for inputs graphflop
    makes itself."""
    from graphflop.load import LIBRARIES

    batch = getattr(args, "batch", None)
    with_batch = f" with --batch {batch}" if batch is not None else ""
    shapes = getattr(args, "input_shape", None)
    if shapes:
        given = " ".join(f"--input-shape {s}" for s in shapes)
        return (
            f"the inputs' shapes come from {given}{with_batch}: check them against the shapes "
            "the model's first layers take (in_features, channels)"
        )
    library = str(args.spec).partition(":")[0]
    if library in (*LIBRARIES, "hf") and not str(args.spec).endswith(".py"):
        return None
    return (
        f"the inputs' shapes come from the model file's example_inputs(){with_batch}: check "
        "them against the shapes the model's first layers take, or give --input-shape"
    )


def drop_stdout() -> None:
    """Point standard output (file descriptor 1) at ``/dev/null``: its reader has gone, and
    later writes, the exit's flush included, must not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


class StdoutConsole(Console):
    """Rich console for standard output that outlives its reader: when a table meets a closed
    pipe (``graphflop inspect M | head``) the rest of the output is dropped and the command goes
    on (its files are still written; the status is the command's). Rich's own console exits
    with status 1 there, which reads as graphflop's internal-error status."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        drop_stdout()


def stdout_console() -> Console:
    """Rich console for stdout; wide when stdout is not a terminal so tables don't wrap."""
    return StdoutConsole() if sys.stdout.isatty() else StdoutConsole(width=180)


# --- checks made before any work -----------------------------------------------------------


def check_output_file(path: str | None, option: str, suffixes: Sequence[str] | None = None) -> None:
    """Check, before any work, that ``path`` (the value of ``option``) can be written as a file
    (:func:`graphflop.io.unwritable`) with one of ``suffixes`` (lower case, with the dot) when
    given. Nothing is created.

    Raises:
        SpecError: the message names the option, the path and what to change.
    """
    from graphflop.io import unwritable
    from graphflop.load import SpecError

    if path is None:
        return
    if not path.strip():
        raise SpecError(f"{option} needs a file name, not an empty string: give a path")
    if os.path.isdir(path):
        raise SpecError(f"cannot write {option} {path}: it is an existing folder: give a file name")
    if suffixes is not None and os.path.splitext(path)[1].lower() not in suffixes:
        raise SpecError(f"{option} {path}: unsupported suffix; use one of {', '.join(suffixes)}")
    why = unwritable(path)
    if why:
        raise SpecError(f"cannot write {option} {path}: {why}")
    missing = [q for q in Path(path).absolute().parents if not q.exists()]
    if missing:  # made when the file is written: said, so that a mistyped folder shows
        note_after_success(f"note: {option} {path}: creating the folder {missing[0]}")


def check_distinct_outputs(outputs: dict[str, str | None], spec: str | None = None) -> None:
    """Refuse, before any work, two output options (``{option: path}``) naming one file (the
    later write would replace the earlier one), and an output naming a file the model ``spec``
    is read from (:func:`graphflop.load.model_files`: writing it would replace the model). A
    device (``/dev/null``) may take several outputs: each is written into it, none replaces it.

    Raises:
        SpecError: naming both options (or the option and the model) and the path.
    """
    from graphflop.io import not_regular
    from graphflop.load import SpecError, model_files

    def key(path: str | os.PathLike) -> str:
        return os.path.normcase(os.path.realpath(path))

    models = {key(f) for f in model_files(spec)} if spec else set()
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if not path:
            continue
        k = key(path)
        if k in models:
            raise SpecError(
                f"{option} {path} is the file the model {spec} comes from: writing it would replace the "
                "model; give the output another name"
            )
        if k in seen and not not_regular(path):
            raise SpecError(
                f"{seen[k]} and {option} both name {path}: give each output its own file"
            )
        seen[k] = option


def check_output_dir(path: str | None, option: str) -> None:
    """Check, before any work, that the folder ``path`` (the value of ``option``) can be
    created or written into (:func:`graphflop.io.unwritable`). Nothing is created.

    Raises:
        SpecError: the message names the option, the path and what to change.
    """
    from graphflop.io import unwritable
    from graphflop.load import SpecError

    if path is not None and not path.strip():
        # "" would be the current folder: export's files landed among the user's
        raise SpecError(f"{option} needs a folder name, not an empty string: give a path")
    why = unwritable(path, folder=True) if path else None
    if why:
        raise SpecError(f"cannot write {option} {path}: {why}")


def check_export_dir(path: str | None, option: str) -> None:
    """Refuse, before any work, an export folder ``path`` holding files no export writes
    (:func:`graphflop.export.onnx.foreign_files`): the new manifest would sit beside them (an
    earlier export's own graph files are replaced or removed by the export itself).

    Raises:
        SpecError: naming the option, the folder and the files.
    """
    from graphflop.export.onnx import foreign_files
    from graphflop.load import SpecError

    other = foreign_files(path) if path else []
    if other:
        shown = ", ".join(other[:5]) + (f" and {len(other) - 5} more" if len(other) > 5 else "")
        raise SpecError(
            f"{option} {path} holds files an export does not write ({shown}): they would sit "
            "beside the new manifest; give an empty or new folder"
        )


def check_dtype(args: argparse.Namespace, loaded, shapes=None) -> None:
    """Reject a ``--dtype`` that is not floating point for a model with floating-point inputs
    (``--dtype`` sets the dtype of floating inputs and parameters; an integer one is for
    models that take integers, e.g. token ids).

    Without ``--input-shape``, the file's ``example_inputs()`` tell: a floating-point one is
    refused. With ``--input-shape`` (or without ``example_inputs()``), the forward runs once on
    meta inputs of the integer dtype (:func:`_forward_error`): where it fails and runs with
    float32 inputs, the model uses its input as floating point (its first op a Linear or a
    convolution) and the dtype is refused; where it runs (an ``nn.Embedding``,
    ``nn.EmbeddingBag`` or ``F.embedding`` looks the ids up) it is taken. Where neither runs the
    trace reports why.

    Raises:
        SpecError: naming the dtype, why it does not fit, and the floating-point choices.
    """
    from graphflop.load import SpecError, make_inputs, parse_dtype

    dtype = parse_dtype(args.dtype) if getattr(args, "dtype", None) else None
    if dtype is None or dtype.is_floating_point:
        return
    use = "use float32, float64, float16 or bfloat16"
    batch = getattr(args, "batch", None)
    if not shapes:
        default = make_inputs(loaded, batch=batch)  # SpecError without example_inputs()
        if any(t.is_floating_point() for t in default):
            raise SpecError(
                f"--dtype {args.dtype} is not a floating-point dtype, and the model's "
                f"example_inputs() gives floating-point inputs: {use} (an integer dtype is for "
                "inputs given with --input-shape that the model takes as indices, e.g. token ids)"
            )
        return
    ints = make_inputs(loaded, shapes=shapes, dtype=dtype, batch=batch, device="meta")
    failed = _forward_error(loaded.model, ints)
    if failed is None:
        return
    floats = make_inputs(loaded, shapes=shapes, batch=batch, device="meta")
    if _forward_error(loaded.model, floats) is None:
        raise SpecError(
            f"--dtype {args.dtype} is not a floating-point dtype, and the model takes "
            f"floating-point inputs (on {args.dtype} inputs its forward fails: {failed}): {use}; "
            "an integer dtype is for models whose inputs are indices, e.g. token ids into an "
            "nn.Embedding"
        )


def _forward_error(model, inputs) -> str | None:
    """Why ``model(*inputs)`` (meta inputs, no grad) fails, in one line
    (``RuntimeError: ...``), or None where it runs: on meta tensors, else on fake tensors as the
    trace runs it (:func:`float_output`'s probe). A matrix product or convolution of operands
    in two dtypes fails, as in eager PyTorch (the meta kernels do not check:
    :func:`_eager_dtypes_mode`)."""
    import torch

    from graphflop.frontend import nodynamo
    from graphflop.frontend.errors import first_line, library_logs_quiet, quiet_loggers

    def forward():
        with torch.no_grad(), warnings.catch_warnings(), _eager_dtypes_mode():
            warnings.simplefilter("ignore")
            return model(*inputs)

    why = None
    for run in (forward, lambda: _fake_forward(model, inputs, eager_dtypes=True)):
        try:
            with quiet_loggers("torch._subclasses.fake_tensor"), library_logs_quiet():
                nodynamo.run(run)
        except Exception as e:
            why = why or f"{type(e).__name__}: {first_line(e)}"
            continue
        return None
    return why


def _eager_dtypes_mode():
    """A dispatch mode refusing, as eager PyTorch does, a matrix product or convolution whose
    operands have two dtypes (the trace's check, :data:`graphflop.frontend.trace.SAME_DTYPE_OPERANDS`;
    meta and fake kernels let them through)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphflop.frontend.trace import SAME_DTYPE_OPERANDS

    class EagerDtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            where = SAME_DTYPE_OPERANDS.get(func)
            if where is not None:
                dtypes = {a.dtype for i in where if isinstance(a := args[i], torch.Tensor)}
                if len(dtypes) > 1:
                    names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                    raise RuntimeError(f"{func.name()} of {names} operands")
            return func(*args, **(kwargs or {}))

    return EagerDtypes()


def float_output(model, inputs) -> bool:
    """Whether ``model``'s output (run on the meta ``inputs``) has a floating-point tensor, i.e.
    something to differentiate. The forward runs on meta tensors, and where that fails (a
    tensor made in ``forward`` on the CPU meets a meta one), on fake tensors as the trace runs
    it; True when neither runs (the trace then reports why). The forward runs without
    importing Dynamo (:mod:`graphflop.frontend.nodynamo`): on meta tensors it costs little, the
    import 2 s."""
    import torch

    from graphflop.frontend import nodynamo
    from graphflop.frontend.errors import library_logs_quiet, quiet_loggers

    def forward():
        # a probe: its warnings are not the model's (checkpoint's, that nothing requires grad)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model(*inputs)

    for run in (forward, lambda: _fake_forward(model, inputs)):
        try:
            # FakeTensorMode logs a kernel's traceback before raising it: the error is the
            # trace's to report, in one line
            with quiet_loggers("torch._subclasses.fake_tensor"), library_logs_quiet():
                out = nodynamo.run(run)
        except Exception:
            continue
        tensors = output_tensors(out)
        return not tensors or any(map(differentiable, tensors))
    return True


def _fake_forward(model, inputs, *, eager_dtypes: bool = False):
    """``model(*inputs)`` on FakeTensors made as the trace makes them (a meta parameter or
    input becomes a fake CPU tensor); ``eager_dtypes``: refusing operands of two dtypes in a
    matrix product as eager PyTorch does (:func:`_eager_dtypes_mode`)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map

    from graphflop.frontend.trace import as_fake

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t):
        return as_fake(mode, t) if isinstance(t, torch.Tensor) else t

    state = {k: fake(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}
    checks = _eager_dtypes_mode() if eager_dtypes else contextlib.nullcontext()
    with torch.no_grad(), mode, checks:
        return torch.func.functional_call(model, state, tree_map(fake, tuple(inputs)))


def backward_reason(args: argparse.Namespace, why: str | None = None) -> str | None:
    """What in this command needs the backward: ``why`` (an option, or the command itself),
    else an explicit ``--loss``; None when nothing does."""
    loss = getattr(args, "loss", "auto")
    return why or (f"--loss {loss}" if loss != "auto" else None)


def check_backward_possible(
    args: argparse.Namespace, loaded, inputs, *, why: str | None = None
) -> None:
    """Before any work, where something needs the backward (:func:`backward_reason`): run the
    model once (:func:`float_output`) and refuse an output with nothing to differentiate.
    Nothing runs otherwise: the trace finds such an output, and :func:`analyze_model` notes
    it (the check costs a forward: 0.8 s for GPT-2 XL at batch 8).

    Raises:
        SpecError: naming what needs the backward and what to return instead.
    """
    why = backward_reason(args, why)
    if why and not float_output(loaded.model, inputs):
        _forward_only(args, None, why)


def _forward_only(args: argparse.Namespace, err: Console | None, why: str | None) -> None:
    """The note that a model's output has nothing to differentiate, or the error where
    :func:`backward_reason` names something that needs the backward."""
    from graphflop.load import SpecError

    why = backward_reason(args, why)
    if why:
        what = "a JVP" if why == "--graph jvp" else "a backward"
        raise SpecError(
            f"{why} needs {what}, but {NO_FLOAT_OUTPUT}: return the logits or scores instead"
        )
    (err or Console(stderr=True)).print(
        f"note: {NO_FLOAT_OUTPUT}; analysing the forward only", soft_wrap=True
    )
