r"""A native C kernel for the ALTI distances, built once with the system's C compiler.

The ALTI distances d_ij = |s_i y_i - sum_h alpha^h_ij u^h_j|_1 cost O(T^2 H D) per layer: for
every pair (i, j) and every channel, H multiply-adds, a subtraction and an absolute value
(:mod:`~captum_normattr.decompose.methods.alti`). The ``torch.compile`` kernel does this with separate
multiplies and adds and needs the probabilities copied into a (source, row, head) block first.
This kernel (docs/performance.md, "The native ALTI kernel"):

* uses fused multiply-adds (``-ffp-contract=fast``) with H a compile-time constant, so the H
  weights of a pair stay in registers over the D channels;
* forms two query rows per pass, each load of a source's values serving both;
* walks blocks of :data:`ROW_BLOCK` query rows (their targets stay in the L2 cache) > tiles of
  16 source tokens, whose probabilities it gathers into a small (source, row, head) scratch
  straight from the (H, T, T) tensor's strides (no copy of the tensor) > source tokens (a
  source's H x D values stay in L1 for every row of the block) > width.

It is plain C (GCC vector extensions, no torch headers): ``cc -O3 -march=native`` builds it in
well under a second, once per (dtype, H) and CPU, into a cache folder
(``CAPTUM_NORMATTR_KERNEL_DIR``, default ``~/.cache/captum_normattr/kernels``), and ctypes
loads it. Loading a shared library runs its code, so the cache is trusted only as far as it is
private (docs/reliability.md, "The kernel cache"):

* the folder is created with mode 0700; a folder (or file) owned by another user or writable by
  group or others is never used: a warning names it and the kernel is built in a private
  temporary folder of this process instead;
* a library is compiled under a temporary name and renamed into place; its SHA-256 is written
  beside it (``<library>.sha256``, also renamed into place) and checked before every load: a
  missing, short or different file is rebuilt once with a warning, never loaded;
* once loaded, the kernel is checked against a plain torch computation on a small problem that
  runs every code path (two-row and one-row passes, causal and not, a width with a remainder);
  a kernel that disagrees is not used (warning, fallback to the other kernels). Calls release the GIL, so blocks of rows run on ``torch.get_num_threads()`` Python
threads. Where no compiler is found or the build fails, :func:`alti_l1_kernel` returns None
(the caller falls back to the ``torch.compile`` or eager kernel) and
:func:`native_unavailable_reason` says why; ``CAPTUM_NORMATTR_NATIVE=0`` turns it off.

The numbers are those of the other kernels up to float rounding (a fused multiply-add rounds
once instead of twice): tests check it against the eager kernel in float64.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "KERNEL_DIR_ENV", "NATIVE_ENV", "ROW_BLOCK", "alti_l1_kernel", "cached_library_problem", "clear_loaded_kernels",
    "file_sha256", "kernel_dir", "kernel_file_name", "kernel_flags", "kernel_self_check", "native_distances",
    "native_unavailable_reason", "trusted_kernel_dir", "untrusted_reason",
]

#: Environment variable: the folder of the built kernels (default ``~/.cache/captum_normattr/kernels``).
KERNEL_DIR_ENV = "CAPTUM_NORMATTR_KERNEL_DIR"
#: Environment variable: ``0`` never builds nor uses the native kernel.
NATIVE_ENV = "CAPTUM_NORMATTR_NATIVE"
#: Query rows per block: their targets (rows x D) stay in the L2 cache while every source passes.
ROW_BLOCK = 128

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <math.h>

#ifndef NH
#error "NH (heads) must be defined"
#endif

typedef REAL vec __attribute__((vector_size(64), aligned(sizeof(REAL)), may_alias));
typedef UINT uvec __attribute__((vector_size(64), aligned(sizeof(REAL)), may_alias));
#define VW ((int64_t)(64 / sizeof(REAL)))
#define JT 16

/* One load of a source's values for both rows: without it the compiler folds the load into each row's
   multiply-add, and two loads per multiply-add make the loop load-bound (measured: 12% slower). */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__AVX512F__)  /* a 64-byte vector fits one register */
#define KEEP_IN_REGISTER(x) __asm__("" : "+v"(x))
#else
#define KEEP_IN_REGISTER(x) ((void)0)
#endif

static inline vec vabs(vec x) { return (vec)(((uvec)x) & (uvec)((uvec){0} + ABSMASK)); }
static inline REAL hsum(vec x) { REAL s = 0; for (int k = 0; k < VW; ++k) s += x[k]; return s; }

/* sum_c |y[c] - sum_h a[h] u[h * D + c]| */
static inline REAL dist1(const REAL* a, const REAL* u, const REAL* y, int64_t D, int64_t DV)
{
    vec acc = {0};
    int64_t c = 0;
    for (; c < DV; c += VW) {
        vec t = -*(const vec*)(y + c);
        for (int h = 0; h < NH; ++h) t += a[h] * *(const vec*)(u + h * D + c);
        acc += vabs(t);
    }
    REAL s = hsum(acc);
    for (; c < D; ++c) {
        REAL t = -y[c];
        for (int h = 0; h < NH; ++h) t += a[h] * u[h * D + c];
        s += FABS(t);
    }
    return s;
}

/* the same for two rows sharing the source's values */
static inline void dist2(const REAL* a0, const REAL* a1, const REAL* u, const REAL* y0, const REAL* y1, int64_t D,
                         int64_t DV, REAL* s0out, REAL* s1out)
{
    REAL b0[NH], b1[NH];
    for (int h = 0; h < NH; ++h) { b0[h] = a0[h]; b1[h] = a1[h]; }
    vec acc0 = {0}, acc1 = {0};
    int64_t c = 0;
    for (; c < DV; c += VW) {
        vec t0 = -*(const vec*)(y0 + c);
        vec t1 = -*(const vec*)(y1 + c);
        for (int h = 0; h < NH; ++h) {
            vec uh = *(const vec*)(u + h * D + c);
            KEEP_IN_REGISTER(uh);
            t0 += b0[h] * uh;
            t1 += b1[h] * uh;
        }
        acc0 += vabs(t0);
        acc1 += vabs(t1);
    }
    REAL s0 = hsum(acc0), s1 = hsum(acc1);
    for (; c < D; ++c) {
        REAL t0 = -y0[c], t1 = -y1[c];
        for (int h = 0; h < NH; ++h) { t0 += b0[h] * u[h * D + c]; t1 += b1[h] * u[h * D + c]; }
        s0 += FABS(t0); s1 += FABS(t1);
    }
    *s0out = s0; *s1out = s1;
}

/* out[i * so + j] = sum_c |y_i[c] - sum_h p[h, i, j] u[j, h, c]| for rows i in [r0, r1) and sources
   j < (causal ? i + 1 : K); u is (K, NH, D) contiguous, y is (rows, D) contiguous, p has strides
   (sh, si, sj) in elements. Returns 0, or 1 when the scratch could not be allocated. */
int alti_l1(const REAL* p, int64_t sh, int64_t si, int64_t sj,
            const REAL* u, const REAL* y, REAL* out, int64_t so,
            int64_t r0, int64_t r1, int64_t K, int64_t D, int causal)
{
    const int64_t DV = (D / VW) * VW;
    const int64_t R = r1 - r0;
    int64_t jmax = causal ? (r1 < K ? r1 : K) : K;
    /* the probabilities of a tile of JT sources for every row of the block, as (source, row, head) */
    REAL* a = (REAL*)malloc(sizeof(REAL) * JT * R * NH);
    if (!a) return 1;
    for (int64_t j0 = 0; j0 < jmax; j0 += JT) {
        int64_t j1 = j0 + JT < jmax ? j0 + JT : jmax;
        int64_t i0 = (causal && j0 > r0) ? j0 : r0;
        for (int h = 0; h < NH; ++h)
            for (int64_t i = i0; i < r1; ++i) {
                const REAL* row = p + h * sh + i * si;
                for (int64_t j = j0; j < j1; ++j) a[((j - j0) * R + (i - r0)) * NH + h] = row[j * sj];
            }
        for (int64_t j = j0; j < j1; ++j) {
            const REAL* uj = u + j * NH * D;
            const REAL* aj = a + (j - j0) * R * NH;
            int64_t i = (causal && j > r0) ? j : r0;
            for (; i + 1 < r1; i += 2)
                dist2(aj + (i - r0) * NH, aj + (i + 1 - r0) * NH, uj, y + i * D, y + (i + 1) * D, D, DV,
                      out + i * so + j, out + (i + 1) * so + j);
            for (; i < r1; ++i) out[i * so + j] = dist1(aj + (i - r0) * NH, uj, y + i * D, D, DV);
        }
    }
    free(a);
    return 0;
}
"""

_TYPES = {
    torch.float32: ("float", "uint32_t", "0x7fffffffu", "fabsf"),
    torch.float64: ("double", "uint64_t", "0x7fffffffffffffffull", "fabs"),
}
_LIBS: Dict[Tuple[torch.dtype, int], Optional[Callable]] = {}
_REASON: Dict[str, str] = {}
_LOCK = threading.Lock()
_POOL: Dict[Tuple[int, int], ThreadPoolExecutor] = {}


def native_unavailable_reason() -> Optional[str]:
    r"""Why the native kernel could not be built in this process (None: it could, or was not tried)."""
    return _REASON.get("reason")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    r"""What ``-march=native`` depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def kernel_dir() -> str:
    r"""The configured cache folder of built kernels (``CAPTUM_NORMATTR_KERNEL_DIR`` or the default)."""
    return os.environ.get(KERNEL_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "captum_normattr", "kernels")


def untrusted_reason(path: str) -> Optional[str]:
    r"""Why ``path`` (a folder or file of the kernel cache) cannot be trusted, or None.

    Trusted: owned by this process's user (or root, for a folder) and not writable by group or
    others. Where the platform has no user ids (Windows), only the mode is checked.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot stat it ({e})"
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is not None and st.st_uid not in (uid,):
        return f"it is owned by user id {st.st_uid}, not by this user ({uid})"
    if st.st_mode & 0o022:
        return f"it is writable by {'group and others' if st.st_mode & 0o022 == 0o022 else 'group' if st.st_mode & 0o020 else 'others'} (mode {st.st_mode & 0o777:o})"
    return None


_PRIVATE: Dict[str, str] = {}


def _private_dir() -> str:
    r"""This process's own temporary kernel folder (mode 0700), used when the configured cache is not trusted."""
    with _DIR_LOCK:
        if "dir" not in _PRIVATE:
            _PRIVATE["dir"] = tempfile.mkdtemp(prefix="captum_normattr_kernels_")
        return _PRIVATE["dir"]


_DIR_LOCK = threading.Lock()


def trusted_kernel_dir() -> str:
    r"""The cache folder to build into and load from: the configured one, created with mode 0700,
    when this user owns it and nobody else can write it; else a private temporary folder (with a
    :class:`RuntimeWarning` naming the refused folder)."""
    folder = kernel_dir()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
        warnings.warn(f"the native-kernel cache folder {folder!r} cannot be created ({e}); building in a private "
                      "temporary folder", RuntimeWarning, stacklevel=3)
        return _private_dir()
    why = untrusted_reason(folder)
    if why is not None:
        warnings.warn(
            f"the native-kernel cache folder {folder!r} is not used: {why}. A library planted there would run in this "
            f"process. The kernel is built in a private temporary folder instead; give {KERNEL_DIR_ENV} a folder only "
            "you can write (mode 0700)", RuntimeWarning, stacklevel=3)
        return _private_dir()
    return folder


def kernel_flags(dtype: torch.dtype, heads: int) -> Tuple[str, ...]:
    r"""The compiler flags of the kernel for ``dtype`` and ``heads``."""
    real, uint, mask, fabs = _TYPES[dtype]
    return ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi", "-shared", "-fPIC",
            f"-DREAL={real}", f"-DUINT={uint}", f"-DABSMASK={mask}", f"-DFABS={fabs}", f"-DNH={heads}")


def kernel_file_name(dtype: torch.dtype, heads: int, cc: str) -> str:
    r"""The cached library's file name: a hash of the source, compiler, machine, CPU and flags."""
    real = _TYPES[dtype][0]
    key = hashlib.sha256("\0".join([_SOURCE, cc, platform.machine(), _cpu_signature(),
                                     *kernel_flags(dtype, heads)]).encode()).hexdigest()[:20]
    return f"alti_l1_{real}_h{heads}_{key}.so"


def file_sha256(path: str) -> str:
    r"""SHA-256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_private(path: str, data: bytes) -> None:
    r"""Write ``data`` to ``path`` through a temporary file of the same folder (mode 0600) and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _compile(cc: str, dtype: torch.dtype, heads: int, path: str) -> None:
    r"""Compile the kernel into ``path`` (temporary name, atomic rename) and record its SHA-256 beside it."""
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src = os.path.join(tmp, "alti_l1.c")
        with open(src, "w") as f:
            f.write(_SOURCE)
        built = os.path.join(tmp, "alti_l1.so")
        subprocess.run([cc, *kernel_flags(dtype, heads), src, "-o", built], check=True, capture_output=True, timeout=120)
        os.chmod(built, 0o700)
        digest = file_sha256(built)
        os.replace(built, path)  # atomic: a concurrent build of the same kernel is harmless
    _write_private(path + ".sha256", (digest + "\n").encode())


def cached_library_problem(path: str) -> Optional[str]:
    r"""Why the cached library at ``path`` must not be loaded (None: it is the one this user built).

    Refused: a missing or untrusted library or checksum file, or a library whose SHA-256 differs
    from the checksum recorded when it was built (a planted, truncated or corrupted file).
    """
    for p in (path, path + ".sha256"):
        if not os.path.exists(p):
            return f"{os.path.basename(p)} is missing"
        why = untrusted_reason(p)
        if why is not None:
            return f"{os.path.basename(p)} cannot be trusted: {why}"
    try:
        with open(path + ".sha256") as f:
            recorded = f.read().strip()
        actual = file_sha256(path)
    except OSError as e:
        return f"it cannot be read ({e})"
    if recorded != actual:
        return f"its SHA-256 {actual[:16]}... differs from the one recorded at build time ({recorded[:16]}...)"
    return None


def _reference_distances(probs: Tensor, proj_j: Tensor, target: Tensor, causal: bool) -> Tensor:
    r"""The distances of :func:`native_distances` in plain torch, float64 (the kernel's self-check)."""
    p, u, y = probs.double(), proj_j.double(), target.double()
    mixed = torch.einsum("hij,jhd->ijd", p, u)  # (Q, K, D): sum_h p[h, i, j] u[j, h]
    d = (y[:, None, :] - mixed).abs().sum(-1)
    if causal:
        d = d.tril()
    return d


def kernel_self_check(fn: Callable, dtype: torch.dtype, heads: int) -> Optional[str]:
    r"""Compare a loaded kernel with plain torch on a small problem that runs every code path.

    Returns None when they agree to the dtype's rounding, else what differs. Covers the two-row
    and one-row passes (an odd row count), causal and full rows, several source tiles, and a
    width with a remainder after the vector part.
    """
    g = torch.Generator().manual_seed(1234)
    vw = 64 // torch.empty((), dtype=dtype).element_size()
    q, d = 37, vw + 3
    probs = torch.rand(heads, q, q, generator=g, dtype=torch.float64).to(dtype)
    proj = torch.randn(q, heads, d, generator=g, dtype=torch.float64).to(dtype)
    target = torch.randn(q, d, generator=g, dtype=torch.float64).to(dtype)
    eps = torch.finfo(dtype).eps
    for causal in (False, True):
        out = torch.zeros(q, q, dtype=dtype)
        native_distances(fn, probs, proj, target, out, causal)
        ref = _reference_distances(probs, proj, target, causal)
        got = out.double().tril() if causal else out.double()
        err = float((got - ref).abs().max())
        scale = float(ref.abs().max()) + 1.0
        if not err <= 64 * heads * d * eps * scale:
            return f"{'causal' if causal else 'full'} rows differ from plain torch by {err:.3g} (scale {scale:.3g})"
    return None


def _load(path: str) -> Callable:
    lib = ctypes.CDLL(path)
    fn = lib.alti_l1
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, i64,
                   i64, i64, i64, i64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _build(dtype: torch.dtype, heads: int) -> Optional[Callable]:
    r"""Build (or load from the trusted cache) the kernel for ``dtype`` and ``heads``; None with a reason where it fails."""
    cc = _compiler()
    if cc is None:
        _REASON["reason"] = "no C compiler (cc, gcc or clang) on PATH"
        return None
    folder = trusted_kernel_dir()
    path = os.path.join(folder, kernel_file_name(dtype, heads, cc))
    build = not (os.path.lexists(path) or os.path.lexists(path + ".sha256"))
    if not build:
        problem = cached_library_problem(path)
        if problem is not None:  # planted, truncated or corrupted: never loaded, rebuilt once
            warnings.warn(f"the cached native ALTI kernel {path!r} is not loaded: {problem}; rebuilding it",
                          RuntimeWarning, stacklevel=3)
            for p in (path, path + ".sha256"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            build = True
    if build:
        try:
            _compile(cc, dtype, heads, path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            _REASON["reason"] = f"building the native ALTI kernel failed ({type(e).__name__}: {e} {detail[:300]!r})"
            return None
        problem = cached_library_problem(path)
        if problem is not None:  # changed between our build and our load: someone else writes there
            _REASON["reason"] = f"the native ALTI kernel at {path!r} changed after it was built ({problem})"
            return None
    try:
        fn = _load(path)
    except OSError as e:
        _REASON["reason"] = f"loading the native ALTI kernel failed ({e})"
        return None
    wrong = kernel_self_check(fn, dtype, heads)
    if wrong is not None:
        _REASON["reason"] = f"the native ALTI kernel {path!r} failed its self-check: {wrong}"
        warnings.warn(_REASON["reason"] + "; the other kernels are used", RuntimeWarning, stacklevel=3)
        return None
    return fn


def clear_loaded_kernels() -> None:
    r"""Forget the kernels loaded by this process (the next call checks the cache again; tests use it)."""
    with _LOCK:
        _LIBS.clear()
        _REASON.clear()


def alti_l1_kernel(dtype: torch.dtype, heads: int) -> Optional[Callable]:
    r"""The native distance function for ``dtype`` (float32/float64) and ``heads``, or None.

    None where the environment variable ``CAPTUM_NORMATTR_NATIVE=0`` is set, the dtype is not
    float32/float64, or the kernel cannot be built (:func:`native_unavailable_reason`).
    """
    if os.environ.get(NATIVE_ENV, "").strip() == "0" or dtype not in _TYPES or heads < 1 or heads > 256:
        return None
    key = (dtype, int(heads))
    with _LOCK:
        if key not in _LIBS:
            _LIBS[key] = _build(dtype, int(heads))
    return _LIBS[key]


def _pool(n: int) -> ThreadPoolExecutor:
    r"""A pool of ``n`` threads of this process (a forked child gets its own: a parent's threads do not survive a fork)."""
    key = (os.getpid(), n)
    with _LOCK:
        if key not in _POOL:
            _POOL[key] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="captum_normattr_alti")
    return _POOL[key]


def native_distances(fn: Callable, probs: Tensor, proj_j: Tensor, target: Tensor, out: Tensor, causal: bool) -> None:
    r"""Write the ALTI distances of one example into ``out`` with the native kernel ``fn``.

    Args:
        fn: from :func:`alti_l1_kernel` (same dtype and head count).
        probs: (H, Q, K) probabilities of one example, any strides (CPU).
        proj_j: (K, H, D) the sources' projected values, contiguous.
        target: (Q, D) s_i y_i, contiguous.
        out: (Q, K) contiguous; entries j > i are left untouched when ``causal``.
        causal: row i has parts from sources j <= i only.
    """
    h, q, k = probs.shape
    d = proj_j.shape[-1]
    if not (proj_j.is_contiguous() and target.is_contiguous() and out.is_contiguous()):
        raise ValueError("native_distances needs contiguous proj_j, target and out")
    if probs.dtype != proj_j.dtype or target.dtype != proj_j.dtype or out.dtype != proj_j.dtype:
        raise ValueError("native_distances needs one dtype for probs, proj_j, target and out")
    sh, si, sj = probs.stride()
    args = (probs.data_ptr(), sh, si, sj, proj_j.data_ptr(), target.data_ptr(), out.data_ptr(), out.stride(0))
    blocks = [(r0, min(q, r0 + ROW_BLOCK)) for r0 in range(0, q, ROW_BLOCK)]
    threads = max(1, min(torch.get_num_threads(), len(blocks)))

    def run(block: Tuple[int, int]) -> None:
        if fn(*args, block[0], block[1], k, d, int(causal)) != 0:
            raise MemoryError("the native ALTI kernel could not allocate its scratch")

    if threads == 1:
        for block in blocks:
            run(block)
    else:  # ctypes releases the GIL: the blocks run in parallel; the last (largest causal) blocks first
        list(_pool(threads).map(run, blocks[::-1]))
