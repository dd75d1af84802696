"""What the commands share: the ``lade-export`` group (``main``), which turns typed errors,
usage errors and interrupts into one-line messages and exit codes, the options several
commands declare alike, and small helpers (the stderr console, ``--profile`` values, an
artifact opened for decoding). The command modules add their commands to ``main``."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import click

from ..backends import BACKENDS
from ..errors import INTERRUPTED_AFTER_BUILD, LadeError, ProfileError, interrupted_after_build
from ..profile import resolve_profile

#: How a CPU build of PyTorch is installed (the README's "PyTorch first").
TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"

#: Modules of the optional extras (pyproject.toml) -> the extra that installs them.
_EXTRAS = {"torch": "export", "transformers": "export", "safetensors": "export", "gguf": "export",
           "accelerate": "export", "onnx": "export", "onnxscript": "export", "onnxslim": "export",
           "polygraphy": "export", "matplotlib": "bench", "tritonclient": "serve", "starlette": "http",
           "uvicorn": "http", "prometheus_client": "http"}


# ctx.meta key: the folder a build or export has written (set once its artifact is complete)
BUILD_WRITTEN = "lade_export.build_written"


def _null_closed_streams() -> None:
    """A standard stream the caller closed (``>&-``, ``<&-``) is None in Python: it becomes
    the null device, so writing output goes nowhere and reading a prompt reads nothing (an
    empty prompt, refused in one line) instead of an AttributeError."""
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))


def _output_failed(err: OSError) -> None:
    """Exit after an error that is no file's: the reader of standard output left (``| head``:
    141, quietly, as SIGPIPE would) or writing it failed (a full disk: one line, exit 2).
    Standard output becomes the null device first, so the interpreter's flush at exit
    does not fail again."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if isinstance(err, BrokenPipeError):
        sys.exit(141)
    with contextlib.suppress(OSError):
        click.echo(f"error: cannot write the output: {err.strerror or err}", err=True)
    sys.exit(2)


class _Group(click.Group):
    """Turns typed errors, usage errors and interrupts into one-line messages and exit codes."""

    def make_context(self, *args, **kwargs):
        self._context = super().make_context(*args, **kwargs)  # its meta, for the interrupt handler of main
        return self._context

    def main(self, *args, **kwargs):
        kwargs.setdefault("standalone_mode", False)
        self._context = None
        _null_closed_streams()
        try:
            return super().main(*args, **kwargs)
        except OSError as err:  # writing click's own output (--help, a usage line) failed
            _output_failed(err)
        except click.exceptions.Exit as done:
            sys.exit(done.exit_code)
        except click.exceptions.NoArgsIsHelpError as err:  # a bare group: its help, as click prints it
            click.echo(err.format_message(), err=True)
            sys.exit(2)
        except click.UsageError as err:
            # the command as it was run, as click's own usage lines name it ("lade-export serve",
            # "python -m lade_export.cli serve"): the hint runs as written where the error appeared
            where = err.ctx.command_path if err.ctx else "lade-export"
            click.echo(f"error: {err.format_message()} (see: {where} --help)", err=True)
            sys.exit(2)
        except click.ClickException as err:
            click.echo(f"error: {err.format_message()}", err=True)
            sys.exit(err.exit_code)
        except click.Abort as err:  # an interrupt outside the command's own code (click's way in or out)
            if isinstance(err.__cause__, EOFError):  # click turns an EOFError into Abort as it does ^C
                click.echo(f"error: unexpected end of input: {err.__cause__}".rstrip(": "), err=True)
                sys.exit(2)
            written = self._context.meta.get(BUILD_WRITTEN) if self._context is not None else None
            click.echo(f"error: {interrupted_after_build(written)}" if written else "error: interrupted", err=True)
            sys.exit(130)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except LadeError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(err.exit_code)
        except ModuleNotFoundError as err:
            extra = _EXTRAS.get((err.name or "").split(".")[0])
            if extra is None:
                raise
            first = ""  # PyPI's default torch on Linux is a CUDA build of several GB: a CPU one first
            if extra in ("export", "bench") and importlib.util.find_spec("torch") is None:
                first = f"a CPU build of PyTorch first ({TORCH_CPU}), then "
            click.echo(f"error: lade-export {ctx.invoked_subcommand} needs {err.name}, which this install lacks: "
                       f"{first}pip install 'lade-export[{extra}]'", err=True)
            sys.exit(2)
        except OSError as err:  # the file system refused something no check foresaw: one line, not a traceback
            if isinstance(err.__context__, KeyboardInterrupt):  # a cleanup after an interrupt failed too
                click.echo("error: interrupted", err=True)
                sys.exit(130)
            if isinstance(err, BrokenPipeError) or not err.filename:  # standard output (a full disk, | head)
                _output_failed(err)
            where = f": {err.filename}" + (f" -> {err.filename2}" if err.filename2 else "")
            click.echo(f"error: {err.strerror or err}{where}", err=True)
            sys.exit(2)
        except SystemExit as err:  # rich's console exits 1 when its reader left (| head): as SIGPIPE would, 141
            if err.code == 1 and isinstance(err.__context__, BrokenPipeError):
                sys.exit(141)
            raise
        except KeyboardInterrupt as err:
            message = "error: interrupted"
            if ctx.invoked_subcommand in ("build", "export"):
                written = ctx.meta.get(BUILD_WRITTEN)
                message = f"error: {err}" if str(err).startswith(INTERRUPTED_AFTER_BUILD) else \
                    f"error: {interrupted_after_build(written)}" if written else \
                    "error: interrupted; nothing was written"
            click.echo(message, err=True)
            sys.exit(130)


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _probe_writable(folder: Path) -> None:
    """Raise click.BadParameter unless a file can be created in ``folder``'s nearest existing
    ancestor (``folder`` itself when it exists): by creating and removing one, since a
    permission check alone passes for root on read-only and virtual file systems."""
    at = folder
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        raise click.BadParameter(f"{at} is not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=".lade-export-probe-", dir=at)
    except OSError as err:
        raise click.BadParameter(f"cannot write in {at}: {err.strerror or err}") from None
    os.close(fd)
    try:
        os.unlink(name)
    except OSError as err:  # a folder that takes files but not their removal (append-only): say what was left
        raise click.BadParameter(f"cannot remove files in {at} ({name} is left there): {err.strerror or err}") from None


def _writable_beside(ctx, param, value):
    """``--out`` of a file or directory written beside itself and renamed into place (build,
    export, tune): its folder must take new files. Checked before any work is done; not for
    ``build --dry-run``, which writes nothing (an eager option, so it is known here)."""
    if ctx.params.get("dry_run"):
        return value
    if value is not None and str(value).strip():
        _probe_writable(Path(value).parent)
    return value


def _writable_folder(ctx, param, value):
    """``--out`` of a folder written into (compare's results, triton's repository): it, or
    the folder that will hold it, must take new files. Checked before any work is done (an
    existing file is left to the command, whose message says what to give instead)."""
    if value is not None and str(value).strip() and not Path(value).is_file():
        _probe_writable(Path(value))
    return value


# Parameters that several commands declare alike, written once. Each use of one of these
# decorators adds a parameter of its own to its command (click makes a new Option per use),
# so a command's --help is what it was when each command wrote them out.
_artifact_dir = click.argument("artifact_dir", type=click.Path(path_type=Path))  # the commands that read a build
_artifact_out = click.option("--out", required=True, type=click.Path(path_type=Path), callback=_writable_beside,
                             help="Artifact directory to create.")  # build, export
_backend = click.option("--backend", type=click.Choice(BACKENDS), default="ort",
                        show_default=True)  # generate, compare, tune
_device = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu",
                       show_default=True)  # generate, compare
#: Most ``--threads`` a command takes: four per CPU this machine reports, at least 16. ONNX
#: Runtime starts a thread for each; thousands take minutes to start, and past 2**31 its
#: option overflows.
MAX_THREADS = max(16, 4 * (os.cpu_count() or 1))
THREADS = click.IntRange(min=1, max=MAX_THREADS)
_engine_threads = click.option("--threads", type=THREADS, default=None,
                               help="Engine threads (default: one per core).")  # generate, serve
_threads = click.option("--threads", type=THREADS, default=None)  # compare, tune


def _finite(ctx, param, value):
    """Click callback: a float option's value must be a number (not NaN; ±inf where the range allows it)."""
    if value is not None and value != value:
        raise click.BadParameter("must be a number, not nan")
    return value


def _address(ctx, param, value):
    """Click callback: ``--host`` must name an address (an empty one would listen on every interface)."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"must name an address (127.0.0.1, ::1; 0.0.0.0 for every interface), got {value!r}")
    return value


def _model_name(ctx, param, value):
    """Click callback: ``--model-name`` must name the model (an empty id would be replaced by the
    folder's name, not served as given)."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"must name the model clients send (leave it out for the artifact folder's name), "
                                 f"got {value!r}")
    return value


def _sampling(temperature: float, top_k: int, top_p: float, seed=None, seed_off=None):
    """The sampling options as :class:`lade_export.sampling.SamplingParams`, refusing an option
    only sampling reads when decoding is greedy (temperature 0) — it would be ignored.

    Raises:
        GenerationError: ``--top-k``, ``--top-p`` (or ``--seed``, when ``seed_off`` is not its
            value) given without ``--temperature > 0``; a value SamplingParams refuses.
    """
    from ..errors import GenerationError
    from ..sampling import SamplingParams

    sampling = SamplingParams(temperature, top_k, top_p, seed)
    for option, value, off in (("--top-k", top_k, 0), ("--top-p", top_p, 1.0), ("--seed", seed, seed_off)):
        if sampling.greedy and value != off:
            raise GenerationError(f"{option} needs --temperature > 0 (without it decoding is greedy)")
    return sampling


_token_budget = click.option("--token-budget", type=click.IntRange(min=1), default=None,
                             help="Scheduler: rows of a pass that holds decode steps (default 64).")  # triton, serve
_width_policy = click.option("--width-policy", type=click.Choice(["adaptive", "profile"]), default=None,
                             help="Scheduler: how wide each request's lookahead step is: adaptive (default; from the "
                                  "step-cost curve and each request's acceptance) or profile (always the request's "
                                  "profile).")  # triton, serve


def _kv_tokens(help: str):
    """``--kv-tokens`` of triton and serve: the same option; its help names each command's
    own request limit."""
    return click.option("--kv-tokens", type=click.IntRange(min=2), default=None, help=help)  # a prompt token and a new one


@click.group(cls=_Group, name="lade-export")  # the name click's test runner gives the program
@click.version_option(package_name="lade-export")
def main():
    """Export LLaMA decoder steps for exact lookahead decoding, build engines, generate, compare."""


def _profiles(values) -> list:
    """The ``--profile`` values resolved (none: the shipped ``default``), each name once.

    Raises:
        ProfileError: a value does not resolve, or two name the same profile.
    """
    profiles = [resolve_profile(v) for v in (values or ("default",))]
    names = [p.name for p in profiles]
    for name in names:
        if names.count(name) > 1:
            raise ProfileError(f"profile {name!r} is given twice; each --profile needs its own name")
    return profiles


def _load(artifact_dir, backend, device, dtype, threads):
    """The artifact opened for decoding (:func:`lade_export.api.load`): a
    :class:`lade_export.api.Model`, whose ``artifact``, ``tokenizer`` and ``decoder`` the
    benchmark commands use."""
    from ..api import load

    return load(artifact_dir, backend, threads=threads, device=device, dtype=dtype)
