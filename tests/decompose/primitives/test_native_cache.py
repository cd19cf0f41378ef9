r"""The native kernel's cache cannot be planted or torn (docs/reliability.md, "The kernel cache").

Each scenario builds into its own temporary cache folder. Libraries that must be built
beforehand are built in a subprocess: a library this test process has mapped is never
truncated under it (that would be the SIGBUS these tests guard against).
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from captum_normattr.decompose.primitives import native

pytestmark = pytest.mark.skipif(native._compiler() is None, reason="no C compiler on PATH")

HEADS = 3
DTYPE = torch.float64

PLANTED = r"""
#include <stdio.h>
#include <stdint.h>
__attribute__((constructor)) static void planted(void) {
    FILE* f = fopen(MARKER, "w");
    if (f) { fputs("ran", f); fclose(f); }
}
/* the kernel's signature, computing nothing: a loaded copy gives silent zeros */
int alti_l1(const double* p, int64_t sh, int64_t si, int64_t sj, const double* u, const double* y, double* out,
            int64_t so, int64_t r0, int64_t r1, int64_t K, int64_t D, int causal) { return 0; }
"""


@pytest.fixture
def cache(monkeypatch, tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o700)
    os.chmod(folder, 0o700)
    monkeypatch.setenv(native.KERNEL_DIR_ENV, str(folder))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    native.clear_loaded_kernels()
    yield folder
    native.clear_loaded_kernels()


def _expected_path(folder: Path) -> Path:
    return folder / native.kernel_file_name(DTYPE, HEADS, native._compiler())


def _plant(tmp_path: Path, target: Path) -> Path:
    marker = tmp_path / "marker"
    src = tmp_path / "planted.c"
    src.write_text(PLANTED)
    cc = native._compiler()
    subprocess.run([cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(target)], check=True)
    os.chmod(target, 0o700)
    return marker


def _build_in_subprocess(folder: Path) -> None:
    code = "import torch; from captum_normattr.decompose.primitives import native; " \
           f"assert native.alti_l1_kernel(torch.float64, {HEADS}) is not None, native.native_unavailable_reason()"
    env = dict(os.environ, **{native.KERNEL_DIR_ENV: str(folder)})
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_a_planted_library_is_never_loaded(cache, tmp_path):
    path = _expected_path(cache)
    marker = _plant(tmp_path, path)  # the predicted name, no checksum: what an attacker can predict
    with pytest.warns(RuntimeWarning, match="not loaded"):
        fn = native.alti_l1_kernel(DTYPE, HEADS)
    assert fn is not None, native.native_unavailable_reason()
    assert not marker.exists(), "the planted library's constructor ran"
    assert native.kernel_self_check(fn, DTYPE, HEADS) is None
    assert native.cached_library_problem(str(path)) is None  # replaced by this user's own build


def test_a_planted_library_with_a_wrong_checksum_is_rebuilt(cache, tmp_path):
    _build_in_subprocess(cache)
    path = _expected_path(cache)
    assert native.cached_library_problem(str(path)) is None
    marker = _plant(tmp_path, path)  # swapped in after the build: the recorded checksum no longer matches
    assert "differs" in native.cached_library_problem(str(path))
    with pytest.warns(RuntimeWarning, match="SHA-256"):
        fn = native.alti_l1_kernel(DTYPE, HEADS)
    assert fn is not None and not marker.exists()


def test_a_truncated_library_is_rebuilt_not_loaded(cache):
    _build_in_subprocess(cache)
    path = _expected_path(cache)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # a torn write
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        fn = native.alti_l1_kernel(DTYPE, HEADS)
    assert fn is not None and native.kernel_self_check(fn, DTYPE, HEADS) is None
    assert path.stat().st_size == len(data) or native.cached_library_problem(str(path)) is None


def test_a_folder_others_can_write_is_not_used(cache):
    os.chmod(cache, 0o777)
    try:
        with pytest.warns(RuntimeWarning, match=str(cache)):
            fn = native.alti_l1_kernel(DTYPE, HEADS)
        assert fn is not None
        assert not list(cache.glob("*.so")), "built into a folder others can write"
    finally:
        os.chmod(cache, 0o700)


def test_a_new_cache_folder_is_private(monkeypatch, tmp_path):
    folder = tmp_path / "fresh" / "kernels"
    monkeypatch.setenv(native.KERNEL_DIR_ENV, str(folder))
    native.clear_loaded_kernels()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert native.alti_l1_kernel(DTYPE, HEADS) is not None
        assert folder.stat().st_mode & 0o777 == 0o700
        (lib,) = folder.glob("*.so")
        assert Path(str(lib) + ".sha256").read_text().strip() == native.file_sha256(str(lib))
    finally:
        native.clear_loaded_kernels()


def test_a_faulty_kernel_fails_its_self_check(cache, tmp_path):
    r"""Even a library that passes the checksum (written by this user) is checked against plain torch."""
    path = _expected_path(cache)
    _plant(tmp_path, path)
    (cache / (path.name + ".sha256")).write_text(native.file_sha256(str(path)) + "\n")
    with pytest.warns(RuntimeWarning, match="self-check"):
        assert native.alti_l1_kernel(DTYPE, HEADS) is None
    assert "self-check" in native.native_unavailable_reason()
