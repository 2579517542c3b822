"""Deep dive 4b's quiz: its questions, answers and explanations, kept here rather than in the notebook's cells,
where the right answer would sit in full view above the radio buttons."""

from ...quiz import Question

QUESTIONS = [
    Question("Nodes gpu-b and gpu-a run the same torchrun command with the c10d rendezvous; gpu-b starts a minute "
             "earlier and says --node-rank 0. Which one is machine 0 (GROUP_RANK 0)?",
             ("gpu-b: it arrived first", "gpu-b: it said --node-rank 0", "gpu-a: its name sorts first"), 2,
             "c10d ignores --node-rank and the order of arrival: it sorts the agents by (address, process id) and "
             "numbers them in that order.",
             "Look at which agent got GROUP_RANK 0 in the --local-addr demonstration."),
    Question("A job runs with --nnodes 1:2 on one machine, and a second machine's agent joins. What happens to "
             "the running workers?",
             ("They go on; the new workers join at the next step", "Every worker stops and restarts in the bigger "
              "world, resuming from the snapshot, without using up a restart",
              "The job fails: the world size is fixed at the start"), 1,
             "A membership change is a new rendezvous: the agents stop their workers and start them again in the new "
             "world. It does not count against --max-restarts.",
             "What did the elastic cell's log show at the moment the second agent came?"),
    Question("Slurm will stop a job at its time limit. What lets the job save first?",
             ("Nothing: Slurm kills the processes at once", "#SBATCH --signal=B:USR1@60: a signal 60 s before the "
              "limit, which the script traps to save (and --requeue to come back)", "torchrun's --max-restarts"), 1,
             "The signal is a warning the job can act on: agree on a step across ranks, save, and requeue itself; "
             "the same command then resumes from the snapshot.",
             "What did the preempted job receive before it saved?"),
]
