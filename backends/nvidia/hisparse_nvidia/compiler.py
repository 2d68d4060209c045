"""Run-time compilation of the CUDA C++ kernels with NVRTC, cached on disk.

Users need no CUDA compiler: the sources under `cuda/` ship with the package and are compiled
on first use for the device's architecture (`sm_90` on H100/H200) into a cubin. Each build is
cached under `$HISPARSE_KERNEL_CACHE` (default `~/.cache/hisparse/kernels`), keyed by a hash of
the source, its headers, the options, the architecture and the NVRTC version, so a later process
loads it in milliseconds and a changed source or option never loads a stale image.

Compiling needs only `cuda-python` with NVRTC (`pip install 'hisparse[nvidia]'`), not a GPU: CI
builds every kernel for `sm_90` on CPU machines (`tests/nvidia_backend/test_nvidia_compile.py`).

If NVRTC does not know the device's architecture (a GPU newer than the installed NVRTC), the
kernel is built as PTX for the newest architecture NVRTC supports and the driver compiles it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hisparse_core.errors import BackendError, InvalidInputError

logger = logging.getLogger(__name__)

#: Environment variable naming the cache directory; "off" disables the disk cache.
ENV_CACHE = "HISPARSE_KERNEL_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "hisparse" / "kernels"
#: Headers every kernel may include by name.
HEADERS = ("common.cuh", "row_copy.cuh")


class KernelCompileError(BackendError):
    """NVRTC rejected a kernel source; the message carries the compiler log."""


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One compilation unit: a source under `cuda/` and its `-D` definitions."""

    source: str
    defines: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, source: str, defines: Mapping[str, int] | None = None) -> KernelBuild:
        return cls(source, tuple(sorted((k, int(v)) for k, v in (defines or {}).items())))

    def options(self, target: str) -> list[str]:
        opts = [f"--gpu-architecture={target}", "--std=c++17", "--device-as-default-execution-space",
                "--generate-line-info"]
        opts += [f"-D{k}={v}" for k, v in self.defines]
        return opts


@dataclass(frozen=True, slots=True)
class CompiledKernel:
    """A cubin (`kind == "cubin"`) or PTX (`kind == "ptx"`) image and where it came from."""

    image: bytes
    kind: str
    target: str
    cached: bool
    log: str = ""


def kernel_text(name: str) -> str:
    """The text of a file under `cuda/` (sources and headers)."""
    return resources.files("hisparse_nvidia").joinpath("cuda", name).read_text(encoding="utf-8")


def kernel_sources() -> list[str]:
    """Every `.cu` file shipped under `cuda/`."""
    folder = resources.files("hisparse_nvidia").joinpath("cuda")
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".cu"))


def _nvrtc() -> Any:  # the cuda.bindings module, untyped
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - the probe reports this first
        raise KernelCompileError("cuda-python is not installed: pip install 'hisparse[nvidia]'") from exc
    return nvrtc


def _check(nvrtc: Any, what: str, result: object) -> Any:
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        raise KernelCompileError(f"{what} failed: {text.decode() if text else err}")
    return values[0] if len(values) == 1 else (values or None)


def nvrtc_version() -> tuple[int, int]:
    nvrtc = _nvrtc()
    major, minor = _check(nvrtc, "nvrtcVersion", nvrtc.nvrtcVersion())
    return int(major), int(minor)


def supported_archs() -> list[int]:
    nvrtc = _nvrtc()
    return [int(a) for a in _check(nvrtc, "nvrtcGetSupportedArchs", nvrtc.nvrtcGetSupportedArchs())]


def cache_dir() -> Path | None:
    """`HISPARSE_KERNEL_CACHE`: the cache directory (created on the first write; default
    `DEFAULT_CACHE`), None for "off", "0" or "none". A path that exists and is not a directory is one
    line naming it: every kernel would fail to cache there, with a warning each."""
    value = os.environ.get(ENV_CACHE)
    if value and value.lower() in {"off", "0", "none"}:
        return None
    if not value:
        return DEFAULT_CACHE
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise InvalidInputError(f"{ENV_CACHE}={value!r} is not a directory; expected a directory for the compiled "
                                "kernels (created if missing) or off")
    return path


def compile_source(text: str, name: str, options: Sequence[str], output: str = "cubin") -> tuple[bytes, str]:
    """Compile CUDA C++ `text` (file name `name` in messages) with NVRTC; returns (image, log).

    `output` is "cubin" or "ptx". The headers under `cuda/` can be included by name. Not cached:
    `compile_kernel` is the cached entry point for the package's own kernels.
    """
    nvrtc = _nvrtc()
    headers = [kernel_text(h).encode() for h in HEADERS]
    prog = _check(nvrtc, "nvrtcCreateProgram",
                  nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), len(headers), headers,
                                           [h.encode() for h in HEADERS]))
    try:
        opts = [o.encode() for o in options]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err = result[0] if isinstance(result, tuple) else result
        size = _check(nvrtc, "nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
        log_buf = b" " * int(size)
        _check(nvrtc, "nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log_buf))
        log = log_buf.rstrip(b"\x00 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(f"NVRTC could not compile {name} with {list(options)}:\n{log}")
        if output == "cubin":
            size = _check(nvrtc, "nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
            image = b" " * int(size)
            _check(nvrtc, "nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, image))
        else:
            size = _check(nvrtc, "nvrtcGetPTXSize", nvrtc.nvrtcGetPTXSize(prog))
            image = b" " * int(size)
            _check(nvrtc, "nvrtcGetPTX", nvrtc.nvrtcGetPTX(prog, image))
        return image, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile(build: KernelBuild, target: str, output: str) -> tuple[bytes, str]:
    return compile_source(kernel_text(build.source), build.source, build.options(target), output)


def _targets(arch: int) -> tuple[str, str]:
    """(NVRTC target, output kind) for a device of compute capability `arch` (e.g. 90)."""
    archs = supported_archs()
    if arch in archs:
        return f"sm_{arch}", "cubin"
    older = [a for a in archs if a <= arch]
    if not older:
        raise KernelCompileError(f"NVRTC {nvrtc_version()} supports {archs}; none runs on sm_{arch}")
    return f"compute_{max(older)}", "ptx"


def cache_key(build: KernelBuild, target: str) -> str:
    h = hashlib.sha256()
    h.update(kernel_text(build.source).encode())
    for name in HEADERS:
        h.update(name.encode() + b"\0" + kernel_text(name).encode())
    h.update("\0".join(build.options(target)).encode())
    h.update(repr(nvrtc_version()).encode())
    return h.hexdigest()[:32]


def compile_kernel(build: KernelBuild, arch: int, *, use_cache: bool = True) -> CompiledKernel:
    """Compile (or load from the disk cache) `build` for compute capability `arch` (e.g. 90)."""
    target, output = _targets(arch)
    folder = cache_dir() if use_cache else None
    path = None
    if folder is not None:
        stem = Path(build.source).stem
        path = folder / f"{stem}-{target}-{cache_key(build, target)}.{output}"
        try:
            return CompiledKernel(path.read_bytes(), output, target, cached=True)
        except OSError:
            pass
    image, log = _compile(build, target, output)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, path)
        except OSError as exc:  # a read-only home must not break the backend
            logger.warning("hisparse: could not cache kernel %s at %s: %s", build.source, path, exc)
    return CompiledKernel(image, output, target, cached=False, log=log)


def compile_all(builds: Sequence[KernelBuild], arch: int, *, use_cache: bool = True) -> list[CompiledKernel]:
    return [compile_kernel(b, arch, use_cache=use_cache) for b in builds]
