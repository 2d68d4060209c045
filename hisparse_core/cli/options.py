"""What every sub-command's options share: a parser whose errors are one line, and bounded
numeric and size types, so bad input fails at parse time (before anything is allocated) naming
the flag and the accepted range.

Light on purpose: `build_parser` imports this for every command, `--help` and `backends` included.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import re
import sys
from collections.abc import Callable
from typing import NoReturn

#: The size units `--gpu-kv`, `--host` and friends accept (`planner.parse_bytes`), for help texts.
SIZE_UNITS = "B, K/KiB, M/MiB, G/GiB, T/TiB (binary), KB, MB, GB, TB (decimal); e.g. 40GiB, 1.5G, 512MiB"

_UNITS_SHORT = "B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB"

#: Generous bounds that keep every derived size far from overflow; the commands check the
#: combinations (budgets against the machine) themselves.
MAX_REQUESTS = 1 << 16
MAX_TOKENS = 1 << 24
MAX_STEPS = 1 << 24
MAX_TOP_K = 1 << 16
MAX_LAYERS = 1024
MAX_BLOCK_SIZE = 4096
MAX_HOT = 64.0
MAX_LOCALITY = 1000.0
MAX_SEED = (1 << 32) - 1
MAX_BYTES = 1 << 50  # 1 PiB


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`hisparse run: error: ...`) and exit 2.

    A value that looks negative (`--gpu-kv -1GiB`, `--hot -inf`, `--seed -1e3`) is taken as the
    option's value, so that its type reports the accepted range; stock argparse takes only plain
    negative numbers so and calls the rest an option, "expected one argument". No option of
    hisparse starts with a dash and a digit, `inf` or `nan`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._negative_number_matcher = re.compile(r"^-(\d|\.\d|inf|nan)", re.IGNORECASE)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their paragraphs; option help is wrapped to the terminal, and the help of
    every bounded option shows its accepted range (the type's `accepted`), unless it already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        accepted = getattr(action.type, "accepted", None)
        if text is None or accepted is None or accepted in text:
            return text
        if text.endswith(")") and "(default: " in text:
            return f"{text[:-1]}; accepted: {accepted})"
        return f"{text} (accepted: {accepted})"


def _range(lo: float, hi: float) -> str:
    return f"[{lo:g}, {hi:g}]" if isinstance(lo, float) or isinstance(hi, float) else f"[{lo}, {hi}]"


def int_in(lo: int, hi: int, what: str = "an integer") -> Callable[[str], int]:
    """argparse type: an int in [lo, hi] (inclusive), else a message naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip().replace("_", ""), 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} in {_range(lo, hi)}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected {what} in {_range(lo, hi)}, got {text}")
        return value

    parse.__name__ = "integer"
    parse.accepted = _range(lo, hi)  # type: ignore[attr-defined]  # tests and help read it
    return parse


def int_list_in(lo: int, hi: int) -> Callable[[str], list[int]]:
    """argparse type: comma-separated integers, each in [lo, hi]."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or not all(lo <= v <= hi for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers in [{lo}, {hi}], got {text!r}")
        return values

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False,
             what: str = "a number") -> Callable[[str], float]:
    """argparse type: a finite float in [lo, hi] (`lo_open`: lo excluded, `hi_open`: hi excluded)."""
    shown = ("(" if lo_open else "[") + f"{lo:g}, {hi:g}" + (")" if hi_open else "]")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} in {shown}, got {text!r}") from None
        if not math.isfinite(value) or not (lo < value if lo_open else lo <= value) \
                or not (value < hi if hi_open else value <= hi):
            raise argparse.ArgumentTypeError(f"expected {what} in {shown}, got {text}")
        return value

    parse.__name__ = "number"
    parse.accepted = shown  # type: ignore[attr-defined]
    return parse


def size_in(lo: int, hi: int = MAX_BYTES) -> Callable[[str], int]:
    """argparse type: a size with an optional unit (SIZE_UNITS), in [lo, hi] bytes."""
    from hisparse_core.errors import InvalidInputError
    from hisparse_core.planner import parse_bytes
    from hisparse_core.replay.report import human_bytes

    # In units parse_bytes reads back (it has no PiB): 1 PiB is shown as 1024 TiB.
    top = f"{hi / (1 << 40):g} TiB" if hi >= 1 << 40 else human_bytes(hi)
    shown = f"[{human_bytes(lo)}, {top}]"

    def parse(text: str) -> int:
        try:
            value = parse_bytes(text)
        except (InvalidInputError, OverflowError, ValueError):  # junk, a bad unit, negative, inf, 1e400, nan
            raise argparse.ArgumentTypeError(f"expected a size in {shown} (a number and an optional unit: "
                                             f"{_UNITS_SHORT}), got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected a size in {shown}, got {text!r}")
        return value

    parse.__name__ = "size"
    parse.accepted = shown  # type: ignore[attr-defined]
    return parse


def quiet_stdout() -> None:
    """Point stdout's descriptor at /dev/null once its reader has left, so that the interpreter's own
    last flush of what is still buffered is quiet too (`hisparse` and `run_script` both end so)."""
    import os

    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run_script(main: Callable[[], int | None]) -> int:
    """`main()`'s exit status for a script, ended as `hisparse` ends: 141 without a traceback where the
    reader of stdout left (`... | head -1`; stdout then points at /dev/null so the interpreter's own
    last flush is quiet too), and 130 with one line, `SCRIPT: interrupted`, on Ctrl-C."""
    import os

    try:
        status = main()
        sys.stdout.flush()
        return int(status or 0)
    except BrokenPipeError:
        quiet_stdout()
        return 141
    except KeyboardInterrupt:
        print(f"{os.path.splitext(os.path.basename(sys.argv[0]))[0]}: interrupted", file=sys.stderr)
        return 130


def fail(prog: str, message: str) -> int:
    """One error line on stderr; the exit status of bad input."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def fail_argument(prog: str, flag: str, message: str) -> int:
    """One error line for a flag whose value the parser could not judge alone (its range depends on
    another flag or a preset), in the parser's own format: `PROG: error: argument FLAG: MESSAGE
    (see PROG --help)`; the exit status of bad input."""
    print(f"{prog}: error: argument {flag}: {message} (see {prog} --help)", file=sys.stderr)
    return 2


class HeldSelectionLog(logging.Filter):
    """Holds the backend registry's INFO lines ("hisparse backend 'X' selected ...") from the
    moment it is attached until `release()`: a command selects its backend (whose device its
    budget checks need) and checks its values before it says anything, so a refused value is the
    one line on stderr. Warnings (a tie, a broken backend skipped) pass at once; `release()`
    logs the held lines; `drop()` forgets them (the command failed before any work)."""

    LOGGER = "hisparse_core.registry"

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []
        self._logger = logging.getLogger(self.LOGGER)
        self._logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        self.held.append(record)
        return False

    def release(self) -> None:
        """Stop holding and log what was held, in order (idempotent)."""
        self._logger.removeFilter(self)
        held, self.held = self.held, []
        for record in held:
            self._logger.handle(record)

    def drop(self) -> None:
        """Stop holding and forget what was held."""
        self._logger.removeFilter(self)
        self.held = []


def check_torch_device(flag: str, text: str, command: str) -> str | None:
    """Why `flag text` is not a device `command` can run on here, in one line, or None. Accepted:
    `cpu`, and `cuda` / `cuda:N` where this torch has CUDA and device N exists
    (`torch.cuda.device_count()`); nothing else (an unknown name, `meta`, `mps`, ...). Imports
    torch: call it after `import_torch`."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cudas = "cuda:0" if count == 1 else f"cuda:0..cuda:{count - 1}"
    expected = f"cpu, cuda or {cudas}" if count else "cpu"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return f"{flag} {text!r} is not a torch device; expected {expected}"
    if device.type == "cpu":
        if device.index not in (None, 0):
            return f"{flag} {text!r}: the CPU has no device index {device.index}; expected {expected}"
        return None
    if device.type == "cuda":
        if not count:
            why = ("this torch has no CUDA" if not torch.backends.cuda.is_built() else
                   "this torch has CUDA but sees no CUDA device")
            return f"{flag} {text!r}: {why}; expected cpu"
        if device.index is not None and device.index >= count:
            return (f"{flag} {text!r}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                    f"({cudas}); expected {expected}")
        return None
    return f"{flag} {text!r}: {command} runs on the CPU or a CUDA GPU only; expected {expected}"


def check_output_path(flag: str, path: str, *, expected: str = "a file name") -> str | None:
    """Why the file `flag path` names cannot be written (its folder missing or read-only, its name
    too long, or a folder given as the file), or None. Leaves nothing behind."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        return f"{flag} {path!r}: the folder {folder!r} {what}"
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder; expected {expected}"
    if path.endswith(("/", os.sep)):  # abspath drops the slash: 'x.png/' passed, and the write failed after the work
        return f"{flag} {path!r} ends with a '/', which names a folder; expected {expected}"
    name = os.fsencode(os.path.basename(path))
    try:
        longest = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    if len(name) > longest:
        return f"{flag} {path!r}: the file name is {len(name)} bytes long; expected at most {longest}"
    why = unwritable(folder)
    return None if why is None else f"{flag} {path!r}: the folder {folder!r} is {why}"


def unwritable(folder: str) -> str | None:
    """Why no file can be created in the existing folder `folder` ("not writable", with the OS's
    reason where it is not procfs's misleading ENOENT), or None. Leaves nothing behind."""
    import errno
    import tempfile

    # os.access answers yes to root everywhere (/proc, a read-only mount under some kernels): only
    # creating a file there tells
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:  # procfs answers ENOENT, which would read as the folder missing
        return "not writable" + ("" if exc.errno == errno.ENOENT else f" ({exc.strerror or exc})")
    return None


def check_plot_path(path: str, flag: str = "--plot") -> str | None:
    """Why `flag path` (a plot) cannot be written, or None; checked before any work so none is wasted."""
    if not path:  # `--plot ""` (an unset variable, say): no file to write, said before any work
        return f"{flag} '': expected a file name such as plot.png"
    try:
        import matplotlib  # noqa: F401  (only when a plot is asked for)
    except ImportError as exc:
        return f"{flag} needs matplotlib, which cannot be imported ({exc}): pip install 'hisparse[plot]'"
    if why := check_output_path(flag, path, expected="a file name such as plot.png"):
        return why
    import shutil

    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    accepted = sorted(FigureCanvasBase.get_supported_filetypes())
    # matplotlib writes .pgf through a TeX system; without one its savefig raises after the work.
    tex = str(matplotlib.rcParams["pgf.texsystem"])
    if not shutil.which(tex):
        accepted.remove("pgf")
    names = f"{', '.join('.' + a for a in accepted)} (no extension: PNG)"
    if plot_format(path) == "pgf" and "pgf" not in accepted:
        return f"{flag} {path!r}: matplotlib writes .pgf files through {tex}, which is not on PATH; expected a " \
               f"name ending in {names}"
    if plot_format(path) not in accepted:
        return f"{flag} {path!r}: matplotlib cannot write .{plot_format(path)} files; expected a name ending in {names}"
    return None


def plot_format(path: str) -> str:
    """The image format `--plot path` is written in: its extension, PNG where it has none (the
    file is written under exactly the name given, no extension added)."""
    import os

    return os.path.splitext(path)[1][1:].lower() or "png"


#: How to put a working torch back, for the one line a broken one gets.
TORCH_FIX = ("reinstall it (pip install --force-reinstall torch==2.13.0; on a machine without a GPU "
             "add --index-url https://download.pytorch.org/whl/cpu); `hisparse backends -v` lists what this "
             "install can run")


def import_torch(prog: str) -> str | None:
    """Import torch; why it cannot be, in one line, or None. A broken install raises more than
    ImportError (an OSError for a missing shared library, a RuntimeError from a CUDA mismatch):
    each is named here rather than given as a traceback."""
    # numpy first, from Python: torch's C extension imports it and clears whatever that raises, a
    # Ctrl-C included (the command then ran on, or failed on a numpy half imported).
    for name, fix in (("numpy", "reinstall it (pip install --force-reinstall 'numpy>=1.26')"), ("torch", TORCH_FIX)):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - whatever a broken install raises, said in one line
            detail = " ".join(str(exc).split()) or "no message"
            return f"{name} cannot be imported ({type(exc).__name__}: {detail}): {fix}"
    return None


def check_backend_name(name: str | None) -> str | None:
    """Why `--backend NAME` (or $HISPARSE_BACKEND) cannot be used here, or None. Asks the
    registry's entry-point metadata and the plugins' light probes only: no torch."""
    from hisparse_core.errors import HiSparseError
    from hisparse_core.log_hold import held_unless_it_fails
    from hisparse_core.registry import ENV_BACKEND, get_registry

    # Discovery's WARNINGs (a plugin that does not import) are held until the choice is made: where
    # it fails, the one error line names the backend and why it is broken; where it succeeds they pass.
    try:
        with held_unless_it_fails("hisparse_core.discovery"):
            get_registry().choose(name)
    except HiSparseError as exc:
        import os

        source = f"--backend {name!r}" if name is not None else (
            f"${ENV_BACKEND}={os.environ.get(ENV_BACKEND, '')!r}" if os.environ.get(ENV_BACKEND, "").strip()
            else "backend selection")
        return f"{source}: {exc}"
    return None


def check_host_budget(flag: str, nbytes: int) -> str | None:
    """Why a host budget of `nbytes` (given by `flag`) cannot fit this machine's RAM, naming the
    largest that does, or None. The rule of `capacity.check_host_memory`, torch-free."""
    from hisparse_core.capacity import check_host_memory, host_limit
    from hisparse_core.errors import CapacityError
    from hisparse_core.replay.report import human_bytes
    from hisparse_core.units import at_most, floor_size

    try:
        check_host_memory(nbytes, f"{flag} {human_bytes(nbytes)}", remedy=f"lower {flag}{at_most(host_limit(), floor_size)}")
    except CapacityError as exc:
        return str(exc)
    return None
