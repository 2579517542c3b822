"""Lesson 5: torch's own flight-recorder analyser, `torchfrtrace` (`torch/distributed/flight_recorder/
fr_trace.py`), run on the dumps the launcher keeps of a timed-out run, and its verdict read as data."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from ....cells import is_cell_script
from ....python_command import python_module_command
from ....result import RunResult
from ....run_folder import RunFolder


@dataclass(frozen=True)
class FrTraceVerdict:
    """What torchfrtrace found first: the collective's sequence number in its group, its name, and the ranks
    that never joined it. `text`: its report, the stack trace cut to the cell's own frame."""

    text: str
    sequence: int | None
    collective: str
    missing_ranks: frozenset[int]


def torchfrtrace(run: RunResult) -> FrTraceVerdict:
    """`torchfrtrace <run folder>/flight_recorder --prefix rank` on `run`'s dumps (as a terminal would run it)."""
    dumps = RunFolder(run.config.run_dir, run.run_id).flight_recorder_dump(0).parent
    done = subprocess.run(python_module_command("torch.distributed.flight_recorder.fr_trace", str(dumps), "--prefix", "rank"), capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr  # it reports through logging: on stderr
    lines = [line for line in said.splitlines() if not line.startswith("tabulate is not installed")]
    script = run.config.script.name
    # The stack's other frames are torch's, and the launcher's own plumbing around the cell: left out.
    text = "\n".join(line for line in lines if not re.search(r"\S+:\d+$", line) or f"/{script}:" in line).strip()
    if is_cell_script(run.config.script):  # a cell's script numbers its lines as the cell does
        text = re.sub(rf"\S*/{re.escape(script)}:(\d+)$", rf"{script}:\1 (line \1 of the cell)", text, flags=re.M)
    sequence = re.search(r"sequence number: (\d+)", text)
    collective = re.search(r"^collective: (\S+)", text, flags=re.M)
    missing = re.search(r"missing ranks: \{([\d, ]*)\}", text)
    return FrTraceVerdict(text=text, sequence=int(sequence.group(1)) if sequence else None,
                          collective=collective.group(1) if collective else "",
                          missing_ranks=frozenset(int(r) for r in re.findall(r"\d+", missing.group(1))) if missing else frozenset())
