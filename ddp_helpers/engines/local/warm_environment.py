"""When a warm launch gives the same result as a cold one: which environment variables the warm process's
modules read as they loaded (a launch that differs in one of them runs cold), and fingerprints of what it
imported from disk (torch, the installed packages). The kernel's side (`warm.py`) and the zygote
(`zygote.py`) both use it.
"""

from __future__ import annotations

import os

# Set per launch or per rank, and read later than import (when CUDA starts, a process group or a
# rendezvous is created): they may differ between the warm process and a launch.
RUNTIME_ENV = ("CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
RUNTIME_ENV_PREFIXES = ("DDP_HELPERS_", "TORCHELASTIC_")  # the launcher's and torchrun's own, per launch
# Rewritten all the time by the program hosting the launcher, read by no library at import.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


def _set_by_torch_to_its_default(key: str, value: str) -> bool:
    """True for a variable torch writes into os.environ itself, with the value it means by default: the
    first optimizer step in a kernel sets TORCHINDUCTOR_CACHE_DIR so, which changes nothing."""
    if key != "TORCHINDUCTOR_CACHE_DIR":
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(value) == os.path.abspath(default_cache_dir())


# Read when the pre-imported modules load, where the zygote cannot see it: by native code (OpenMP, BLAS,
# the allocator, the dynamic loader, the interpreter itself), or by a library scanning the environment for
# its prefix (tqdm's TQDM_*).
IMPORT_TIME_ENV_PREFIXES = (
    "OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "LD_", "MALLOC_", "CUDA_", "NCCL_", "PYTHON", "TORCH", "PYTORCH_",
    "TQDM_", "NPY_", "NUMPY_", "LC_", "LANG", "DNNL_", "ONEDNN_", "MKLDNN_", "GLOG_", "KINETO_", "CUBLAS",
    "CUDNN_", "HIP_", "HSA_", "ROCM_", "ROCR_",
)


def _compared(env: dict[str, str], read: set[str] | None) -> dict[str, str]:
    return {key: value for key, value in env.items()
            if key not in RUNTIME_ENV and key not in VOLATILE_ENV and not key.startswith(RUNTIME_ENV_PREFIXES)
            and (read is None or key in read or key.startswith(IMPORT_TIME_ENV_PREFIXES))
            and not _set_by_torch_to_its_default(key, value)}


def environment_mismatch(zygote_env: dict[str, str], launch_env: dict[str, str],
                         read: set[str] | None = None) -> str | None:
    """The first variable whose value differs between the warm process and a launch, as a short note, or None.

    Only variables the warm process's modules read as they loaded count (`read`: those seen read by Python
    code, plus the families native code and prefix scans read; None: every variable): a warm rank would
    behave as if it had the warm process's value of those, where a fresh process reads its own. Any other
    variable a rank simply finds in its environment."""
    ours, theirs = _compared(zygote_env, read), _compared(launch_env, read)
    for key in sorted(set(ours) | set(theirs)):
        if ours.get(key) != theirs.get(key):
            return (f"{key}={theirs.get(key)!r} here, {ours.get(key)!r} in the Python the ranks are usually forked "
                    "from, which read it as it loaded")
    return None


def torch_fingerprint() -> str:
    """Changes when torch is reinstalled (its version file and package folder are rewritten)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    folder = os.path.dirname(spec.origin)
    stats = [os.stat(os.path.join(folder, name)) for name in ("__init__.py", "version.py")]
    return ";".join(f"{s.st_ino}:{s.st_mtime_ns}:{s.st_size}" for s in stats)


def packages_fingerprint() -> str:
    """Changes when a package is installed or removed (`%pip install -e ./mylib` adds a .pth file and a
    dist-info folder): the site-packages folders' own modification times. A process reads .pth files
    only when it starts, so the warm process cannot see such a package; a fresh one can."""
    import site

    folders = [*site.getsitepackages(), site.getusersitepackages()]
    stamps = []
    for folder in folders:
        try:
            stamps.append(f"{folder}:{os.stat(folder).st_mtime_ns}")
        except OSError:
            stamps.append(f"{folder}:absent")
    return ";".join(stamps)


def installed_fingerprint() -> dict[str, str]:
    """What the warm process imported from disk, as the kernel compares it with the disk now."""
    return {"torch": torch_fingerprint(), "packages": packages_fingerprint()}
