"""The local engine, the default job: torchrun agents on this machine, cold or warm.

- `job`: `LocalJob`, its options and its checks against this machine's GPUs (`Hardware`);
- `engine`: `LocalEngine`, which writes a `supervisor_spec` and starts the `supervisor` (fresh, or forked
  from the warm process: `warm` on the kernel's side, `zygote` the warm process, `_zygote_stub` a worker's
  way in); the supervisor runs torchrun's `agents` and writes their outcome.
"""

from .job import Hardware, LocalJob, detect_hardware  # noqa: F401
